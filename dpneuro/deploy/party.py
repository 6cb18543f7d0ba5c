"""One party of a deployed run: the whole analysis as a site sees it, or as the aggregator does.

A site: load and validate its own subjects (:func:`dpneuro.run.pipeline.stage_load`),
then for each releasing stage of :data:`dpneuro.run.stages.RELEASES` (capePCA or
PD-SVD, the unmixing, the brain states) its input computed locally from its
data and the public results so far (a stage that reads results only the
aggregator holds, such as the brain states reading the spatial ICA's
unmixing, first receives them), and its site step; then it sends its
ledger (public), receives what every stage sends the sites (the unmixing,
the states) and writes its own outputs
(:func:`dpneuro.run.outputs.write_site_outputs`; time courses stay at the site).
The aggregator runs each stage's aggregator step and the summary, then writes
the consortium's outputs (:func:`dpneuro.run.outputs.write_consortium_outputs`:
maps, ``privacy.json`` composed from every site's ledger) and ``report.html``.

Both programs run over any exchange (one per stage, from a factory) and keep
their progress in files under a private working folder: a checkpoint per
stage and a result file per finished stage. Run again, they skip what is
finished and resume what is not, which is what both deployments need: a
restarted site process (:mod:`dpneuro.deploy.sharedfs`) and a COINSTAC
iteration (:mod:`dpneuro.deploy.coinstac`), where an exchange raises
:class:`~dpneuro.protocol.exchange.Suspend` when a message is not there yet and the
program simply returns until it is.

A total ``epsilon`` (rather than per-stage settings) is split before any
release: every site announces its public counts (subjects and their time
points), the aggregator broadcasts them all, and every party runs the planner
(:func:`dpneuro.run.planner.apply_target`) on them, so all plan the same split; each
site checks its own counts and what the split spends for it first.

The run manifest (:func:`run_manifest`) is the public description of a run
every party must agree with: the sites and their order, the privacy budget,
the collusion assumption, the data grid and every other setting that changes
what is computed. :func:`check_manifest` refuses a mismatch, naming the field.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dpneuro._utils.errors import UnsafeRelease
from dpneuro._utils.files import private_dir, write_json
from dpneuro.algorithms.dfnc import state_matrices
from dpneuro.config import ConfigError, RunConfig, check_delta, consortium_fields
from dpneuro.data.atlases import atlas_image
from dpneuro.data.parcellation import atlas_labels, atlas_maps, is_probabilistic
from dpneuro.privacy import PrivacyLedger, privacy_report
from dpneuro.privacy.budget import SiteBudget
from dpneuro.protocol.driver import RunOptions
from dpneuro.protocol.exchange import DirectoryCheckpoint, Exchange, Payload
from dpneuro.protocol.exchange.codec import load_state_file, save_state_file
from dpneuro.protocol.exchange.inprocess import DEFAULT_MAX_BYTES
from dpneuro.report.figures import render_components, render_site_maps, site_timecourse_figure
from dpneuro.report.html import report_headline, write_report
from dpneuro.report.timings import label
from dpneuro.run import roles
from dpneuro.run.factory import check_reduction_fits
from dpneuro.run.naming import read_component_table
from dpneuro.run.outputs import (
    component_title,
    consortium_report_parts,
    consortium_signal,
    states_section,
    table_path,
    write_consortium_outputs,
    write_consortium_report,
    write_maps,
    write_site_outputs,
)
from dpneuro.run.pipeline import check_site, stage_load, stage_space
from dpneuro.run.planner import SiteShape, apply_target, planned_settings
from dpneuro.run.site_maps import consortium_section, made, site_note
from dpneuro.run.stages import ReleasingStage, active_releases, from_reply, new_reads, site_budget, sites_reply

__all__ = [
    "AggregatorContext",
    "CONSORTIUM_FIELDS",
    "ManifestMismatch",
    "SiteContext",
    "check_manifest",
    "grid_fingerprint",
    "run_aggregator_analysis",
    "run_manifest",
    "run_site_analysis",
]

MANIFEST_FORMAT = "dpneuro-run-manifest"
MANIFEST_VERSION = 1

#: settings every party must share: privacy budget, collusion assumption, data preparation and everything else
#: that changes what is computed or released (each field says so in its description)
CONSORTIUM_FIELDS = consortium_fields()


class ManifestMismatch(ConfigError):
    """A party's configuration disagrees with the run manifest (the message names the field)."""


# -- run manifest ----------------------------------------------------------------------------

