"""A site's own cluster decodes its subjects: Pydra's Dask worker on a local cluster (127.0.0.1) and its SLURM
worker against a stand-in scheduler give the site matrix the threads give, bit for bit; a data error found on
the cluster reaches the user naming the file, and nothing is left behind.

CI sets DPNEURO_REQUIRE_CLUSTER=1 (and installs the ``cluster`` extra), so a missing dask.distributed fails there.
"""

import json
import os
import shutil
import stat
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpneuro._utils.errors import DataValidationError
from dpneuro.config import ConfigError, RunConfig
from dpneuro.datasets.synth import make_consortium
from dpneuro.run import pipeline

R = 4


def _require_distributed():
    try:
        import distributed  # noqa: F401
    except ImportError:
        if os.environ.get("DPNEURO_REQUIRE_CLUSTER") == "1":
            pytest.fail("dask.distributed is required here (DPNEURO_REQUIRE_CLUSTER=1): pip install '.[cluster]'")
        pytest.skip("dask.distributed not installed (pip install '.[cluster]')")


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    man = make_consortium(root / "data", n_sites=3, subjects_per_site=5, n_components=R, n_timepoints=40,
                          space="grid30", random_state=7)
    # site-01's first two files are one person's two runs: batches must keep a subject's runs together, in order
    files = sorted(Path(man["sites"][0]["path"]).glob("*.nii*"))
    tsv = root / "subjects.tsv"
    tsv.write_text("file\tsubject\n" + "".join(f"{f.name}\t{'p0' if i < 2 else f'p{i}'}\n"
                                               for i, f in enumerate(files)))
    return root, man, tsv


def _config(root: Path, man: dict, tsv: Path, out: str, **kw) -> RunConfig:
    sites = [{"name": s["site"], "path": s["path"]} for s in man["sites"]]
    sites[0]["subjects_tsv"] = str(tsv)
    d = {"sites": sites, "out": str(root / out), "mask": man["mask"], "n_components": R, "parcels": 0, "seed": 2, **kw}
    return RunConfig.from_dict(d).validate()


def _matrices(load_jsons: list[str]) -> list[np.ndarray]:
    out = []
    for j in load_jsons:
        rec = json.loads(Path(j).read_text())
        X = np.load(rec["X"])
        assert X.flags.f_contiguous
        assert not (Path(rec["X"]).parent / "cluster").exists()  # blocks and Pydra's cache removed
        out.append(X)
    return out


@pytest.fixture(scope="module")
def threads(consortium):
    root, man, tsv = consortium
    return {p: _matrices(pipeline.run_stages(_config(root, man, tsv, f"threads-{p}", parcels=p), until="load")["load"])
            for p in (0, 12)}


@pytest.fixture(scope="module")
def dask_cluster():
    _require_distributed()
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as lc:
        yield lc


@pytest.mark.parametrize("parcels", [0, 12])
def test_dask_worker_gives_the_matrix_of_the_threads(consortium, threads, dask_cluster, parcels):
    root, man, tsv = consortium
    cfg = _config(root, man, tsv, f"dask-{parcels}", parcels=parcels,
                  cluster={"worker": "dask", "address": dask_cluster.scheduler_address, "subjects_per_task": 2})
    before = _decode_tasks(dask_cluster)
    got = _matrices(pipeline.run_stages(cfg, until="load")["load"])
    for a, b in zip(got, threads[parcels]):
        np.testing.assert_array_equal(a, b)
    # the cluster did the work: ceil(subjects / 2) tasks per site (site-01 has 4 people in 5 files)
    assert _decode_tasks(dask_cluster) - before == 2 + 3 + 3


def _decode_tasks(lc) -> int:
    """Tasks Pydra's Dask worker finished on this cluster so far (each a ``load_and_run`` of one batch)."""
    prefix = lc.scheduler.task_prefixes.get("load_and_run")
    return 0 if prefix is None else int(prefix.state_counts["memory"])  # every finished task enters memory once


def test_a_data_error_on_the_cluster_names_the_file_and_leaves_nothing(consortium, dask_cluster, tmp_path):
    root, man, tsv = consortium
    site = Path(man["sites"][1]["path"])
    bad = tmp_path / "site"
    shutil.copytree(site, bad)
    victim = sorted(bad.glob("*.nii*"))[3]
    img = nib.load(victim)
    data = np.asarray(img.dataobj, dtype=np.float32)
    mask = np.asarray(nib.load(man["mask"]).dataobj) > 0
    data[np.argwhere(mask)[0][0], np.argwhere(mask)[0][1], np.argwhere(mask)[0][2], 5] = np.nan  # only decoding sees it
    nib.Nifti1Image(data, img.affine, img.header).to_filename(victim)
    d = _config(root, man, tsv, "dask-bad").to_json()
    d["sites"][1]["path"] = str(bad)
    cfg = RunConfig.from_dict({**d, "cluster": {"worker": "dask", "address": dask_cluster.scheduler_address}})
    with pytest.raises(DataValidationError, match=rf"{victim.name}: non-finite values"):
        pipeline.run_stages(cfg, until="load")
    left = sorted(p.name for p in Path(cfg.out, "work").glob("load-site-02-*/*"))
    assert "X.npy" not in left and "site.json" not in left
    assert not list(Path(cfg.out, "work").glob("load-site-02-*/cluster/blocks"))


