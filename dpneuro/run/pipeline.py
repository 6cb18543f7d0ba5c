"""The analysis stages, as plain functions from files to files.

Each stage reads the JSON/NPY files of the stages before it and writes its own
into a folder named by a digest of its inputs, so the same inputs always land
in the same place (Pydra's cache in ``workflows/`` decides what to skip) and
different inputs never overwrite each other. ``workflows/`` wraps these
functions as Pydra tasks; they never import Pydra themselves.

space -> load (per site) -> the releases of :data:`dpneuro.run.stages.RELEASES` (reduce: capePCA or PD-SVD;
unmix: spatial ICA, capeDJICA or the cumulant ICA; states: dFNC brain states, when asked for) -> maps
-> report. Each release's record names the records before it (``chain``), so the maps and the report read
every stage's result from the last one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from dpneuro._utils.errors import ConfigError, DataValidationError
from dpneuro._utils.files import private_dir, write_json
from dpneuro.algorithms.dfnc import matrix_to_vector, taper
from dpneuro.algorithms.djica import usable_eigenvalues
from dpneuro.algorithms.metrics import match_components, md_index, qngi
from dpneuro.config import RunConfig, check_delta, stage_fields
from dpneuro.data.atlases import is_atlas_name
from dpneuro.data.cleaning import Cleaning, CleaningError, check_confounds_tables
from dpneuro.data.discovery import SubjectDiscovery, find_subjects
from dpneuro.data.images import load_mask, load_space, mask_to_image
from dpneuro.data.load import describe_site_inputs, load_site, site_data_summary
from dpneuro.data.networks import MIN_COVERAGE, voxel_regions
from dpneuro.data.parcellation import space_parcels
from dpneuro.data.participants import CovariateError, check_covariates
from dpneuro.datasets.states import window_labels
from dpneuro.datasets.synth import load_manifest
from dpneuro.privacy import PrivacyLedger
from dpneuro.privacy.budget import SiteBudget
from dpneuro.protocol.driver import RunOptions
from dpneuro.report.figures import render_site_maps, site_timecourse_figure
from dpneuro.report.timings import label, timed
from dpneuro.run import factory, roles, stages
from dpneuro.run.factory import check_reduction_fits
from dpneuro.run.features import feature_set, features
from dpneuro.run.outputs import (
    consortium_privacy,
    consortium_report_parts,
    write_consortium_outputs,
    write_consortium_report,
    write_site_outputs,
)
from dpneuro.run.planner import RELEASING_STAGES, apply_target
from dpneuro.run.site_maps import consortium_section, made


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT (Ctrl-C) or SIGTERM. ``stage`` says what was running (empty when unknown);
    the finished stages' files stay, so running the same command again resumes after them."""

    def __init__(self, signum: int, stage: str = ""):
        super().__init__(signum, stage)
        self.signum, self.stage = int(signum), stage

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process stopped by a signal: 128 + its number (130, 143)."""
        return 128 + self.signum


def _digest(*parts: Any) -> str:
    h = hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode())
    return h.hexdigest()[:12]


def _stage_dir(cfg: RunConfig, stage: str, *parts: Any) -> Path:
    d = private_dir(Path(cfg.out) / "work") / f"{stage}-{_digest(*parts)}"  # the sites' un-noised data go here
    d.mkdir(exist_ok=True)
    return d


def _write_json(path: Path, obj: Any) -> str:
    return str(write_json(path, obj))


def _progress() -> bool:
    """Progress bars on (see :func:`progress`). A console setting travels in the environment: Pydra's workers are
    processes started from this one, so they inherit it, and it stays out of the stages' inputs, hence out of
    Pydra's cache keys (``-q`` never recomputes a stage)."""
    return os.environ.get("DPNEURO_PROGRESS", "") == "1"