def grid_fingerprint(cfg: RunConfig) -> dict[str, Any]:
    """The data grid of a run: mask shape, affine, voxel count and a digest of the mask itself.

    Mask paths differ between machines; the grid they describe must not.
    """
    mask, affine = cfg.grid()
    mask = np.asarray(mask, bool)
    atlas = ""
    if cfg.atlas:  # each party holds its own copy of the atlas: its regions or maps on the grid must agree

        img = atlas_image(cfg.atlas, mask, affine)  # a name: what it resolves to here (the atlas's version)
        on_grid = (np.round(atlas_maps(img, mask, affine), 6) if is_probabilistic(img)
                   else atlas_labels(img, mask, affine)[0])
        atlas = hashlib.sha256(on_grid.tobytes()).hexdigest()
    return {"shape": [int(n) for n in mask.shape], "affine": np.round(np.asarray(affine, float), 4).tolist(),
            "n_voxels": int(mask.sum()), "mask_sha256": hashlib.sha256(np.packbits(mask).tobytes()).hexdigest(),
            "atlas_sha256": atlas}


def run_manifest(cfg: RunConfig, run_id: str) -> dict[str, Any]:
    """The public description of a run that every party checks before it releases anything."""
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "run_id": run_id,
            "sites": [s.name for s in cfg.sites],
            "config": {f: getattr(cfg, f) for f in CONSORTIUM_FIELDS},
            "grid": grid_fingerprint(cfg)}


def _norm(v: Any) -> Any:
    """Compare numbers by value (JSON may turn 4.0 into 4)."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    return v


def check_manifest(cfg: RunConfig, manifest: dict[str, Any], *, party: str,
                   source: str = "the run manifest") -> dict[str, Any]:
    """Raise :class:`ManifestMismatch` naming the first field where ``cfg`` and ``manifest`` disagree; return this
    party's own manifest of the run (:func:`run_manifest`), which it checked ``manifest`` against.

    Parameters
    ----------
    cfg : RunConfig
        This party's configuration.
    manifest : dict
        The manifest written by the aggregator (:func:`run_manifest`).
    party : str
        Who checks (for the message), e.g. ``"site 'site-02'"``.
    source : str
        Where the manifest came from (for the message).
    """
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != MANIFEST_VERSION:
        raise ManifestMismatch(f"{party}: {source} is not a dpneuro run manifest of version {MANIFEST_VERSION}")
    mine = run_manifest(cfg, manifest.get("run_id", ""))

    def refuse(name: str, have: Any, want: Any, what: str) -> None:
        raise ManifestMismatch(
            f"{party} refuses to start: config field {name!r} = {have!r} disagrees with {source}, which has "
            f"{want!r} ({what}); every party of a run must use the same settings")

    if mine["sites"] != manifest.get("sites"):
        refuse("sites", mine["sites"], manifest.get("sites"), "the sites of the run and their order")
    theirs = manifest.get("config", {})
    for name in CONSORTIUM_FIELDS:
        if _norm(mine["config"][name]) != _norm(theirs.get(name)):
            what = {"n_colluding": "the collusion assumption", "plan": "the noise plan"}.get(
                name, "the privacy budget" if name in ("delta", "epsilon", "pca_epsilon", "ica_epsilon_i",
                                                       "ica_delta_i", "ica_rounds", "cumulant_epsilon", "clip_G",
                                                       "clip_h", "ica_clip_unit", "ica_bias", "calibration")
                else "what is computed")
            refuse(name, mine["config"][name], theirs.get(name), what)
    grid = manifest.get("grid", {})
    for key in ("shape", "affine", "n_voxels", "mask_sha256", "atlas_sha256"):
        if _norm(mine["grid"][key]) != _norm(grid.get(key)):
            raise ManifestMismatch(
                f"{party} refuses to start: the data grid (config fields 'mask' / 'space' / 'atlas') disagrees with "
                f"{source}: {key} is {mine['grid'][key]!r} here and {grid.get(key)!r} there")
    return mine


# -- files -------------------------------------------------------------------------------------

class _Clock:
    """A party's stage timings (seconds), kept in its working folder.

    A party resumes (a restarted process, the next COINSTAC iteration), so a
    stage's start is written down the first time it is tried and its time,
    once it finishes, joins ``timings.json``: the report of the call that ends
    the run names every stage, in the order they finished. A deployed stage's
    time includes waiting for the other parties.
    """

    def __init__(self, work: Path):
        self.path, self.starts = work / "timings.json", work / "timings-started.json"

    @staticmethod
    def _read(path: Path) -> dict[str, float]:
        return json.loads(path.read_text()) if path.exists() else {}

    def timings(self) -> dict[str, float]:
        return self._read(self.path)

    def start(self, key: str) -> float:
        """The wall-clock time the step ``key`` was first tried (now, the first time)."""
        starts = self._read(self.starts)
        if key not in starts:
            starts[key] = time.time()
            write_json(self.starts, starts)
        return float(starts[key])

    def add(self, name: str, seconds: float) -> None:
        timings = self.timings()
        timings[name] = timings.get(name, 0.0) + float(seconds)
        write_json(self.path, timings)

    @contextlib.contextmanager
    def timed(self, name: str):
        """Time a block that runs to its end in one call (local work: no exchange)."""
        t0 = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - t0)


def _cached(path: Path, compute: Callable[[], dict[str, Any]], clock: _Clock | None = None,
            name: str = "") -> dict[str, Any]:
    """The result stored at ``path``, or ``compute()`` stored there (atomically) first, timed as ``name``."""
    if path.exists():
        return load_state_file(path)["result"]
    t0 = clock.start(path.name) if clock else 0.0  # per file: the states' two steps share one name
    result = compute()
    if clock:
        clock.add(name, time.time() - t0)  # from the first try, across suspensions
    save_state_file(path, {"result": result})
    return result


def _records_timings(cfg: RunConfig, space: dict, load: dict | None = None) -> dict[str, float]:
    """The space and load stages' times, from their own records (the pipeline's stages time themselves)."""
    out = {}
    if "seconds" in space:
        out[label(cfg, "space")] = float(space["seconds"])
    if load is not None and "seconds" in load:
        out[label(cfg, "load", load["site"])] = float(load["seconds"])
    return out




def _save_npy(path: Path, a: np.ndarray) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp.npy")
    np.save(tmp, a)
    tmp.replace(path)


def _pipeline_config(cfg: RunConfig, work: Path) -> str:
    """The pipeline stages read a config file; this party's lives in its working folder."""
    path = work / "config.json"
    text = json.dumps(replace(cfg, out=str(work / "pipeline")).to_json(), indent=1, default=str)
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".config.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return str(path)


