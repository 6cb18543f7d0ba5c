"""A site's per-subject work on its own cluster: batches of subjects decoded by Pydra's Dask or SLURM worker.

The load stage reads every file's header on the site's machine (the checks
that name a bad file), then hands the expensive part, decoding, masking,
standardising and parcel-averaging each run, to Pydra tasks of
``cluster.subjects_per_task`` subjects each, run by the worker the site
configured (``cluster`` in ``site.toml``). Each task writes its runs as
``.npy`` blocks into the site's private working folder, which the cluster's
nodes must share; the load stage then streams them in order into the site
matrix and deletes them. The matrix is the one the threads of
:func:`dpneuro.data.load.load_site` give, bit for bit, and nothing leaves the site:
the cluster is the site's own.
"""

import functools
import json
import os
import shutil
import typing as ty
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("NO_ET", "1")  # Pydra's online version check costs seconds offline

import numpy as np  # noqa: E402
import pydra  # noqa: E402

from dpneuro._utils.errors import DataValidationError  # noqa: E402
from dpneuro._utils.parallel import ordered_map, resolve_workers  # noqa: E402
from dpneuro.config import SUBJECTS_PER_TASK  # noqa: E402
from dpneuro.data.images import load_mask  # noqa: E402
from dpneuro.data.load import decode_run  # noqa: E402
from dpneuro.data.parcellation import space_parcels  # noqa: E402

__all__ = ["cluster_decoder", "decode_batch"]


def decode_batch(runs: list[str], batch: int, space_json: str, standardize: bool, detrend: bool,
                 out_dir: str) -> str:
    """Decode ``runs`` (threads on this node) into ``out_dir``; JSON: the blocks' files, or the data error."""
    space = json.loads(Path(space_json).read_text())
    mask, _ = load_mask(space["mask"])
    decode = functools.partial(decode_run, mask=mask, standardize=standardize, detrend=detrend,
                               parcels=space_parcels(space))
    files = []
    try:
        for i, block in enumerate(ordered_map(decode, runs, workers=resolve_workers())):
            files.append(str(Path(out_dir) / f"{batch:05d}-{i:04d}.npy"))
            np.save(files[-1], block)
    except DataValidationError as exc:  # a data error is the user's, not a crash: carried back as a record
        return json.dumps({"error": str(exc)})
    return json.dumps({"blocks": files})


@pydra.mark.task
def decode_batch_task(runs: ty.List[str], batch: int, space_json: str, standardize: bool, detrend: bool,
                      out_dir: str) -> str:
    return decode_batch(runs, batch, space_json, standardize, detrend, out_dir)


def _plugin_args(cluster: dict) -> dict:
    """The Pydra worker's arguments."""
    if cluster["worker"] == "slurm":
        return {"sbatch_args": cluster["sbatch_args"]} if cluster.get("sbatch_args") else {}
    return {"address": cluster["address"]}


def _submit(cluster: dict, batches: list[list[str]], space_json: str, standardize: bool, detrend: bool,
            work: Path) -> list[dict]:
    """Run every batch on the cluster; their records, in batch order."""
    blocks = work / "blocks"
    blocks.mkdir(parents=True)
    task = decode_batch_task(name="decode", space_json=space_json, standardize=standardize, detrend=detrend,
                             out_dir=str(blocks), cache_dir=str(work / "pydra-cache")).split(
        ("runs", "batch"), runs=batches, batch=list(range(len(batches))))
    with pydra.Submitter(plugin=cluster["worker"], **_plugin_args(cluster)) as sub:
        sub(task)
    results = task.result()
    records = []
    for b, res in enumerate(results if isinstance(results, list) else [results]):
        if res is None or res.errored:
            raise RuntimeError(f"decoding batch {b} ({batches[b][0]} ...) failed on the {cluster['worker']} "
                               f"cluster; its crash report is under {work / 'pydra-cache'}")
        records.append(json.loads(res.output.out))
    for rec in records:
        if "error" in rec:
            raise DataValidationError(rec["error"])
    return records


def cluster_decoder(cluster: dict, *, space_json: str, standardize: bool, detrend: bool = False, work: Path):
    """A ``decoder`` for :func:`dpneuro.data.load.load_site` that decodes the runs on ``cluster`` (see module notes).

    ``work`` is a private folder every cluster node can read and write; it is
    emptied first and removed when the blocks have been read.
    """
    work = Path(work)

    def decode(subjects: list[list[Path]]) -> ty.Iterator[np.ndarray]:
        per = cluster.get("subjects_per_task", SUBJECTS_PER_TASK)
        batches = [[str(p) for runs in subjects[i:i + per] for p in runs] for i in range(0, len(subjects), per)]
        shutil.rmtree(work, ignore_errors=True)
        done = False
        try:
            # Pydra's submitter drives an event loop of its own: a fresh thread has none running, also when this
            # is called from inside a Pydra task or a notebook
            with ThreadPoolExecutor(1, thread_name_prefix="dpneuro-cluster") as pool:
                records = pool.submit(_submit, cluster, batches, space_json, standardize, detrend, work).result()
            for rec in records:
                for f in rec["blocks"]:
                    block = np.load(f)
                    os.unlink(f)
                    yield block
            done = True
        finally:
            shutil.rmtree(work if done else work / "blocks", ignore_errors=True)  # a failure keeps Pydra's crash report

    return decode
