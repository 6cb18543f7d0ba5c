"""The consortium workflow: space -> load (split over sites) -> each release of the stage table -> maps -> report.

Every node wraps one function of :mod:`dpneuro.pipeline` and passes file paths
(JSON/NPY/NIfTI), never arrays, so Pydra hashes strings, not data. Each node
also takes the digest of the configuration fields its stage depends on, so a
re-run with the same cache skips every finished stage and a changed privacy
budget re-runs only the stages downstream of it.
"""


import os
import shutil
import traceback
import typing as ty
from pathlib import Path

os.environ.setdefault("NO_ET", "1")  # Pydra's online version check costs seconds offline

import pydra  # noqa: E402

from dpneuro import pipeline, stages  # noqa: E402
from dpneuro.config import RunConfig  # noqa: E402
from dpneuro.io import resolve_workers  # noqa: E402


#: a stage's error travels through the remaining tasks as this prefix and its message (see :func:`_guard`)
ERROR = "dpneuro-error: "


def _guard(stage, cfg_json: str, *args):
    """Run a stage, unless an input is an upstream error; return its error instead of raising.

    No task fails under Pydra: Pydra 0.25's concurrent worker can spin forever
    pruning the graph after a failed task. The first error is handed down to
    the workflow's outputs and raised there (:func:`run_workflow`), and its
    traceback is kept next to the run's configuration.
    """
    for v in args:
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, str) and x.startswith(ERROR):
                return x
    try:
        return stage(cfg_json, *args)
    except Exception as exc:  # noqa: BLE001 - carried to run_workflow, which raises it
        crash = Path(cfg_json).parent / f"error-{stage.__name__}.txt"
        crash.write_text(traceback.format_exc())
        return f"{ERROR}{' '.join(str(exc).split()) or type(exc).__name__} (traceback: {crash})"


@pydra.mark.task
def space_task(cfg_json: str, cache_key: str) -> str:
    return _guard(pipeline.stage_space, cfg_json, cache_key)


@pydra.mark.task
def load_task(cfg_json: str, site_name: str, space_json: str, cache_key: str) -> str:
    return _guard(pipeline.stage_load, cfg_json, site_name, space_json, cache_key)


@pydra.mark.task
def release_task(cfg_json: str, site_jsons: ty.List[str], stage: str, previous_json: str, cache_key: str) -> str:
    return _guard(pipeline.stage_release, cfg_json, list(site_jsons), stage, previous_json, cache_key)


@pydra.mark.task
def maps_task(cfg_json: str, site_jsons: ty.List[str], last_json: str, cache_key: str) -> str:
    return _guard(pipeline.stage_maps, cfg_json, list(site_jsons), last_json, cache_key)


@pydra.mark.task
def report_task(cfg_json: str, site_jsons: ty.List[str], maps_json: str, cache_key: str) -> str:
    return _guard(pipeline.stage_report, cfg_json, list(site_jsons), maps_json, cache_key)


def build_workflow(cfg: RunConfig, cache_dir=None) -> pydra.Workflow:
    """The Pydra workflow of one consortium run (all roles in this process): a node per stage of
    :func:`dpneuro.pipeline.run_order`, each release from :data:`dpneuro.stages.RELEASES` reading the record
    of the one before."""
    cfg_json = pipeline.write_config(cfg)
    cache_dir = str(cache_dir or Path(cfg.out) / "work" / "pydra-cache")
    key = {stage: pipeline.stage_key(cfg, stage) for stage in pipeline.run_order()}
    wf = pydra.Workflow(name="dpneuro", input_spec=["cfg_json"], cache_dir=cache_dir, cfg_json=cfg_json)
    wf.add(space_task(name="space", cfg_json=wf.lzin.cfg_json, cache_key=key["space"]))
    wf.add(load_task(name="load", cfg_json=wf.lzin.cfg_json, space_json=wf.space.lzout.out,
                     cache_key=key["load"]).split("site_name", site_name=[s.name for s in cfg.sites])
           .combine("site_name"))
    last = wf.space.lzout.out
    for rel in stages.RELEASES:
        wf.add(release_task(name=f"release_{rel.name}", cfg_json=wf.lzin.cfg_json, site_jsons=wf.load.lzout.out,
                            stage=rel.name, previous_json=last, cache_key=key[rel.name]))
        last = getattr(wf, f"release_{rel.name}").lzout.out
    wf.add(maps_task(name="maps", cfg_json=wf.lzin.cfg_json, site_jsons=wf.load.lzout.out, last_json=last,
                     cache_key=key["maps"]))
    wf.add(report_task(name="report", cfg_json=wf.lzin.cfg_json, site_jsons=wf.load.lzout.out,
                       maps_json=wf.maps.lzout.out, cache_key=key["report"]))
    wf.set_output([("space", wf.space.lzout.out), ("load", wf.load.lzout.out),
                   *((r.name, getattr(wf, f"release_{r.name}").lzout.out) for r in stages.RELEASES),
                   ("maps", wf.maps.lzout.out), ("report", wf.report.lzout.out)])
    return wf


class WorkflowError(RuntimeError):
    """A stage failed; the message is the stage's own error, in one line."""


def _one_line(exc: BaseException) -> str:
    """Pydra wraps a task's error as (message, 'full crash report is here: <file>'): keep the message."""
    parts = [str(a) for a in exc.args] or [type(exc).__name__]
    msg = " ".join(parts[0].split()) or type(exc).__name__
    crash = next((p.split("is here:", 1)[1].strip() for p in parts[1:] if "is here:" in p), None)
    return msg + (f" (crash report: {crash})" if crash else "")


def run_workflow(cfg: RunConfig, *, plugin: str = "cf", cache_dir=None, prepared: bool = False,
                 **plugin_args) -> dict:
    """Build and run the workflow; returns each stage's output file, as :func:`dpneuro.pipeline.run_stages`.

    Relative paths in ``cfg`` are taken against the current working folder
    (Pydra runs every stage from its own cache folder) and a total ``epsilon``
    is planned first (:func:`dpneuro.pipeline.prepare`), unless ``prepared``
    says the caller already did. ``plugin``: Pydra's concurrent worker by
    default (the sites load at the same time, one process per usable core), or
    "serial". A stage's error is raised as :class:`WorkflowError`, in one line.
    """
    if not prepared:
        cfg, _ = pipeline.prepare(cfg)
    wf = build_workflow(cfg, cache_dir)
    if plugin == "cf":
        plugin_args.setdefault("n_procs", resolve_workers())  # the sites load in parallel, one per core
    try:
        with pydra.Submitter(plugin=plugin, **plugin_args) as sub:
            sub(wf)
    except Exception as exc:  # noqa: BLE001 - re-raised as one readable line
        raise WorkflowError(_one_line(exc)) from exc
    res = wf.result(return_inputs=False)
    if res.errored:
        raise RuntimeError(f"workflow failed; see the crash files under {wf.cache_dir}")
    out = {name: getattr(res.output, name) for name in pipeline.run_order()}
    out["load"] = list(out["load"])
    errors = [x for v in out.values() for x in (v if isinstance(v, list) else [v]) if str(x).startswith(ERROR)]
    if errors:
        # Pydra cached the error as a task's result: the next run must compute again (the stages' own files stay)
        shutil.rmtree(wf.cache_dir, ignore_errors=True)
        raise WorkflowError(errors[0][len(ERROR):])
    return out