def _space(cfg: RunConfig, work: Path) -> tuple[str, dict]:
    space_json = stage_space(_pipeline_config(cfg, work))
    return space_json, json.loads(Path(space_json).read_text())


def _dim(space: dict) -> int:
    return int(space["n_parcels"]) if space.get("parcels") else int(space["n_voxels"])


# -- a total budget, split on the sites' announced counts ----------------------------------------

#: the exchange topic on which the sites announce their counts and the aggregator broadcasts them all
COUNTS_TOPIC = "counts"
#: relative slack for rounding when a site compares the planned split with its configured total
_EPS_RTOL = 1e-9


def _check_counts(cfg: RunConfig, counts: Any, where: str) -> dict[str, list[int]]:
    """Every site's counts (site name -> its subjects' time points), in the run's site order; refuse what is not
    that, naming ``where`` they came from."""
    names = [s.name for s in cfg.sites]
    if not isinstance(counts, dict) or sorted(counts) != sorted(names):
        got = sorted(counts) if isinstance(counts, dict) else counts
        raise ValueError(f"{where}: counts for {got!r}, but the run's sites are {names}")
    for name in names:
        ln = counts[name]
        if not isinstance(ln, list) or not ln or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                         for n in ln):
            raise ValueError(f"{where}: site {name!r}'s counts must be its subjects' time points (whole numbers "
                             f">= 1, at least one subject), got {ln!r}")
    return {name: [int(n) for n in counts[name]] for name in names}


def _plan_total(cfg: RunConfig, counts: dict[str, list[int]], dim: int) -> dict[str, Any]:
    """The split of ``cfg.epsilon`` on these counts, as every party computes it: the planner's own function
    (the one the simulation and ``dpneuro budget`` call), so every party gets the same settings."""
    planned, plan = apply_target(cfg, shapes=[SiteShape(s.name, tuple(counts[s.name])) for s in cfg.sites],
                                 dim=dim)
    return {"counts": counts, "settings": planned_settings(planned), "epsilon": plan.epsilon}


def _same_settings(theirs: Any, mine: dict[str, float]) -> bool:
    try:
        return set(theirs) == set(mine) and all(math.isclose(float(theirs[k]), v, rel_tol=_EPS_RTOL)
                                                for k, v in mine.items())
    except (TypeError, ValueError):
        return False