FAKE_SBATCH = r"""#!/bin/sh
# stand-in for SLURM's sbatch: runs the job script at once and records it; the last argument is the script
log="$(dirname "$0")/jobs.log"
n=$$  # Pydra submits the batches at once: this process's id is a unique job id
for a in "$@"; do script="$a"; done
out=""; err=""
for a in "$@"; do case "$a" in --output=*) out="${a#--output=}";; --error=*) err="${a#--error=}";; esac; done
out=$(echo "$out" | sed "s/%j/$n/"); err=$(echo "$err" | sed "s/%j/$n/")
/bin/sh "$script" > "$out" 2> "$err"; rc=$?
echo "$n $rc $*" >> "$log"
echo "Submitted batch job $n"
"""
FAKE_SACCT = r"""#!/bin/sh
# stand-in for sacct -n -X -j ID -o JobID,State,ExitCode
log="$(dirname "$0")/jobs.log"
id="$4"
rc=$(awk -v id="$id" '$1 == id {print $2}' "$log")
if [ "$rc" = 0 ]; then echo "$id COMPLETED 0:0"; else echo "$id FAILED $rc:0"; fi
"""


def test_slurm_worker_submits_batches_with_the_sites_sbatch_args(consortium, threads, tmp_path, monkeypatch):
    root, man, tsv = consortium
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("sacct", FAKE_SACCT), ("squeue", "#!/bin/sh\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cfg = _config(root, man, tsv, "slurm",
                  cluster={"worker": "slurm", "sbatch_args": "--mem=2G --time=00:10:00", "subjects_per_task": 3})
    got = _matrices(pipeline.run_stages(cfg, until="load")["load"])
    for a, b in zip(got, threads[0]):
        np.testing.assert_array_equal(a, b)
    jobs = (bin_dir / "jobs.log").read_text().splitlines()
    assert len(jobs) == 2 * 3  # ceil(5 / 3) jobs per site (site-01: ceil(4 / 3))
    assert all(j.split()[1] == "0" and "--mem=2G --time=00:10:00" in j for j in jobs)


def test_cluster_settings_are_checked_before_anything_runs(consortium, monkeypatch):
    root, man, tsv = consortium

    def check(cluster, match, **kw):
        with pytest.raises(ConfigError, match=match):
            RunConfig.from_dict({**_config(root, man, tsv, "x").to_json(), "cluster": cluster}).validate(**kw)

    check({"worker": "spark"}, r"cluster\.worker")
    check({"worker": "dask", "nodes": 3}, "keys among")
    check({"worker": "dask"}, r"cluster\.address")  # no implicit cluster: the site names its scheduler
    check({"worker": "dask", "address": "tcp://127.0.0.1:1", "subjects_per_task": 0}, "subjects_per_task")
    check({"worker": "slurm", "address": "tcp://x:1"}, r"only for worker = 'dask'")
    monkeypatch.setenv("PATH", "/nonexistent")
    check({"worker": "slurm"}, "sbatch")
    # the aggregator holds no data and runs no per-subject work: its copy is not checked against this machine
    RunConfig.from_dict({**_config(root, man, tsv, "x").to_json(), "cluster": {"worker": "slurm"}}).validate(
        data_sites=[])
    assert RunConfig.from_dict({**_config(root, man, tsv, "x").to_json()}).cluster == {}


def test_pydra_workflow_hands_its_sites_subjects_to_the_cluster(consortium, threads, dask_cluster):
    """The consortium workflow's load task (itself a Pydra task) submits the batches to the site's cluster."""
    from dpneuro.workflows import run_workflow

    root, man, tsv = consortium
    cfg = _config(root, man, tsv, "dask-workflow", plan="conv",  # CAPE cannot balance 4 people against 5
                  cluster={"worker": "dask", "address": dask_cluster.scheduler_address})
    before = _decode_tasks(dask_cluster)
    out = run_workflow(cfg)
    for a, b in zip(_matrices(out["load"]), threads[0]):
        np.testing.assert_array_equal(a, b)
    assert _decode_tasks(dask_cluster) - before == 3  # one batch of up to 8 subjects per site
    assert Path(out["report"]).exists()
