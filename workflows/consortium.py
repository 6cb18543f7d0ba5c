"""The consortium workflow: load (split over sites) -> reduce -> unmix -> states -> maps -> report.

Every node wraps one function of :mod:`dpneuro.pipeline` and passes file paths
(JSON/NPY/NIfTI), never arrays, so Pydra hashes strings, not data. Each node
also takes the digest of the configuration fields its stage depends on, so a
re-run with the same cache skips every finished stage and a changed privacy
budget re-runs only the stages downstream of it.
"""


import os
import typing as ty
from pathlib import Path

os.environ.setdefault("NO_ET", "1")  # Pydra's online version check costs seconds offline

import pydra  # noqa: E402

from dpneuro import pipeline  # noqa: E402
from dpneuro.config import RunConfig  # noqa: E402


@pydra.mark.task
def space_task(cfg_json: str, key: str) -> str:
    return pipeline.stage_space(cfg_json, key)


@pydra.mark.task
def load_task(cfg_json: str, site_name: str, space_json: str, key: str) -> str:
    return pipeline.stage_load(cfg_json, site_name, space_json, key)


@pydra.mark.task
def reduce_task(cfg_json: str, site_jsons: ty.List[str], key: str) -> str:
    return pipeline.stage_reduce(cfg_json, list(site_jsons), key)


@pydra.mark.task
def unmix_task(cfg_json: str, site_jsons: ty.List[str], reduce_json: str, key: str) -> str:
    return pipeline.stage_unmix(cfg_json, list(site_jsons), reduce_json, key)


@pydra.mark.task
def states_task(cfg_json: str, site_jsons: ty.List[str], reduce_json: str, key: str) -> str:
    return pipeline.stage_states(cfg_json, list(site_jsons), reduce_json, key)


@pydra.mark.task
def maps_task(cfg_json: str, site_jsons: ty.List[str], space_json: str, reduce_json: str, unmix_json: str,
              states_json: str, key: str) -> str:
    return pipeline.stage_maps(cfg_json, list(site_jsons), space_json, reduce_json, unmix_json, states_json, key)


@pydra.mark.task
def report_task(cfg_json: str, site_jsons: ty.List[str], maps_json: str, reduce_json: str, unmix_json: str,
                states_json: str, key: str) -> str:
    return pipeline.stage_report(cfg_json, list(site_jsons), maps_json, reduce_json, unmix_json, states_json, key)


def build_workflow(cfg: RunConfig, cache_dir=None) -> pydra.Workflow:
    """The Pydra workflow of one consortium run (all roles in this process)."""
    cfg_json = pipeline.write_config(cfg)
    cache_dir = str(cache_dir or Path(cfg.out) / "work" / "pydra-cache")
    key = {stage: pipeline.stage_key(cfg, stage) for stage in pipeline.STAGE_FIELDS}
    wf = pydra.Workflow(name="dpneuro", input_spec=["cfg_json"], cache_dir=cache_dir, cfg_json=cfg_json)
    wf.add(space_task(name="space", cfg_json=wf.lzin.cfg_json, key=key["space"]))
    wf.add(load_task(name="load", cfg_json=wf.lzin.cfg_json, space_json=wf.space.lzout.out,
                     key=key["load"]).split("site_name", site_name=[s.name for s in cfg.sites])
           .combine("site_name"))
    wf.add(reduce_task(name="reduction", cfg_json=wf.lzin.cfg_json, site_jsons=wf.load.lzout.out,
                       key=key["reduce"]))
    wf.add(unmix_task(name="unmix", cfg_json=wf.lzin.cfg_json, site_jsons=wf.load.lzout.out,
                      reduce_json=wf.reduction.lzout.out, key=key["unmix"]))
    wf.add(states_task(name="states", cfg_json=wf.lzin.cfg_json, site_jsons=wf.load.lzout.out,
                       reduce_json=wf.reduction.lzout.out, key=key["states"]))
    wf.add(maps_task(name="maps", cfg_json=wf.lzin.cfg_json, site_jsons=wf.load.lzout.out,
                     space_json=wf.space.lzout.out, reduce_json=wf.reduction.lzout.out,
                     unmix_json=wf.unmix.lzout.out, states_json=wf.states.lzout.out, key=key["maps"]))
    wf.add(report_task(name="report", cfg_json=wf.lzin.cfg_json, site_jsons=wf.load.lzout.out,
                       maps_json=wf.maps.lzout.out, reduce_json=wf.reduction.lzout.out,
                       unmix_json=wf.unmix.lzout.out, states_json=wf.states.lzout.out, key=key["report"]))
    wf.set_output([("space", wf.space.lzout.out), ("load", wf.load.lzout.out), ("reduce", wf.reduction.lzout.out),
                   ("unmix", wf.unmix.lzout.out), ("states", wf.states.lzout.out), ("maps", wf.maps.lzout.out),
                   ("report", wf.report.lzout.out)])
    return wf


class WorkflowError(RuntimeError):
    """A stage failed; the message is the stage's own error, in one line."""


def _one_line(exc: BaseException) -> str:
    """Pydra wraps a task's error as (message, 'full crash report is here: <file>'): keep the message."""
    parts = [str(a) for a in exc.args] or [type(exc).__name__]
    msg = " ".join(parts[0].split()) or type(exc).__name__
    crash = next((p.split("is here:", 1)[1].strip() for p in parts[1:] if "is here:" in p), None)
    return msg + (f" (crash report: {crash})" if crash else "")


def run_workflow(cfg: RunConfig, *, plugin: str = "serial", cache_dir=None, prepared: bool = False,
                 **plugin_args) -> dict:
    """Build and run the workflow; returns each stage's output file, as :func:`dpneuro.pipeline.run_stages`.

    Relative paths in ``cfg`` are taken against the current working folder
    (Pydra runs every stage from its own cache folder) and a total ``epsilon``
    is planned first (:func:`dpneuro.pipeline.prepare`), unless ``prepared``
    says the caller already did.
    """
    if not prepared:
        cfg, _ = pipeline.prepare(cfg)
    wf = build_workflow(cfg, cache_dir)
    if plugin == "cf":
        from dpneuro.io import resolve_workers

        plugin_args.setdefault("n_procs", resolve_workers())  # the sites load in parallel, one per core
    try:
        with pydra.Submitter(plugin=plugin, **plugin_args) as sub:
            sub(wf)
    except Exception as exc:  # noqa: BLE001 - re-raised as one readable line
        raise WorkflowError(_one_line(exc)) from exc
    res = wf.result(return_inputs=False)
    if res.errored:
        raise RuntimeError(f"workflow failed; see the crash files under {wf.cache_dir}")
    out = {name: getattr(res.output, name) for name in pipeline.STAGES}
    out["load"] = list(out["load"])
    return out