def _site_plan(ctx: SiteContext, lengths: list[int], dim: int) -> dict[str, Any]:
    """Announce this site's counts, receive every site's, plan the split and check it before any release."""
    cfg, me, mine = ctx.cfg, ctx.site, [int(n) for n in lengths]
    who = f"site {me!r} refuses"
    reply = roles.summary_site(ctx.index, {"site": me, "lengths": mine}, ctx.exchange(COUNTS_TOPIC),
                                  checkpoint=ctx.checkpoint(COUNTS_TOPIC), timeout=ctx.timeout)
    counts = _check_counts(cfg, reply.meta.get("counts"), f"{who}: the broadcast counts")
    if counts[me] != mine:
        raise UnsafeRelease(f"{who}: the broadcast counts give it {len(counts[me])} subjects of {counts[me]} time "
                            f"points, but it announced {len(mine)} of {mine}; nothing was released")
    planned = _plan_total(cfg, counts, dim)
    spent = planned["epsilon"][me]
    if not spent <= cfg.epsilon * (1 + _EPS_RTOL):
        raise UnsafeRelease(f"{who}: the split planned from the broadcast counts ({planned['settings']}) would "
                            f"spend eps = {spent:.6g} at this site, above its configured total epsilon = "
                            f"{cfg.epsilon:g}; nothing was released")
    if not _same_settings(reply.meta.get("settings"), planned["settings"]):
        raise UnsafeRelease(f"{who}: the aggregator planned {reply.meta.get('settings')!r} from the broadcast counts, "
                            f"this site plans {planned['settings']} from the same counts (config field 'epsilon'); "
                            "nothing was released")
    return planned


def _aggregator_plan(ctx: AggregatorContext, dim: int) -> dict[str, Any]:
    """Gather every site's counts, plan the split and broadcast the counts with it."""
    cfg, planned = ctx.cfg, {}

    def gathered(declared: dict[int, dict]) -> dict[str, list[int]]:
        counts = {}
        for s, site in enumerate(cfg.sites):
            d = declared.get(s) or {}
            if d.get("site") != site.name:
                raise ValueError(f"the aggregator refuses the counts of site {s}: it announced itself as "
                                 f"{d.get('site')!r}, the run expects {site.name!r}")
            counts[site.name] = d.get("lengths")
        return _check_counts(cfg, counts, "the aggregator refuses the announced counts")

    def reply(declared: dict[int, dict]) -> Payload:
        planned.update(_plan_total(cfg, gathered(declared), dim))
        return Payload(meta={"counts": planned["counts"], "settings": planned["settings"]})

    declared = roles.summary_aggregator(reply, ctx.exchange(COUNTS_TOPIC), checkpoint=ctx.checkpoint(COUNTS_TOPIC),
                                           options=ctx.options)
    if not planned:  # resumed after the broadcast: the same plan from the same counts
        planned.update(_plan_total(cfg, gathered(declared), dim))
    return planned


# -- a site ------------------------------------------------------------------------------------

class _Party:
    """What both kinds of party share: the run's sites and a checkpoint per exchange topic in the working
    folder."""

    cfg: RunConfig
    work: Path

    @property
    def n_sites(self) -> int:
        return len(self.cfg.sites)

    def checkpoint(self, stage: str) -> DirectoryCheckpoint:
        return DirectoryCheckpoint(self.work / f"{stage}.ckpt.npz")


@dataclass
class SiteContext(_Party):
    """What one site needs to run its part.

    Attributes
    ----------
    cfg : RunConfig
        The run's configuration; ``cfg.sites`` lists every site in the agreed
        order, and this site's entry says where its data are.
    site : str
        This site's name.
    work : Path
        Private working folder: the site's data matrix, checkpoints and
        intermediate results (un-noised statistics among them). Never shared.
    out : Path
        Where this site's outputs go.
    exchange : callable
        ``exchange(stage)`` gives the exchange of stage ``"reduce"``,
        ``"unmix"`` or ``"summary"``.
    timeout : float or None
        Seconds a blocking exchange waits for any one message.
    message_limit : int
        Largest message (bytes of arrays) the exchange carries: a reduction whose release exceeds it is
        refused before any data are read.
    """

    cfg: RunConfig
    site: str
    work: Path
    out: Path
    exchange: Callable[[str], Exchange]
    timeout: float | None = None
    message_limit: int = DEFAULT_MAX_BYTES
    #: where the site says how far it is (one line per step; None: silent)
    progress: Callable[[str], None] | None = None

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)

    @property
    def index(self) -> int:
        names = [s.name for s in self.cfg.sites]
        if self.site not in names:
            raise ConfigError(f"config field 'sites': no site named {self.site!r} (sites: {names})")
        return names.index(self.site)


