"""The consortium workflow: space -> load (split over sites) -> each release of the stage table -> maps -> report.

Every node wraps one function of :mod:`dpneuro.run.pipeline` and passes file paths
(JSON/NPY/NIfTI), never arrays, so Pydra hashes strings, not data. Each node
also takes the digest of the configuration fields its stage depends on, so a
re-run with the same cache skips every finished stage and a changed privacy
budget re-runs only the stages downstream of it.
"""


import asyncio
import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
import threading
import traceback
import typing as ty
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

os.environ.setdefault("NO_ET", "1")  # Pydra's online version check costs seconds offline

import cloudpickle  # noqa: E402  (Pydra's own format for its results)
import pydra  # noqa: E402

from dpneuro._utils.errors import DpneuroError
from dpneuro._utils.parallel import resolve_workers  # noqa: E402
from dpneuro.config import RunConfig  # noqa: E402
from dpneuro.report.timings import label  # noqa: E402
from dpneuro.run import pipeline, stages  # noqa: E402

#: a stage's error travels through the remaining tasks as this prefix and its message (see :func:`_guard`)
ERROR = "dpneuro-error: "
#: what every failure message ends with: the run's cache never holds a failure (:func:`run_workflow`)
RESUME = "The stages that finished are kept and the failed one was not cached"


def _what_to_do(exc: BaseException) -> str:
    """The user's next step after a stage raised ``exc``."""
    if isinstance(exc, MemoryError):
        return ("it ran out of memory: free some, or run one stage at a time (dpneuro run --plugin serial), then "
                "run the same command again")
    if isinstance(exc, DpneuroError):  # a problem the package names on purpose: an input, a setting, a refusal
        return "correct what the error names, then run the same command again"
    return "run the same command again to retry it; if it fails the same way, report it with the traceback"


def _guard(what: str, site: str, stage, cfg_json: str, *args):
    """Run ``stage`` (named ``what``, at ``site`` for a site's own stage), unless an input is an upstream error;
    return its error instead of raising.

    No task fails under Pydra: Pydra 0.25's concurrent worker can spin forever
    pruning the graph after a failed task. The first error, naming the stage, is handed down to
    the workflow's outputs and raised there (:func:`run_workflow`), and its
    traceback is kept next to the run's configuration, in a file of the stage's own.
    """
    for v in args:
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, str) and x.startswith(ERROR):
                return x
    try:
        return stage(cfg_json, *args)
    except Exception as exc:  # noqa: BLE001 - carried to run_workflow, which raises it
        name = re.sub(r"[^\w.-]", "_", "-".join(filter(None, (what, site))))
        crash = Path(cfg_json).parent / f"error-{name}.txt"
        crash.write_text(traceback.format_exc())
        where = f"stage {what!r}" + (f" at site {site!r}" if site else "")
        return (f"{ERROR}{where} failed: {' '.join(str(exc).split()) or type(exc).__name__} (traceback: {crash}). "
                f"{RESUME}: {_what_to_do(exc)}")


@pydra.mark.task
def space_task(cfg_json: str, cache_key: str) -> str:
    return _guard("space", "", pipeline.stage_space, cfg_json, cache_key)


@pydra.mark.task
def load_task(cfg_json: str, site_name: str, space_json: str, cache_key: str) -> str:
    return _guard("load", site_name, pipeline.stage_load, cfg_json, site_name, space_json, cache_key)


@pydra.mark.task
def release_task(cfg_json: str, site_jsons: ty.List[str], stage: str, previous_json: str, cache_key: str) -> str:
    return _guard(stage, "", pipeline.stage_release, cfg_json, list(site_jsons), stage, previous_json, cache_key)


@pydra.mark.task
def maps_task(cfg_json: str, site_jsons: ty.List[str], last_json: str, cache_key: str) -> str:
    return _guard("maps", "", pipeline.stage_maps, cfg_json, list(site_jsons), last_json, cache_key)


@pydra.mark.task
def report_task(cfg_json: str, site_jsons: ty.List[str], maps_json: str, cache_key: str) -> str:
    return _guard("report", "", pipeline.stage_report, cfg_json, list(site_jsons), maps_json, cache_key)


def build_workflow(cfg: RunConfig, cache_dir=None) -> pydra.Workflow:
    """The Pydra workflow of one consortium run (all roles in this process): a node per stage of
    :func:`dpneuro.run.pipeline.run_order`, each release from :data:`dpneuro.run.stages.RELEASES` reading the record
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


class WorkflowError(DpneuroError, RuntimeError):
    """A stage failed; the message is the stage's own error, in one line."""


def _one_line(exc: BaseException) -> str:
    """Pydra wraps a task's error as (message, 'full crash report is here: <file>'): keep the message."""
    parts = [str(a) for a in exc.args] or [type(exc).__name__]
    msg = " ".join(parts[0].split()) or type(exc).__name__
    crash = next((p.split("is here:", 1)[1].strip() for p in parts[1:] if "is here:" in p), None)
    return msg + (f" (crash report: {crash})" if crash else "")