@contextlib.contextmanager
def progress(enabled: bool):
    """Progress bars on or off for the stages run inside; restored afterwards, so that one call's setting
    never leaks into the next (a notebook, the test suite)."""
    before = os.environ.get("DPNEURO_PROGRESS")
    os.environ["DPNEURO_PROGRESS"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DPNEURO_PROGRESS", None)
        else:
            os.environ["DPNEURO_PROGRESS"] = before


def _options(desc: str):
    return RunOptions(progress=_progress(), description=desc)


def _read_json(path) -> dict:
    return json.loads(Path(path).read_text())


# -- mask and parcels ------------------------------------------------------------------------

def stage_key(cfg: RunConfig, stage: str) -> str:
    """Digest of the fields ``stage`` depends on (Pydra's cache key); ``report``, and a stage that names none,
    on all of them."""
    fields = stage_fields(stage) or tuple(cfg.to_json())
    return cfg.digest(*fields)


def stage_space(cfg_json: str, cache_key: str = "") -> str:
    """The mask (given, or the template's) and the optional data-independent parcellation or atlas."""
    cfg = RunConfig.from_dict(_read_json(cfg_json))
    d = _stage_dir(cfg, "space", cfg.mask, cfg.space, cfg.parcels, cfg.atlas)
    out = d / "space.json"
    if out.exists():
        return str(out)
    if cfg.mask:
        mask_path = cfg.mask
    else:
        m, aff = load_space(cfg.space)

        mask_path = str(d / "mask.nii.gz")
        nib.Nifti1Image(m.astype(np.uint8), aff).to_filename(mask_path)
    t0 = time.perf_counter()
    mask, affine = load_mask(mask_path)
    info = {"mask": mask_path, "n_voxels": int(mask.sum()), "parcels": None}
    labels, weighting, described = feature_set(cfg, mask, affine)
    info["features"] = described
    if labels is not None:
        np.save(d / "parcels.npy", labels)
        basis = weighting == "basis"  # a probabilistic atlas: the basis of its maps' span, written as maps to look at
        mask_to_image(labels if basis else labels.astype(np.float32) + 1, mask_path).to_filename(d / "parcels.nii.gz")
        info.update(parcels=str(d / "parcels.npy"), weighting=weighting,
                    n_parcels=int(labels.shape[1]) if basis else int(labels.max() + 1))
    info["seconds"] = time.perf_counter() - t0
    return _write_json(out, info)


# -- per site: load and validate ----------------------------------------------------------------

def stage_load(cfg_json: str, site_name: str, space_json: str, cache_key: str = "") -> str:
    """One site's subjects: validated, masked, standardised, (parcel-averaged) into a D x N .npy."""
    cfg = RunConfig.from_dict(_read_json(cfg_json))
    site = next(s for s in cfg.sites if s.name == site_name)
    space = _read_json(space_json)
    cleaning = cfg.cleaning()
    d = _stage_dir(cfg, f"load-{site_name}", site.path, site.files, site.subjects_tsv, cfg.bids,
                   {k: v for k, v in space.items() if k != "seconds"},  # what the space is, not how long it took
                   cfg.standardize, cfg.min_volumes, site.exclude, cfg.on_bad_subject,
                   *([cleaning.to_json()] if cleaning.temporal or cleaning.smoothing_fwhm else []))
    out = d / "site.json"
    if out.exists():
        return str(out)
    for part in d.glob(".*.part"):  # what a killed load was writing (matrix.ColumnWriter): never finished, so dropped
        part.unlink(missing_ok=True)
    parcels = space_parcels(space)
    decoder = None
    if cfg.cluster:  # the site's own cluster decodes its subjects (same matrix as the threads here)
        # deferred: it loads Pydra and its Dask/SLURM workers, and the workflows package imports this module
        from dpneuro.deploy.cluster import cluster_decoder

        decoder = cluster_decoder(cfg.cluster, space_json=space_json, standardize=cfg.standardize, work=d / "cluster")
    t0 = time.perf_counter()
    sd = load_site(site.files or site.path, space["mask"], standardize=cfg.standardize, progress=_progress(),
                   min_volumes=cfg.min_volumes, memmap_path=d / "X.npy", parcels=parcels, bids=cfg.bids,
                   subjects_tsv=site.subjects_tsv or None, decoder=decoder, cleaning=cleaning,
                   exclude=site.exclude, on_bad_subject=cfg.on_bad_subject,
                   voxels_path=d / "V.npy" if made(cfg, space) else None)
    record = {"site": site_name, "X": str(d / "X.npy"), "n_subjects": sd.n_subjects,
              "n_features": sd.n_features, "n_samples": sd.n_samples,
              "boundaries": sd.boundaries, "subject_ids": sd.subject_ids, "tr": sd.tr,
              "runs": sd.runs, "skipped": sd.skipped, "excluded": sd.excluded, "cleaning": sd.cleaning,
              "run_records": sd.run_records, "filters": sd.filters, "voxels": sd.voxels_path,
              "seconds": time.perf_counter() - t0}
    if _progress():  # the site's console, unless quiet: what was read, how it was cleaned, every file not used
        print("\n".join(describe_site_inputs(record, files=True)), file=sys.stderr)  # (all also in site.json)
    return _write_json(out, record)


def _open_stage(cfg_json: str, site_jsons: list[str], stage: str, *inputs: Any,
                files=lambda cfg: []) -> tuple[RunConfig, list[dict], Path]:
    """A consortium stage's configuration, the sites' records, and its folder (named by its inputs, fields and the
    contents of the ``files(cfg)`` it reads)."""
    cfg = RunConfig.from_dict(_read_json(cfg_json))
    contents = [hashlib.sha1(Path(f).read_bytes()).hexdigest() if Path(f).is_file() else None for f in files(cfg)]
    return cfg, _sites(site_jsons), _stage_dir(cfg, stage, *inputs, stage_key(cfg, stage), *contents)


def _sites(site_jsons: list[str]) -> list[dict]:
    sites = [_read_json(p) for p in site_jsons]
    Ds = {s["n_features"] for s in sites}
    if len(Ds) != 1:
        raise ValueError(f"sites have different numbers of features: "
                         f"{ {s['site']: s['n_features'] for s in sites} }; they must share the mask and parcels")
    return sites


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("dpneuro", "numpy", "scipy", "nibabel", "nilearn", "pydra", "dp-accounting", "cryptography"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _lengths(site: dict) -> list[int]:
    return [b - a for a, b in site["boundaries"]]


def _ledgers_json(ledgers, names) -> dict:
    return {n: (led.to_dict() if led is not None else None) for n, led in zip(names, ledgers)}


# -- the releasing stages (capePCA, the unmixing, the brain states): one function for all ---------

def _chain(previous_json: str) -> dict[str, str]:
    """Every earlier stage's record by name, from the record before (the space's record starts the chain)."""
    return dict(_read_json(previous_json).get("chain", {"space": previous_json}))


def _save_public(d: Path, result: dict[str, Any]) -> dict[str, Any]:
    """A stage's public result as a record: arrays as .npy files beside it, the rest as JSON values."""
    arrays, values = {}, {}
    for k, v in result.items():
        if isinstance(v, np.ndarray):
            np.save(d / f"{k}.npy", v)
            arrays[k] = str(d / f"{k}.npy")
        else:
            values[k] = v
    return {"arrays": arrays, "values": values}


def _budgets(cfg: RunConfig, sites: list[dict], chain: dict[str, str]) -> list[SiteBudget]:
    """Each site's budget for the next stage: the configured total, less what the stages in ``chain`` spent."""
    spent = _site_ledgers(sites, chain)
    return [stages.site_budget(cfg, f"site {s['site']!r}", [spent[s["site"]]]) for s in sites]


def public_results(chain: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The public results of every releasing stage in ``chain`` that ran: stage -> name -> value."""
    out = {}
    for name, path in chain.items():
        rec = _read_json(path)
        if rec.get("public") is not None:
            out[name] = {**rec["public"]["values"], **{k: np.load(p) for k, p in rec["public"]["arrays"].items()}}
    return out


def stage_release(cfg_json: str, site_jsons: list[str], stage: str, previous_json: str, cache_key: str = "") -> str:
    """One releasing stage of :data:`dpneuro.run.stages.RELEASES` with every party in this process: its public
    result, every site's ledger, and the chain of records before it (a record with no result when the
    configuration has no such stage).

    ``previous_json`` is the record of the stage before (the space's for the first); ``cache_key`` only names
    Pydra's cache entry.
    """
    rel = stages.release(stage)
    cfg, sites, d = _open_stage(cfg_json, site_jsons, stage, previous_json, files=rel.files)
    out = d / f"{stage}.json"
    if out.exists():
        return str(out)
    earlier = _chain(previous_json)
    record: dict[str, Any] = {"stage": stage, "chain": {**earlier, stage: str(out)}, "public": None, "ledgers": {},
                              "seconds": 0.0}
    if rel.active(cfg):
        check_delta(cfg.delta, min(int(s["n_subjects"]) for s in sites))  # before anything is released
        t0 = time.perf_counter()
        public = public_results(earlier)
        inputs = [rel.site_input(cfg, s, public) for s in sites]
        result, ledgers = stages.run_inprocess(rel, cfg, inputs, [_lengths(s) for s in sites],
                                               dim=int(sites[0]["n_features"]), public=public,
                                               options=_options(label(cfg, stage)),
                                               budgets=_budgets(cfg, sites, earlier))
        record.update(public=_save_public(d, result), ledgers=_ledgers_json(ledgers, [s["site"] for s in sites]),
                      seconds=time.perf_counter() - t0)
    return _write_json(out, record)


# -- the whole run, one stage after another ------------------------------------------------------

def run_order() -> tuple[str, ...]:
    """Every stage of a run in order: the space, the sites' data, the releases of
    :data:`dpneuro.run.stages.RELEASES`, the maps, the report (``workflows/`` builds the same graph as Pydra nodes)."""
    return ("space", "load", *(r.name for r in stages.RELEASES), "maps", "report")


def prepare(cfg: RunConfig, until: str = "report") -> tuple[RunConfig, Any]:
    """What every simulation entry point does first: absolute paths, validation, the planned budget.

    A total ``cfg.epsilon`` is split over the releasing stages that a run up
    to ``until`` reaches. Returns the configuration to run and the budget plan
    (None unless ``cfg.epsilon`` is set).
    """
    order = run_order()
    if until not in order:
        raise ValueError(f"until must be one of {order}, got {until!r}")
    reached = tuple(s for s in RELEASING_STAGES if order.index(s) <= order.index(until))
    cfg = cfg.resolved().validate()
    preflight(cfg, until)
    return apply_target(cfg, stages=reached)


# -- pre-flight: every check that needs no release, made before the first one --------------------------

def site_discovery(cfg: RunConfig, name: str) -> SubjectDiscovery:
    """Site ``name``'s subjects and their runs as its load stage will find them (the same discovery: BIDS
    filters, fMRIPrep's default desc, ``exclude``), from the folder listing alone: no image is read."""
    site = next(s for s in cfg.sites if s.name == name)
    try:
        return find_subjects(site.files or site.path, filters=cfg.bids, subjects_tsv=site.subjects_tsv or None,
                             exclude=tuple(site.exclude), default_desc=cfg.cleaning().desc)
    except DataValidationError as exc:
        raise DataValidationError(f"site {name!r}: {exc}") from None


def site_subjects(cfg: RunConfig, name: str) -> list[str]:
    """The subjects site ``name``'s files name (:func:`site_discovery`)."""
    return [sid for sid, _ in site_discovery(cfg, name).subjects]


def check_site_covariates(cfg: RunConfig, name: str) -> None:
    """Site ``name``'s participants table gives every subject its files name the design's covariates, with
    agreed levels and numbers (the group-statistics stage's own check,
    :func:`dpneuro.data.participants.check_covariates`, on the subjects before they are loaded)."""
    if not stages.release("glm").active(cfg):
        return
    names = [s.name for s in cfg.sites]
    try:
        check_covariates(roles.participants_table(cfg, name), site_subjects(cfg, name),
                         factory.glm_settings(cfg).design, names.index(name), name, cfg.on_bad_subject)
    except CovariateError as exc:
        raise CovariateError(f"{exc} (checked before anything was loaded or released)") from None


#: Checks of one site's own inputs that need no release, each as (the stage that would otherwise meet the
#: problem, ``check(cfg, site_name)``). A simulation runs them for every site before it loads or releases anything
#: (:func:`preflight`); a deployed site for itself at start-up, before its first release
#: (:func:`dpneuro.deploy.party.run_site_analysis`). A new check of a site's files goes here.
def check_site_confounds(cfg: RunConfig, name: str) -> Cleaning:
    """Every run of site ``name`` (:func:`site_discovery`) has a confounds table the run's ``confounds`` can
    clean, read as its loader will read it (:func:`dpneuro.data.cleaning.check_confounds_tables`); returns the
    cleaning the site will do (the models its tables' columns allow)."""
    cleaning = cfg.cleaning()
    if not cleaning.confounds:
        return cleaning
    try:
        return check_confounds_tables([f for _, files in site_discovery(cfg, name).subjects for f in files],
                                      cleaning)
    except CleaningError as exc:
        raise CleaningError(f"site {name!r}: {exc} (checked before anything was loaded or released)") from None


SITE_CHECKS: list[tuple[str, Callable[[RunConfig, str], Any]]] = [
    ("load", check_site_confounds),
    ("glm", check_site_covariates),
]


def check_site(cfg: RunConfig, name: str, until: str = "report") -> None:
    """Every check of :data:`SITE_CHECKS` of site ``name`` whose stage a run up to ``until`` reaches."""
    order = run_order()
    for stage, check in SITE_CHECKS:
        if order.index(stage) <= order.index(until):
            check(cfg, name)


def check_space(cfg: RunConfig) -> None:
    """The mask and the atlas readable and the atlas onto the mask's grid (what the space stage reads), and a
    reduction that fits the features they make."""
    if cfg.reduction == "pdsvd":
        features(cfg)  # capePCA's fit check reads them itself
    check_reduction_fits(cfg)


def _inside(path, folder) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def check_outputs(cfg: RunConfig) -> None:
    """No input inside the run's working folder ``<out>/work`` (the run removes its Pydra cache there after a
    failure, ``dpneuro demo`` all of it), and the working and output folders writable."""
    work = Path(cfg.out) / "work"
    inputs = [("mask", cfg.mask), ("truth", cfg.truth), ("atlas", "" if is_atlas_name(cfg.atlas) else cfg.atlas)]
    for i, s in enumerate(cfg.sites):
        inputs += [(f"sites[{i}] ({s.name})", p) for p in (s.path, *s.files, s.subjects_tsv, s.participants)]
    for field, path in inputs:
        if path and _inside(path, work):
            raise ConfigError(f"config field {field!r}: {path} lies inside the run's working folder {work}, which "
                              "the run may delete; move it, or choose another 'out'")
    for folder, what in ((work, "working folder"), (cfg.run_dir, "output folder")):
        try:
            if folder == work:
                private_dir(folder)  # the sites' un-noised data go there: its owner only, from the start
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".dpneuro-write-check."):
                pass
        except OSError as exc:
            raise ConfigError(f"config field 'out': the run's {what} {folder} cannot be written "
                              f"({exc.strerror or exc}); nothing was loaded or released") from None


def check_networks(cfg: RunConfig) -> None:
    """Group statistics on network-level measures need components named with atlas networks: a grid the atlas
    covers (a standard MNI space), which the run knows before anything is released."""
    if not cfg.design or "networks" not in factory.glm_settings(cfg).computed:
        return
    mask, affine = cfg.grid()
    if voxel_regions(mask, affine)[1] < MIN_COVERAGE:
        raise ConfigError("group statistics: the \"networks\" measures compare atlas networks, but the atlas "
                          f"covers less than {MIN_COVERAGE:.0%} of this run's mask (not a standard MNI space), so no "
                          "component would be named; use glm_measures = [\"fnc\"] or a standard space")


#: Checks of the whole run that need no release, run by :func:`preflight` after every site's
#: (:data:`SITE_CHECKS`); a deployed party checks its own folders (:mod:`dpneuro.deploy.sharedfs`). Outputs last:
#: they make folders.
RUN_CHECKS: list[Callable[[RunConfig], None]] = [check_space, check_networks, check_outputs]


def preflight(cfg: RunConfig, until: str = "report") -> None:
    """Every check a simulation up to ``until`` can make before it loads any data or releases anything: each
    site's (:data:`SITE_CHECKS`), then the run's (:data:`RUN_CHECKS`). Raises the first problem found."""
    for s in cfg.sites:
        check_site(cfg, s.name, until)
    for check in RUN_CHECKS:
        check(cfg)


def write_config(cfg: RunConfig) -> str:
    """The run's configuration as JSON at a fixed place in the run folder (what every stage reads)."""
    work = Path(cfg.out) / "work"
    work.mkdir(parents=True, exist_ok=True)
    path = work / "config.json"
    text = json.dumps(cfg.to_json(), indent=1, default=str)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return str(path)


def run_stages(cfg: RunConfig, *, until: str = "report") -> dict[str, Any]:
    """Run the stages in this process, in order, up to ``until``; returns each stage's output file.

    ``cfg`` must come from :func:`prepare`. The Pydra workflow runs the same
    functions with the same inputs, so both give the same files (and, with a
    seed, the same numbers).
    """
    order = run_order()
    if until not in order:
        raise ValueError(f"until must be one of {order}, got {until!r}")
    reached = order[:order.index(until) + 1]
    cfg_json = write_config(cfg)
    out: dict[str, Any] = {"space": stage_space(cfg_json, stage_key(cfg, "space"))}
    out["load"] = [stage_load(cfg_json, s.name, out["space"], stage_key(cfg, "load")) for s in cfg.sites]
    last = out["space"]
    for rel in stages.RELEASES:
        if rel.name in reached:
            last = out[rel.name] = stage_release(cfg_json, out["load"], rel.name, last, stage_key(cfg, rel.name))
    if "maps" in reached:
        out["maps"] = stage_maps(cfg_json, out["load"], last, stage_key(cfg, "maps"))
    if "report" in reached:
        out["report"] = stage_report(cfg_json, out["load"], out["maps"], stage_key(cfg, "report"))
    return out


# -- maps, privacy and the report --------------------------------------------------------------

def _truth(cfg: RunConfig) -> dict | None:
    if not cfg.truth:
        return None

    return load_manifest(cfg.truth)


def _states_truth(cfg: RunConfig, truth: dict | None, states: dict, maps_truth: dict | None) -> dict | None:
    """The dFNC states against the generator's planted ones (synthetic data only): each estimated state's
    components put in the truth's order and sign by the maps' match, then the states matched by correlation."""
    if truth is None or maps_truth is None or not truth["truth"].get("state_labels"):
        return None
    planted = np.load(truth["truth"]["states"]).astype(np.float64)  # K x R x R
    est = np.load(states["matrices"])
    perm, sign = np.asarray(maps_truth["perm"]), np.sign(maps_truth["corr"])
    if planted.shape[1:] != (len(perm), len(perm)) or est.shape[1] < len(perm):
        return None
    aligned = est[:, perm][:, :, perm] * np.outer(sign, sign)
    kperm, corr = match_components(matrix_to_vector(aligned), matrix_to_vector(planted))
    labels = []
    for subjects in truth["truth"]["state_labels"].values():
        for path in subjects.values():
            h = np.load(path).astype(np.int64)
            labels.append(window_labels(h, taper(h.size, cfg.states_window, step=cfg.states_step), len(planted)))
    lab = np.concatenate(labels)
    true_occ = np.bincount(lab, minlength=len(planted)) / lab.size
    occ = np.asarray(states["occupancy"])[kperm]
    return {"perm": [int(p) for p in kperm], "corr": [float(c) for c in corr],
            "mean r with truth": float(np.mean(corr)), "occupancy error": float(np.abs(occ - true_occ).max())}


def _site_ledgers(sites: list[dict], chain: dict[str, str]) -> dict[str, Any]:
    """Every site's ledger over the releasing stages in ``chain``."""
    records = [_read_json(p) for name, p in chain.items() if name != "space"]
    return {s["site"]: PrivacyLedger.merge_all([PrivacyLedger.from_dict(r["ledgers"][s["site"]]) for r in records
                                                if r["ledgers"].get(s["site"])]) for s in sites}


def run_privacy(cfg: RunConfig, sites: list[dict], chain: dict[str, str]) -> dict:
    """privacy.json of a simulated run up to the last stage of ``chain``: every site's releases composed."""
    return consortium_privacy(cfg, _site_ledgers(sites, chain), {s["site"]: s["n_subjects"] for s in sites})


def stage_maps(cfg_json: str, site_jsons: list[str], last_json: str, cache_key: str = "") -> str:
    """The consortium's outputs (:func:`dpneuro.run.outputs.write_consortium_outputs`) and every site's own
    (:func:`~dpneuro.run.outputs.write_site_outputs`, as each site does on its own machine), agreement with a
    synthetic truth. ``last_json`` is the last releasing stage's record (its chain names the others)."""
    cfg, sites, d = _open_stage(cfg_json, site_jsons, "maps", last_json)
    out = d / "maps.json"
    if out.exists():
        return str(out)
    chain = _chain(last_json)
    space, public = _read_json(chain["space"]), public_results(chain)
    # every part of this stage timed on its own: a site's voxel maps can take most of a run
    timings: dict[str, float] = {}
    with timed(timings, label(cfg, "maps")):
        cons = write_consortium_outputs(cfg, space, public, _site_ledgers(sites, chain),
                                        {s["site"]: s["n_subjects"] for s in sites},
                                        {s["site"]: s["n_samples"] for s in sites}, d)
    site_out = {}
    for s in sites:  # in a deployment each site does this on its own machine
        site_out[s["site"]] = write_site_outputs(cfg, s, space, public, d / "sites" / s["site"],
                                                 timer=lambda name: timed(timings, name), progress=_progress())

    t0 = time.perf_counter()  # the truth metrics count as maps
    result = {"chain": chain, "components": cons["components"], "privacy": cons["privacy"], "space": chain["space"],
              "n_components": int(public["unmix"]["W"].shape[0]), "truth": None, "warnings": cons["warnings"],
              "template_problem": cons["template_problem"], "states": None, "fnc": cons["fnc"], "glm": cons["glm"],
              "spectrum": cons["spectrum"], "signal": cons["signal"],
              "fnc_subjects": {site: o["fnc_subjects"] for site, o in site_out.items() if o["fnc_subjects"]},
              "timecourses": {site: o["timecourses"] for site, o in site_out.items()},
              "site_maps": {site: o["site_maps"] for site, o in site_out.items() if o["site_maps"]},
              "site_maps_ica": {site: o["site_maps_ica"] for site, o in site_out.items() if o["site_maps_ica"]}}
    truth = _truth(cfg)
    if truth is not None:
        A_true, maps = np.load(truth["truth"]["A"]).astype(np.float64), cons["maps"]
        V, lam, W = public["reduce"]["basis"], public["reduce"]["eigenvalues"], public["unmix"]["W"]
        if A_true.shape[0] == maps.shape[0]:
            parcels = space_parcels(space)
            perm, corr = match_components(maps, A_true)
            A_true_red = parcels.reduce(A_true) if parcels is not None else A_true
            metrics = {"mean |r| with truth": float(np.mean(np.abs(corr))),
                       "min |r| with truth": float(np.min(np.abs(corr)))}
            if A_true.shape[1] == W.shape[0] and cfg.ica == "temporal":  # the truth's sources are temporal
                A_white = (V / np.sqrt(usable_eigenvalues(lam))).T @ A_true_red  # as the sites whitened
                metrics["qNGI"] = qngi(W @ A_white)
                metrics["MD index"] = md_index(W, A_white)
            site_r = {site: float(np.mean(np.abs(match_components(o["site_maps_values"], A_true)[1])))
                      for site, o in site_out.items() if o["site_maps"]}
            if site_r:  # each site's own voxel maps, averaged over the sites
                metrics["site voxel maps: mean |r| with truth"] = float(np.mean(list(site_r.values())))
            result["truth"] = {"maps": truth["truth"]["maps"], "perm": [int(p) for p in perm],
                               "corr": [float(c) for c in corr], "metrics": metrics, "site_r": site_r}
    if cons["states"] is not None:
        st_truth = _states_truth(cfg, truth, cons["states"], result["truth"])
        result["states"] = {**cons["states"], "truth": st_truth,
                            "occupancy_sites": {site: o["states_occupancy"] for site, o in site_out.items()}}
        if st_truth is not None:
            result["truth"]["metrics"].update({"states: mean r with truth": st_truth["mean r with truth"],
                                               "states: occupancy error": st_truth["occupancy error"]})
    timings[label(cfg, "maps")] += time.perf_counter() - t0
    result["timings"] = timings
    return _write_json(out, result)


def run_timings(cfg: RunConfig, sites: list[dict], chain: dict[str, str], maps: dict) -> dict[str, float]:
    """Seconds of every stage the run performed, in run order, from the stages' records (``report`` is added
    by :func:`stage_report` when it is done)."""
    timings: dict[str, float] = {}
    space = _read_json(chain["space"])
    if "seconds" in space:
        timings[label(cfg, "space")] = space["seconds"]
    for s in sites:
        timings[label(cfg, "load", s["site"])] = s["seconds"]
    for name, path in chain.items():
        rec = _read_json(path)
        if name != "space" and rec.get("public") is not None:
            timings[label(cfg, name)] = rec["seconds"]
    per_site = maps.get("timings", {})
    timings[label(cfg, "maps")] = per_site.get(label(cfg, "maps"), 0.0)
    for stage in ("timecourses", "site_maps", "occupancy"):  # each site's own passes, grouped by kind
        for s in sites:
            name = label(cfg, stage, s["site"])
            if name in per_site:
                timings[name] = per_site[name]
    return timings


def cleaning_record(cfg: RunConfig, sites: list[dict]) -> dict[str, Any]:
    """The run's cleaning as configured, and each site whose confounds tables made it use other models
    (:func:`dpneuro.data.cleaning.adapt_to_columns`) with what it used."""
    rec = {**cfg.cleaning().to_json(), "description": cfg.cleaning().describe()}
    adapted = {s["site"]: s["cleaning"]["description"] for s in sites if (s.get("cleaning") or {}).get("adapted")}
    if adapted:
        rec["sites"] = adapted
        rec["description"] += "".join(f" {site}: {text}." for site, text in adapted.items())
    return rec


def stage_report(cfg_json: str, site_jsons: list[str], maps_json: str, cache_key: str = "") -> str:
    """report.html (self-contained) plus the final outputs copied to the run's folder ``<out>/<run_id>``."""
    t0 = time.perf_counter()
    cfg = RunConfig.from_dict(_read_json(cfg_json))
    sites = _sites(site_jsons)
    mp = _read_json(maps_json)
    space = _read_json(mp["space"])
    unm = public_results(mp["chain"])["unmix"]
    out = cfg.run_dir  # the run's own folder: another run id into the same out keeps its outputs
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    truth = mp.get("truth")
    priv = _read_json(mp["privacy"])
    parts = consortium_report_parts(cfg, space, mp["components"], priv, unm,
                                    n_subjects=sum(s["n_subjects"] for s in sites), warnings=mp.get("warnings", []),
                                    template_problem=mp["template_problem"], figs=figs, states=mp.get("states"),
                                    fnc=mp.get("fnc"), spectrum=mp.get("spectrum"), glm=mp.get("glm"),
                                    truth=truth)
    if mp.get("site_maps"):  # a simulation holds every site's voxel maps: each beside the consortium's map
        render_site_maps(parts["components"], mp["site_maps"], mp["components"], space["mask"], figs / "site_maps",
                         problem=mp["template_problem"])
    # time courses are each site's own (un-noised) data: a figure per site beside its TSV, never in the
    # consortium report
    tc_dir = out / "timecourses"
    tc_dir.mkdir(exist_ok=True)
    for s in sites:
        site_timecourse_figure(mp["timecourses"][s["site"]], s["site"], (s["subject_ids"][0], *s["boundaries"][0]),
                               s["tr"], tc_dir / f"{s['site']}.png")
    for name in ("components.nii.gz", "components.tsv", "privacy.json"):
        shutil.copyfile(Path(mp["components"]).with_name(name), out / name)
    for site, p in mp["timecourses"].items():  # each with its JSON sidecar (columns, RepetitionTime)
        shutil.copyfile(p, tc_dir / f"{site}.tsv")
        shutil.copyfile(Path(p).with_suffix(".json"), tc_dir / f"{site}.json")
    if mp.get("site_maps"):  # each site's own, beside its time courses
        (out / "site_maps").mkdir(exist_ok=True)
        for site, p in mp["site_maps"].items():
            shutil.copyfile(p, out / "site_maps" / f"{site}.nii.gz")
    if mp.get("fnc"):
        for name in ("fnc.tsv", "fnc.json"):
            shutil.copyfile(Path(mp["fnc"]["tsv"]).with_name(name), out / name)
    if mp.get("glm"):
        for name in ("group_effects.tsv", "group_effects.json"):
            shutil.copyfile(Path(mp["glm"]["tsv"]).with_name(name), out / name)
    for site, p in (mp.get("fnc_subjects") or {}).items():  # each site's own subjects, beside its time courses
        shutil.copyfile(p, tc_dir / f"{site}_fnc.tsv")
    if mp.get("states"):
        st = mp["states"]
        for name in ("states.npy", "states.json"):
            shutil.copyfile(Path(st["matrices"]).with_name(name), out / name)
        for site, p in st["occupancy_sites"].items():  # each site's own subjects, beside its time courses
            shutil.copyfile(p, tc_dir / f"{site}_states.tsv")
    np.save(out / "W.npy", unm["W"])
    timings = run_timings(cfg, sites, mp["chain"], mp)
    # everything above is the report's work; writing run.json and the HTML below takes milliseconds
    timings[label(cfg, "report")] = time.perf_counter() - t0
    record = write_json(out / "run.json", {
        "config": cfg.to_json(), "versions": _versions(),
        "seed_policy": f"fixed seed {cfg.seed} (reproducible simulation)" if cfg.seed is not None
        else "OS entropy (fresh noise every run)",
        "timings_s": timings, "ica_rounds_run": unm["rounds"], "ica_status": unm["status"],
        # each site's guided ICA of its own voxel maps (simulated here; a deployed site records its own)
        "site_maps_ica": mp.get("site_maps_ica", {}),
        "warnings": list(mp.get("warnings", [])), "metrics": parts["metrics"],
        "signal": (mp.get("spectrum") or {}).get("sentence"),
        "features": space.get("features", ""),
        "cleaning": cleaning_record(cfg, sites),
        "data": {s["site"]: site_data_summary(s) for s in sites}})
    run = _read_json(record)  # the report shows what the run recorded
    notes = []
    if cfg.seed is not None:
        notes.append(f"Simulation with fixed seed {cfg.seed}: reproducible, not for a deployment.")
    report = write_consortium_report(out, parts, priv, timings=run["timings_s"], run=run["config"], notes=notes,
                                     site_maps=consortium_section(cfg, space, simulated=True,
                                                                  ica=run["site_maps_ica"]),
                                     data={"cleaning": run["cleaning"]["description"], "features": run["features"],
                                           "sites": sites})
    return str(report)