def load_site_data(ctx: SiteContext) -> dict[str, Any]:
    """Validate and load this site's subjects (once); the loader's JSON record plus ``"space"``."""
    private_dir(ctx.work)  # the site's un-noised data: its owner only
    space_json, space = _space(ctx.cfg, ctx.work)
    check_reduction_fits(ctx.cfg, _dim(space), ctx.message_limit)
    info = json.loads(Path(stage_load(_pipeline_config(ctx.cfg, ctx.work), ctx.site, space_json)).read_text())
    info["space"] = space
    return info


def _site_input(ctx: SiteContext, rel: ReleasingStage, info: dict, public: dict, clock: _Clock):
    """This site's input of ``rel``, kept in its working folder (a restarted site does not compute it again);
    its time counts as the stage's, as in the simulation."""
    path = ctx.work / f"{rel.name}.input.npy"
    if not path.exists():
        with clock.timed(label(ctx.cfg, rel.name)):
            data = rel.site_input(ctx.cfg, info, public)
            if not isinstance(data, np.ndarray):  # the site's data file itself, or nothing to read
                return data
            _save_npy(path, data)
    return np.load(path, mmap_mode="r")


def run_site_analysis(ctx: SiteContext) -> dict[str, Any]:
    """This site's whole part of the run; returns what it wrote (see module notes).

    Raises
    ------
    Suspend
        From a suspending exchange: call again (same context) to continue.
    """
    cfg, work, i, n = ctx.cfg, ctx.work, ctx.index, ctx.n_sites
    done = work / "site-result.json"
    if done.exists():
        return json.loads(done.read_text())
    check_site(cfg, ctx.site)  # its files' checks (participants table, ...) before it loads or releases anything
    ctx.say(f"site {ctx.site}: loading and checking its subjects")
    info = load_site_data(ctx)
    check_delta(cfg.delta, int(info["n_subjects"]))  # each site its own N: the smallest site refuses
    ctx.say(f"site {ctx.site}: {info['n_subjects']} subjects, {info['n_samples']} time points loaded")
    lengths = [b - a for a, b in info["boundaries"]]
    dim = _dim(info["space"])
    clock = _Clock(work)
    if cfg.epsilon is not None:  # a total budget: split on every site's counts before any release
        planned = _cached(work / f"{COUNTS_TOPIC}.result.npz", lambda: _site_plan(ctx, lengths, dim), clock,
                          label(cfg, COUNTS_TOPIC))
        cfg = replace(cfg, **planned["settings"])
        ctx = replace(ctx, cfg=cfg)
    public: dict[str, dict[str, Any]] = {}
    inputs: dict[str, Any] = {}
    leds = []
    for rel in active_releases(cfg):
        if reads := new_reads(cfg, rel):  # earlier results only the aggregator holds (ReleasingStage.reads)
            def fetch(topic: str = f"{rel.name}-reads") -> dict[str, Any]:
                return dict(roles.summary_site(i, {}, ctx.exchange(topic), checkpoint=ctx.checkpoint(topic),
                                                  timeout=ctx.timeout).arrays)

            got = _cached(work / f"{rel.name}-reads.result.npz", fetch, clock, label(cfg, rel.name))
            for stage, key in reads:
                public[stage][key] = got[f"{stage}.{key}"]
        data = inputs[rel.name] = _site_input(ctx, rel, info, public, clock)
        previous: dict[str, Any] | None = None
        public[rel.name] = {}
        for step in rel.steps(cfg):
            # the site's guard holds every step to the configured total, less what the earlier steps spent
            budget = site_budget(cfg, f"site {ctx.site!r}", leds)

            def compute(rel: ReleasingStage = rel, step: str = step, data: Any = data,
                        previous: dict | None = previous, budget: SiteBudget = budget) -> dict[str, Any]:
                return rel.site(cfg, step, i, data, lengths, ctx.exchange(step), n_sites=n, dim=dim,
                                previous=previous, checkpoint=ctx.checkpoint(step), timeout=ctx.timeout,
                                budget=budget)

            ctx.say(f"site {ctx.site}: {label(cfg, rel.name)} ({step}): taking part")
            previous = _cached(work / f"{step}.result.npz", compute, clock, label(cfg, rel.name))
            leds.append(previous["ledger"])
            public[rel.name].update({k: v for k, v in previous.items() if k != "ledger"})
    ledger = PrivacyLedger.merge_all(leds)
    ledger.owner = ctx.site
    declared = {"site": ctx.site, "n_subjects": int(info["n_subjects"]), "n_samples": int(info["n_samples"]),
                "tr": info.get("tr"), "ledger": ledger.to_dict()}

    def summary() -> dict[str, Any]:
        reply = roles.summary_site(i, declared, ctx.exchange("summary"), checkpoint=ctx.checkpoint("summary"),
                                      timeout=ctx.timeout)
        return dict(reply.arrays)  # what every stage sends the sites (stages.sites_reply)

    final = _cached(work / "summary.result.npz", summary, clock, label(cfg, "summary"))
    for name, values in from_reply(final).items():
        public.setdefault(name, {}).update(values)
    signal = None
    if SIGNAL_KEY in final:  # the consortium's noise components, named as in its report
        on = np.asarray(final[SIGNAL_KEY], np.float64)
        signal = {"signal": (on[0] > 0.5).tolist(), "share": on[1].tolist()}
    result = _write_site_outputs(ctx, info, public, inputs, ledger, clock, signal=signal)
    write_json(done, result)
    return result