# -- interruption: SIGINT (Ctrl-C) or SIGTERM stops every worker and leaves a cache the same command resumes from

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _signals_interrupt():
    """Inside, SIGINT and SIGTERM raise :class:`~dpneuro.run.pipeline.Interrupted` in this process, so that
    :func:`run_workflow` can stop its workers and clean up (a SIGTERM would otherwise end it at once and
    orphan them). Pydra's cf workers are forked from this process and inherit the handler: there it lets
    the signal end the worker at once, and this process cleans up after it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set signal handlers
        return
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:  # a forked worker
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        for s in _SIGNALS:  # the first signal starts the clean-up: a second one must not cut it short
            signal.signal(s, signal.SIG_IGN)
        raise pipeline.Interrupted(signum)

    before = {s: signal.signal(s, handler) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _quiet_broken_pool(args) -> None:
    """Once the workers are stopped on purpose, the process pool's manager thread may fail to mark futures
    that are already cancelled (concurrent.futures' InvalidStateError): not an error of the run."""
    if not issubclass(args.exc_type, (concurrent.futures.InvalidStateError, BrokenProcessPool)):
        _THREAD_HOOK(args)


_THREAD_HOOK = threading.excepthook


def _stop_workers(sub: pydra.Submitter, timeout: float = 5.0) -> None:
    """End the worker processes and the submitter's pending tasks, before the submitter closes (its
    process pool would otherwise wait for the running stages to finish)."""
    threading.excepthook = _quiet_broken_pool  # restored once the submitter has closed (run_workflow)
    pool = getattr(sub.worker, "pool", None)  # the cf plugin's ProcessPoolExecutor (serial has none)
    workers = list((getattr(pool, "_processes", None) or {}).values())
    for p in workers:
        p.terminate()
    for p in workers:
        p.join(timeout)
        if p.is_alive():  # stuck in C code that does not return to Python to die
            p.kill()
            p.join(timeout)

    def quiet(loop, context):  # the task the signal hit holds it, and asyncio would print it as never retrieved
        if not isinstance(context.get("exception"), KeyboardInterrupt):
            loop.default_exception_handler(context)

    sub.loop.set_exception_handler(quiet)
    # cancelled rather than dropped: asyncio complains about tasks destroyed while pending, and Pydra
    # releases its locks as they unwind
    pending = asyncio.all_tasks(sub.loop)
    for t in pending:
        t.cancel()
    if pending and not sub.loop.is_closed():
        sub.loop.run_until_complete(asyncio.wait(pending, timeout=timeout))


def _finished(node) -> bool:
    """Whether Pydra saved a complete result for ``node`` (every site's, for the split load)."""
    try:
        res = node.result()
    except Exception:  # noqa: BLE001 - a node that never started may not even have its inputs
        return False
    results = res if isinstance(res, list) else [res]
    return all(r is not None and not r.errored and r.output is not None for r in results)


def _running_stage(wf: pydra.Workflow, cfg: RunConfig) -> str:
    """What the run was doing: the first stage, in run order, that has no complete result."""
    doing = {"space": "preparing the mask and features (space)", "load": "loading the sites' data (load)",
             "maps": "writing the maps and privacy record (maps)", "report": "writing the report (report)"}
    for name in pipeline.run_order():
        node = getattr(wf, name if name in doing else f"release_{name}")
        if not _finished(node):
            if name == "load" and (sites := _unfinished_sites(node, cfg)):
                return f"loading the sites' data (load: {', '.join(sites)})"
            return doing.get(name, f"running stage {label(cfg, name)}")
    return "finishing the run"


def _unfinished_sites(node, cfg: RunConfig) -> list[str]:
    """The sites whose load has no complete result (the split node's results are in the sites' order)."""
    try:
        results = node.result()
    except Exception:  # noqa: BLE001 - as in _finished
        return []
    if not isinstance(results, list) or len(results) != len(cfg.sites):
        return []
    return [s.name for s, r in zip(cfg.sites, results) if r is None or r.errored or r.output is None]


def _clear_interrupted(cache_dir: Path) -> None:
    """Drop the Pydra results a killed or failed run left. Pydra saves a task's result even when a signal stops it,
    with no output and not marked as failed, and would hand that result to the next run as finished. A failed
    result (the workflow's own, after a worker died) Pydra 0.25 does compute again, but loading it marks the
    workflow as failed for good: the rerun would then succeed and still report "workflow failed". A stage's error
    carried as its result (:func:`_guard`) is dropped too, should the run that got it have died before doing so."""
    for result in Path(cache_dir).glob("*/_result.pklz"):
        try:
            res = cloudpickle.loads(result.read_bytes())
            stale = res.output is None or res.errored or ERROR in str(res.output)
        except Exception:  # noqa: BLE001 - a result cut off mid-write is as stale
            stale = True
        if stale:
            shutil.rmtree(result.parent, ignore_errors=True)


def _stop_on_crash(sub: pydra.Submitter, crashed: list[BaseException]) -> None:
    """End the run at once when a worker process dies (killed for memory, a crash outside Python): Pydra 0.25
    drops that task's error and waits a minute for a result that never comes, then fails with a message about
    the graph. The first such error lands in ``crashed``."""
    def handler(loop, context):
        exc = context.get("exception")
        if not isinstance(exc, BrokenProcessPool):
            loop.default_exception_handler(context)
        elif not crashed:
            crashed.append(exc)
            for t in asyncio.all_tasks(loop):
                t.cancel()

    sub.loop.set_exception_handler(handler)


def _failed(wf: pydra.Workflow, cfg: RunConfig, exc: BaseException, crashed: bool) -> WorkflowError:
    """The error of a run Pydra itself ended (a dead worker, Pydra's own error), naming the stage that was running
    and where the traceback is; Pydra's cache, which then holds the failure, is removed (the stages' own files
    stay, so the next run resumes after the finished ones)."""
    doing = _running_stage(wf, cfg)
    text = ["".join(traceback.format_exception(exc))]
    for path in sorted(Path(wf.cache_dir).glob("*/_error.pklz")):  # Pydra's own crash records, before they go
        try:
            text.append(f"\n{path}:\n" + "".join(cloudpickle.loads(path.read_bytes())["error message"]))
        except Exception:  # noqa: BLE001 - a record cut off mid-write says nothing more
            continue
    crash = Path(pipeline.write_config(cfg)).parent / "error-workflow.txt"
    crash.write_text("".join(text))
    shutil.rmtree(wf.cache_dir, ignore_errors=True)
    why = _one_line(exc)
    why = why if len(why) <= 300 else why[:300] + " ..."  # Pydra's graph errors run to pages: the file has them
    if crashed:
        return WorkflowError(
            f"the run failed while {doing}: its worker process ended abruptly (killed by the system, e.g. out of "
            f"memory, or a crash outside Python) (traceback: {crash}). {RESUME}: run the same command again; if it "
            "ends the same way, give the run more memory or run one stage at a time (dpneuro run --plugin serial)")
    return WorkflowError(f"the run failed while {doing}: {why} (traceback: {crash}). {RESUME}: "
                         "run the same command again to retry it; if it fails the same way, report it with the "
                         "traceback")


def run_workflow(cfg: RunConfig, *, plugin: str = "cf", cache_dir=None, prepared: bool = False,
                 **plugin_args) -> dict:
    """Build and run the workflow; returns each stage's output file, as :func:`dpneuro.run.pipeline.run_stages`.

    Relative paths in ``cfg`` are taken against the current working folder
    (Pydra runs every stage from its own cache folder) and a total ``epsilon``
    is planned first (:func:`dpneuro.run.pipeline.prepare`), unless ``prepared``
    says the caller already did. ``plugin``: Pydra's concurrent worker by
    default (the sites load at the same time, one process per usable core), or
    "serial". A stage's error is raised as :class:`WorkflowError`, in one line naming the stage (and site), the
    error, the file with its traceback and what to do; so is a worker process that died (the run stops at once).
    A failure is never left in Pydra's cache as a result: the same call runs the failed stage again.

    SIGINT (Ctrl-C) or SIGTERM (in the main thread) raises :class:`dpneuro.run.pipeline.Interrupted` naming the
    stage that was running, once the workers have stopped and Pydra's cache (which an interrupted run
    leaves unusable) is removed: the stages' own files stay, so the same call resumes after the finished ones.
    """
    if not prepared:
        cfg, _ = pipeline.prepare(cfg)
    wf = build_workflow(cfg, cache_dir)
    _clear_interrupted(wf.cache_dir)  # what a run killed outright (SIGKILL, power cut) left
    if plugin == "cf":
        plugin_args.setdefault("n_procs", resolve_workers())  # the sites load in parallel, one per core
    crashed: list[BaseException] = []
    with _signals_interrupt():
        try:
            with pydra.Submitter(plugin=plugin, **plugin_args) as sub:
                _stop_on_crash(sub, crashed)
                try:
                    sub(wf)
                except (KeyboardInterrupt, asyncio.CancelledError):
                    _stop_workers(sub)
                    raise
        except KeyboardInterrupt as exc:
            threading.excepthook = _THREAD_HOOK
            stage = _running_stage(wf, cfg)
            shutil.rmtree(wf.cache_dir, ignore_errors=True)
            raise pipeline.Interrupted(getattr(exc, "signum", signal.SIGINT), stage) from None
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - re-raised as one readable line
            threading.excepthook = _THREAD_HOOK
            raise _failed(wf, cfg, crashed[0] if crashed else exc, bool(crashed)) from exc
    res = wf.result(return_inputs=False)
    if res.errored:
        raise _failed(wf, cfg, RuntimeError(f"Pydra marked the workflow as failed (crash files under "
                                            f"{wf.cache_dir})"), False)
    out = {name: getattr(res.output, name) for name in pipeline.run_order()}
    out["load"] = list(out["load"])
    errors = [x for v in out.values() for x in (v if isinstance(v, list) else [v]) if str(x).startswith(ERROR)]
    if errors:
        # Pydra cached the error as a task's result: the next run must compute again (the stages' own files stay)
        shutil.rmtree(wf.cache_dir, ignore_errors=True)
        raise WorkflowError(errors[0][len(ERROR):])
    return out