def _write_site_outputs(ctx: SiteContext, info: dict, public: dict, inputs: dict, ledger: PrivacyLedger,
                        clock: _Clock, signal: dict | None = None) -> dict:
    cfg, out = ctx.cfg, ctx.out
    # the consortium's results first: a site stopped while it computes its own maps still has them
    V, lam = public["reduce"]["basis"], public["reduce"]["eigenvalues"]
    W = np.asarray(public["unmix"]["W"])
    with clock.timed(label(cfg, "maps")):
        comp, _ = write_maps(info["space"], V, lam, W, out / "components.nii.gz", signal=signal)
        np.save(out / "W.npy", W)
    states = None
    if "vectors" in public.get("states", {}):  # the consortium's states, as this site received them
        states = out / "states.npy"
        np.save(states, state_matrices(public["states"]["vectors"]))
    priv = {"site": ctx.site, "delta": ctx.cfg.delta, "plan": ctx.cfg.plan, "n_subjects": info["n_subjects"],
            **ledger.summary(ctx.cfg.delta), "by_stage_mu": ledger.by_stage(), "ledger": ledger.to_dict(),
            "note": "What this site released, composed from its own ledger. The consortium's privacy.json "
                    "(written by the aggregator) holds every site's ledger and the assumptions."}
    priv_path = write_json(out / "privacy.json", priv)
    ctx.say(f"site {ctx.site}: protocol finished; the consortium's maps are in {comp} and what this site spent in "
            f"{priv_path}; now its own time courses{' and voxel maps' if made(cfg, info['space']) else ''} "
            "and its report")
    # the FNC and the brain states read the same time courses: whichever the run kept
    own = write_site_outputs(cfg, info, info["space"], public, out, unmix_input=inputs["unmix"],
                             timecourses=inputs.get("fnc", inputs.get("states")), timer=clock.timed)
    site_maps = None if own["site_maps"] is None else Path(own["site_maps"])
    report, timings = _write_site_report(ctx, info, comp, Path(own["timecourses"]), ledger, site_maps, clock,
                                         states=None if states is None else {"matrices": states,
                                                                             "summary": own["states_summary"]},
                                         site_maps_ica=own["site_maps_ica"])
    subjects = [{"id": sid, "columns": [int(a), int(b_)]}
                for sid, (a, b_) in zip(info["subject_ids"], info["boundaries"])]
    return {"site": ctx.site, "components": str(comp), "timecourses": own["timecourses"], "privacy": str(priv_path),
            "report": str(report), "subjects": subjects, "epsilon": priv["epsilon"],
            "states": None if states is None else str(states), "states_occupancy": own["states_occupancy"],
            "site_maps": own["site_maps"], "site_maps_ica": own["site_maps_ica"], "timings_s": timings}


def _write_site_report(ctx: SiteContext, info: dict, comp: Path, tc: Path, ledger: PrivacyLedger,
                       site_maps: Path | None, clock: _Clock, states: dict | None = None,
                       site_maps_ica: dict | None = None) -> tuple[Path, dict[str, float]]:
    """This site's own report: the group maps, what it spent, its own voxel maps and subjects' time courses;
    and the site's stage timings (the report's own among them).

    It stays at the site (it shows the site's un-noised time courses and maps).
    """
    t0 = time.perf_counter()
    cfg, out = ctx.cfg, ctx.out
    figs = out / "figures"
    table = read_component_table(table_path(comp))  # the group's components, named as in the consortium's report
    comps, maps_note, warnings = render_components(comp, info["space"]["mask"], figs,
                                                   interactive=cfg.interactive_maps,
                                                   names=[component_title(r) for r in table] or None)
    priv = privacy_report({ctx.site: ledger}, delta=cfg.delta, n_subjects={ctx.site: int(info["n_subjects"])},
                          plan=cfg.plan, n_colluding=cfg.n_colluding, seeded=cfg.seed is not None)
    tc_png = site_timecourse_figure(tc, ctx.site, (info["subject_ids"][0], *info["boundaries"][0]), info.get("tr"),
                                    figs / "timecourses.png")
    own = None
    if site_maps is not None:  # this site's voxel map of each component, below the group's
        render_site_maps(comps, {ctx.site: str(site_maps)}, comp, info["space"]["mask"], figs / "site_maps")
        own = {"note": site_note(cfg.site_maps_method, site_maps_ica)}
    states_part = None
    if states is not None:  # the consortium's states and this site's own subjects' statistics
        summary = states["summary"]
        states_part = {**states_section({"matrices": states["matrices"], "occupancy": summary["occupancy"]}, figs),
                       "site": summary}
    headline = report_headline(f"Site {ctx.site}'s report: {len(comps)} group components; {info['n_subjects']} "
                               "subjects of this site.", priv, warnings or None)
    clock.add(label(cfg, "report"), time.perf_counter() - t0)
    timings = {**_records_timings(cfg, info["space"], info), **clock.timings()}
    report = write_report(out / "report.html", title=f"dpneuro: site {ctx.site}", headline=headline,
                          components=comps, privacy=priv, maps_note=maps_note, timecourses_png=tc_png,
                          site_maps=own, timings=timings, states=states_part, component_table=table,
                          data={"cleaning": (info.get("cleaning") or {}).get("description", cfg.cleaning().describe()),
                                "features": info["space"].get("features", ""),
                                "sites": [info]},
                          notes=["This report stays at this site: its time courses and voxel maps are computed "
                                 "from this site's own data and are not private releases. Stage times include "
                                 "waiting for the other parties."])
    return report, timings


# -- the aggregator ----------------------------------------------------------------------------

@dataclass
class AggregatorContext(_Party):
    """What the aggregator needs: the run's configuration, a working folder, where outputs go, exchanges."""

    cfg: RunConfig
    work: Path
    out: Path
    exchange: Callable[[str], Exchange]
    options: RunOptions = field(default_factory=RunOptions)
    #: what authenticates the messages of this deployment, and what an attacker on the path could do
    transport: str = ""


def run_aggregator_analysis(ctx: AggregatorContext) -> dict[str, Any]:
    """The aggregator's whole part of the run; returns the final result record.

    Raises
    ------
    Suspend
        From a suspending exchange: call again (same context) to continue.
    """
    cfg, work, n = ctx.cfg, ctx.work, ctx.n_sites
    done = work / "aggregator-result.json"
    if done.exists():
        return json.loads(done.read_text())
    work.mkdir(parents=True, exist_ok=True)
    clock = _Clock(work)
    _, space = _space(cfg, work)
    dim = _dim(space)
    if cfg.epsilon is not None:  # a total budget: split on every site's counts before any release
        planned = _cached(work / f"{COUNTS_TOPIC}.result.npz", lambda: _aggregator_plan(ctx, dim), clock,
                          label(cfg, COUNTS_TOPIC))
        cfg = replace(cfg, **planned["settings"])
        ctx = replace(ctx, cfg=cfg)
    public: dict[str, dict[str, Any]] = {}
    for rel in active_releases(cfg):
        if reads := new_reads(cfg, rel):
            def send(reads: tuple = reads, topic: str = f"{rel.name}-reads") -> dict[str, Any]:
                reply = Payload({f"{st}.{k}": np.asarray(public[st][k]) for st, k in reads})
                roles.summary_aggregator(reply, ctx.exchange(topic), checkpoint=ctx.checkpoint(topic),
                                            options=ctx.options)
                return {}

            _cached(work / f"{rel.name}-reads.result.npz", send, clock, label(cfg, rel.name))
        previous: dict[str, Any] | None = None
        public[rel.name] = {}
        for step in rel.steps(cfg):
            def compute(rel: ReleasingStage = rel, step: str = step,
                        previous: dict | None = previous) -> dict[str, Any]:
                return rel.aggregator(cfg, step, ctx.exchange(step), n_sites=n, dim=dim, public=public,
                                      previous=previous, checkpoint=ctx.checkpoint(step), options=ctx.options)

            previous = _cached(work / f"{step}.result.npz", compute, clock, label(cfg, rel.name))
            public[rel.name].update(previous)

    def summary() -> dict[str, Any]:
        results = {k: np.asarray(v) for k, v in sites_reply(public).items()}

        def reply(declared: dict[int, dict]) -> Payload:
            # which components carry signal needs every site's ledger: known once they declared
            ledgers, _, n_samples = _declared(cfg, declared)
            got = consortium_signal(cfg, public, ledgers, n_samples)
            return Payload({**results, SIGNAL_KEY: np.array([got["signal"], got["share"]], np.float64)})

        return {"sites": roles.summary_aggregator(reply, ctx.exchange("summary"),
                                                     checkpoint=ctx.checkpoint("summary"), options=ctx.options)}

    summ = _cached(work / "summary.result.npz", summary, clock, label(cfg, "summary"))
    result = _write_aggregator_outputs(ctx, space, public, summ["sites"], clock)
    write_json(done, result)
    return result


#: the summary's reply: which components carry signal (row 0, 1 or 0) and their shares (row 1)
SIGNAL_KEY = "maps.signal"


def _declared(cfg: RunConfig, declared: dict) -> tuple[dict[str, PrivacyLedger], dict[str, int], dict[str, int]]:
    """Every site's ledger, subjects and time points as it declared them at the end of the run, by name."""
    ledgers, n_subjects, n_samples = {}, {}, {}
    for i, name in enumerate(site.name for site in cfg.sites):
        d = declared.get(i) or declared.get(str(i)) or {}
        if d.get("site") != name:
            raise ValueError(f"site {i} declared itself as {d.get('site')!r}, the run expects {name!r}")
        ledgers[name] = PrivacyLedger.from_dict(d["ledger"])
        n_subjects[name], n_samples[name] = int(d["n_subjects"]), int(d["n_samples"])
    return ledgers, n_subjects, n_samples


def _write_aggregator_outputs(ctx: AggregatorContext, space: dict, public: dict, declared: dict,
                              clock: _Clock) -> dict[str, Any]:
    cfg, out = ctx.cfg, ctx.out
    t0 = time.perf_counter()
    names = [s.name for s in cfg.sites]
    ledgers, n_subjects, n_samples = _declared(cfg, declared)
    cons = write_consortium_outputs(cfg, space, public, ledgers, n_subjects, n_samples, out, assumptions=(
        "Each site's ledger was declared by that site at the end of the run; the aggregator checked at "
        "set-up that every site calibrated the same releases (CAPE set-up phase).",), transport=ctx.transport)
    priv = cons["priv"]
    ica, red = public["unmix"], public["reduce"]
    W = np.asarray(ica["W"])
    for name, a in (("W", W), ("b", ica["b"]), ("basis", red["basis"]), ("eigenvalues", red["eigenvalues"])):
        np.save(out / f"{name}.npy", np.asarray(a))
    clock.add(label(cfg, "maps"), time.perf_counter() - t0)

    t0 = time.perf_counter()
    warnings = cons["warnings"]
    parts = consortium_report_parts(cfg, space, cons["components"], priv, ica, n_subjects=sum(n_subjects.values()),
                                    warnings=warnings, template_problem=cons["template_problem"],
                                    figs=out / "figures", states=cons["states"], fnc=cons["fnc"],
                                    spectrum=cons["spectrum"], glm=cons["glm"])
    notes = ["Deployed run: every site ran its own part; time courses stay at the sites (each site's "
             "output folder has its own)."]
    if cfg.seed is not None:
        notes.append(f"Fixed seed {cfg.seed}: reproducible noise, for tests and simulations only.")
    clock.add(label(cfg, "report"), time.perf_counter() - t0)
    timings = {**_records_timings(cfg, space), **clock.timings()}
    notes.append("Stage times are the aggregator's wall time, waiting for the sites included; each site's "
                 "report has its own (loading, time courses, voxel maps).")
    report = write_consortium_report(out, parts, priv, timings=timings, run=cfg.to_json(), notes=notes,
                                     site_maps=consortium_section(cfg, space),
                                     data={"cleaning": cfg.cleaning().describe(),
                                           "features": space.get("features", "")})
    return {"components": cons["components"], "component_table": str(table_path(cons["components"])),
            "fnc": None if cons["fnc"] is None else cons["fnc"]["tsv"],
            "group_effects": None if cons["glm"] is None else cons["glm"]["tsv"],
            "privacy": cons["privacy"], "report": str(report),
            "W": str(out / "W.npy"), "basis": str(out / "basis.npy"), "sites": names,
            "ica_rounds": int(ica["rounds"]), "ica_status": ica["status"], "epsilon": dict(priv["epsilon"]),
            "states": None if parts["states"] is None else str(out / "states.npy"),
            "delta": cfg.delta, "plan": cfg.plan, "warnings": warnings, "timings_s": timings,
            "signal": cons["spectrum"]["sentence"], "signal_components": list(cons["signal"]["signal"])}
