"""Estimators in the scikit-learn / nilearn style: NIfTI per site in; maps, time courses and privacy out.

>>> ica = dpneuro.DecentralizedICA(n_components=20, epsilon=8.0)
>>> ica.fit({"site-01": files_1, "site-02": files_2, "site-03": files_3})
>>> ica.components_img_          # 4-D NIfTI, one volume per component
>>> print(ica.privacy_)          # eps per site against the aggregator and its colluders
>>> ica.report_.save_as_html("report.html")

An estimator turns its parameters into a :class:`~dpneuro.config.RunConfig`
and runs the same stages as ``dpneuro run`` and the Pydra workflow
(:func:`dpneuro.run.pipeline.run_stages`), so the three give the same numbers for
the same seed. ``role="site"`` / ``"aggregator"`` runs one party of a deployed
run over a shared folder, through the code ``dpneuro site`` /
``dpneuro aggregator`` use.
"""

from __future__ import annotations

import dataclasses
import html as _html
import inspect
import json
import os
import shutil
import tempfile
import textwrap
import tomllib
import webbrowser
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils.validation import check_is_fitted

from dpneuro._utils.files import private_dir
from dpneuro.algorithms.djica import time_courses
from dpneuro.config import ConfigError, RunConfig, SiteEntry, estimator_name
from dpneuro.data.images import load_mask, mask_to_image
from dpneuro.data.load import load_site
from dpneuro.data.parcellation import space_parcels
from dpneuro.deploy.sharedfs import aggregator_main, site_main
from dpneuro.privacy import PrivacyLedger, privacy_report
from dpneuro.privacy.cape_delta import max_colluding
from dpneuro.privacy.summary import headline_lines
from dpneuro.report.figures import read_timecourses
from dpneuro.run import pipeline
from dpneuro.run.features import features as feature_count
from dpneuro.run.naming import read_component_table
from dpneuro.run.outputs import read_fnc, read_group_effects, table_path, to_voxels
from dpneuro.run.pipeline import progress, public_results, run_privacy
from dpneuro.run.planner import plan_for_target, site_shapes, spend
from dpneuro.run.roles import unmixing_input

__all__ = ["DecentralizedICA", "DecentralizedPCA", "PrivacySummary", "Report", "plan_budget"]

ROLES = ("simulation", "site", "aggregator")
#: "serial": the stages in this process; "pydra": the Pydra workflow (serial plugin); "pydra-cf": concurrent workers
ENGINES = ("serial", "pydra", "pydra-cf")

#: the RunConfig fields an estimator takes as parameters: all but the data, which ``fit`` takes
_SETTINGS = tuple(f for f in dataclasses.fields(RunConfig) if f.name != "sites")


def _param_name(f: dataclasses.Field) -> str:
    """The estimator's name for a RunConfig field (the field's own, except where its metadata names another)."""
    return estimator_name(f.name)


#: estimator parameter name -> RunConfig field
_FIELD_OF = {_param_name(f): f for f in _SETTINGS}


def _field_default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _param_default(f: dataclasses.Field):
    """The parameter's default: the field's, or None where that is mutable (scikit-learn clones defaults) or
    missing (``out``: a scratch folder)."""
    return f.default if f.default is not dataclasses.MISSING else None


def _as_setting(f: dataclasses.Field, value):
    """A parameter's value as its field's: None stands for the field's default, a path for its text."""
    if value is None:
        return _field_default(f)
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _as_fields(params: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Estimator parameter names -> RunConfig field names, refusing any other name."""
    unknown = sorted(set(params) - set(_FIELD_OF))
    if unknown:
        raise TypeError(f"{where}: unknown parameter(s) {unknown}; settings are the RunConfig fields "
                        f"{sorted(_FIELD_OF)}")
    return {_FIELD_OF[k].name: _as_setting(_FIELD_OF[k], v) for k, v in params.items()}


class Report:
    """The run's self-contained HTML report: ``save_as_html``, ``open_in_browser``, shown inline in notebooks."""

    def __init__(self, path):
        self.path = Path(path)

    @property
    def html(self) -> str:
        return self.path.read_text()

    def save_as_html(self, path) -> Path:
        path = Path(path)
        path.write_text(self.html)
        return path

    def get_iframe(self, width: int = 960, height: int = 800) -> str:
        return (f'<iframe srcdoc="{_html.escape(self.html, quote=True)}" width="{width}" height="{height}" '
                'frameBorder="0"></iframe>')

    def _repr_html_(self) -> str:
        return self.get_iframe()

    def open_in_browser(self) -> None:
        webbrowser.open(self.path.resolve().as_uri())

    def __repr__(self) -> str:
        return f"Report({str(self.path)!r})"


class PrivacySummary:
    """What every site spent (from the run's ``privacy.json``); prints as a table.

    ``epsilon`` is the headline: each site's total against the aggregator and
    its colluders (replace-one-subject neighbours, at ``delta``).
    """

    def __init__(self, report: dict[str, Any]):
        self.report = report

    @property
    def epsilon(self) -> dict[str, float]:
        return dict(self.report["epsilon"])

    @property
    def delta(self) -> float:
        return float(self.report["delta"])

    @property
    def ledgers(self) -> dict:
        """Every site's :class:`~dpneuro.privacy.PrivacyLedger` (each release with its sensitivity and noise)."""
        return {n: PrivacyLedger.from_dict(s["ledger"]) for n, s in self.report["sites"].items()}

    def table(self):
        """One row per site: subjects, the headline eps, its RDP bound, one site's releases alone (pandas)."""
        import pandas as pd  # deferred: a table for the notebook only; pandas is slow to load

        rows = {n: {"subjects": s.get("n_subjects"), "epsilon": s["epsilon"], "epsilon (RDP)": s["epsilon_rdp"],
                    "epsilon, one site's releases alone": s["epsilon_single_release"],
                    "releases": len(s["ledger"]["releases"])} for n, s in self.report["sites"].items()}
        return pd.DataFrame.from_dict(rows, orient="index")

    def lines(self) -> list[str]:
        return headline_lines(self.report)

    def __str__(self) -> str:
        return "\n".join(self.lines()) + "\n" + self.table().to_string(float_format=lambda v: f"{v:.3f}")

    def _repr_html_(self) -> str:
        head = "".join(f"<p>{_html.escape(ln)}</p>" for ln in self.lines())
        return head + self.table().to_html(float_format=lambda v: f"{v:.3f}")

    def __repr__(self) -> str:
        eps = ", ".join(f"{n}: {e:.2f}" for n, e in self.epsilon.items())
        return f"PrivacySummary(epsilon={{{eps}}}, delta={self.delta:g})"


def _site_inputs(sites, staging: Path) -> list[SiteEntry]:
    """``{name: folder | BIDS root | file | [Niimg-like, ...]}`` as config sites; in-memory images are saved."""
    if not isinstance(sites, Mapping) or not sites:
        raise ValueError("sites must be a non-empty mapping: site name -> folder, BIDS root or list of NIfTI "
                         "images/paths")
    out = []
    for name, data in sites.items():
        name = str(name)
        if data is None:  # a deployed party: another site, whose data are not here
            out.append(SiteEntry(name=name, path=""))
            continue
        if isinstance(data, (str, Path)):
            out.append(SiteEntry(name=name, path=str(data)))
            continue
        if not isinstance(data, Sequence) or isinstance(data, bytes) or not data:
            raise ValueError(f"site {name!r}: give a folder, a BIDS root or a non-empty list of 4-D NIfTI "
                             f"images or paths, got {type(data).__name__}")
        files = []
        for i, img in enumerate(data):
            if isinstance(img, (str, Path)):
                files.append(str(img))
                continue
            if not hasattr(img, "affine") or not hasattr(img, "dataobj"):
                raise ValueError(f"site {name!r}, item {i}: not a NIfTI image or path ({type(img).__name__})")
            # an in-memory image: the stages read files, so it is written once to the run's private folder
            path = private_dir(staging) / name / f"sub-{name}x{i:04d}_bold.nii.gz"
            path.parent.mkdir(exist_ok=True)
            img.to_filename(path)
            files.append(str(path))
        out.append(SiteEntry(name=name, path="", files=files))
    return out


#: parameters of an estimator that are not settings of the run: how and where this process takes part
_OWN_PARAMS = {"role": "simulation", "site": None, "key_file": None, "keys": None, "engine": "serial", "verbose": 0}
_OWN_PARAMS_DOC = """\
role : {"simulation", "site", "aggregator"}, default="simulation"
    ``"site"`` / ``"aggregator"``: run one party of a deployed run over the
    shared folder ``exchange_dir`` (as ``dpneuro site`` / ``dpneuro aggregator``).
site : str, default=None
    With ``role="site"``: this party's site name.
key_file : path, default=None
    With a deployed role: this party's private signing key (``dpneuro
    keygen``; ``--key-file``).
keys : path, default=None
    With a deployed role: the consortium's keys file pinning every party's
    public key (``--keys``); required unless ``simulation=True``.
engine : {"serial", "pydra", "pydra-cf"}, default="serial"
    Run the stages in this process, or through the Pydra workflow with its
    serial or concurrent plugin (not inside a running event loop such as
    Jupyter's).
verbose : int, default=0
    Progress bars when > 0."""
#: what an estimator adds to a setting's documentation
_PARAM_NOTES = {
    "out": "With the estimator, ``None`` (the default): a temporary folder only this user can read, removed with "
           "the estimator (or at exit); the sites' un-noised matrices are then removed as soon as ``fit`` "
           "returns. A relative path is taken against the working folder at ``fit``; the outputs are in "
           "``output_dir_`` (``<out>/<run_id>``).",
}
#: the first parameter may be given by position, as scikit-learn's PCA(n_components)
_POSITIONAL = "n_components"


def _annotation(f: dataclasses.Field) -> str:
    return f.type if f.default is not dataclasses.MISSING else f"{f.type} | None"


def _signature() -> inspect.Signature:
    """``__init__``'s signature: ``n_components``, then every other RunConfig field but ``sites`` (keyword-only,
    in the dataclass's order), then the estimator's own parameters."""
    kw = inspect.Parameter.KEYWORD_ONLY
    settings = {_param_name(f): inspect.Parameter(_param_name(f), kw, default=_param_default(f),
                                                  annotation=_annotation(f)) for f in _SETTINGS}
    first = settings.pop(_POSITIONAL).replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
    own = [inspect.Parameter(k, kw, default=v) for k, v in _OWN_PARAMS.items()]
    return inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), first,
                              *settings.values(), *own])


_SIGNATURE = _signature()


def _parameters_doc() -> str:
    """The numpydoc Parameters entries, in the signature's order: each setting's documentation from its
    RunConfig field, then the estimator's own parameters."""
    entries = []
    for name in [p for p in _SIGNATURE.parameters if p in _FIELD_OF]:
        f = _FIELD_OF[name]
        head = f"{name} : {_annotation(f)}, default={_param_default(f)!r}"
        if _param_default(f) is None and _field_default(f) is not None:
            head += f" (the configuration's {_field_default(f)!r})"
        renamed = f"The configuration's ``{f.name}``." if name != f.name else ""
        doc = " ".join(d for d in (renamed, f.metadata.get("doc", ""), _PARAM_NOTES.get(name, "")) if d)
        if doc:
            head += "\n" + textwrap.fill(doc, 75, initial_indent="    ", subsequent_indent="    ",
                                         break_on_hyphens=False)
        entries.append(head)
    return "\n".join(entries) + "\n" + _OWN_PARAMS_DOC




class _Decentralized(BaseEstimator):
    """Shared parameters and plumbing of :class:`DecentralizedICA` and :class:`DecentralizedPCA`."""

    _until = "report"

    def __init__(self, *args, **params):
        # scikit-learn reads the parameters from the signature below; only storing them here keeps clone exact
        try:
            bound = _SIGNATURE.bind(self, *args, **params)
        except TypeError as exc:
            raise TypeError(f"{type(self).__name__}(): {exc}") from None
        bound.apply_defaults()
        for name, value in list(bound.arguments.items())[1:]:
            setattr(self, name, value)

    __init__.__signature__ = _SIGNATURE

    def __sklearn_clone__(self):
        twin = super().__sklearn_clone__()
        if hasattr(self, "_config_sites"):  # from_config's sites: the data a fit without arguments reads
            twin._config_sites = self._config_sites
        return twin

    # -- configuration ------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config, **params):
        """An estimator running exactly a configuration (a :class:`RunConfig` or a run.toml path).

        The file's inputs (sites, mask, ...) are read relative to its folder;
        its ``out``, when relative, is taken against the working folder at
        ``fit``, as the estimator's own ``out``.
        """
        if isinstance(config, RunConfig):
            cfg = config
        else:
            cfg = RunConfig.read(config)  # every path against the file's folder; its outputs go where the user works
            cfg = replace(cfg, out=tomllib.loads(Path(config).read_text()).get("out", ""))
        est = cls(**{**{_param_name(f): getattr(cfg, f.name) for f in _SETTINGS}, **params})
        est._config_sites = cfg.sites
        return est

    def to_config(self, sites=None) -> RunConfig:
        """The :class:`RunConfig` a fit with these parameters runs (relative paths against the working folder)."""
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        settings = _as_fields({name: getattr(self, name) for name in _FIELD_OF}, type(self).__name__)
        out = Path(settings["out"]) if settings["out"] else self._scratch_dir()
        if sites is None:
            site_inputs = getattr(self, "_config_sites", None)
            if site_inputs is None:
                raise ValueError("fit needs the sites' data: a mapping site name -> folder, BIDS root or list "
                                 "of NIfTI images/paths")
        else:
            site_inputs = _site_inputs(sites, out / "inputs")
        if self.role != "simulation":
            if not settings["exchange_dir"]:
                raise ValueError(f"role {self.role!r} needs exchange_dir=<the run's shared folder>")
            settings["backend"] = "directory"
        return RunConfig(**{**settings, "sites": list(site_inputs), "out": str(out)}).resolved()

    # -- fitting ------------------------------------------------------------------------------------
    def fit(self, sites=None, y=None, *, covariates=None):
        """Run the consortium analysis on ``sites`` (site name -> folder, BIDS root or list of Niimg-like).

        In a simulation (the default) every site's data are given here and all
        parties run in this process. With ``role="site"`` give only this
        party's site (``site=`` names it); with ``role="aggregator"`` give none.
        ``covariates`` (site name -> TSV path) names each site's participants
        table for the group statistics (``design``); by default each site's
        folder's ``participants.tsv``.
        """
        cfg = self.to_config(sites if sites is not None or self.role != "aggregator" else {})
        if covariates:
            unknown = set(covariates) - {s.name for s in cfg.sites}
            if unknown:
                raise ValueError(f"covariates: no site named {sorted(unknown)} (sites: {[s.name for s in cfg.sites]})")
            cfg = replace(cfg, sites=[replace(s, participants=str(Path(covariates[s.name]).resolve()))
                                      if s.name in covariates else s for s in cfg.sites])
        with progress(bool(self.verbose)):
            if self.role == "simulation":
                self._fit_simulation(cfg)
            else:
                self._fit_party(cfg)
        if not self.out:  # nobody asked for files: the sites' un-noised matrices go at once
            for d in (Path(cfg.out) / "work").glob("load-*"):
                shutil.rmtree(d, ignore_errors=True)
        return self

    def _scratch_dir(self) -> Path:
        """Where a fit without ``out`` writes: a folder only this user can read, removed with the estimator
        (or when Python exits)."""
        self._scratch = tempfile.TemporaryDirectory(prefix="dpneuro-")
        return Path(self._scratch.name)

    def _fit_simulation(self, cfg: RunConfig) -> None:
        cfg, self.budget_ = pipeline.prepare(cfg, until=self._until)
        if self.engine.startswith("pydra"):
            if self._until != "report":
                raise ValueError(f"engine {self.engine!r} runs the whole workflow; {type(self).__name__} needs "
                                 "'serial'")
            from dpneuro.workflows import run_workflow  # deferred: it loads Pydra, which only the pydra engines need

            outputs = run_workflow(cfg, plugin="cf" if self.engine == "pydra-cf" else "serial", prepared=True)
        else:
            outputs = pipeline.run_stages(cfg, until=self._until)
        self.config_ = cfg
        self.output_dir_ = cfg.run_dir
        self.outputs_ = outputs
        self._read_outputs(outputs)

    def _fit_party(self, cfg: RunConfig) -> None:
        raise ValueError(f"{type(self).__name__} runs as a simulation only (role='simulation'); a deployed run "
                         "is the whole ICA: use DecentralizedICA")

    def _read_space(self, space_json: str) -> None:
        space = json.loads(Path(space_json).read_text())
        self._space = space
        self.mask_img_ = _in_memory(space["mask"])
        self._mask = load_mask(space["mask"])[0]



def _signal(labels: list[dict]) -> np.ndarray:
    """Which components of a components.tsv stand above the privacy noise."""
    return np.array([r.get("signal", True) for r in labels], bool)


def _group_effects(components) -> list[dict] | None:
    path = Path(components).with_name("group_effects.tsv")
    return read_group_effects(path) if path.exists() else None


def _in_memory(path):
    img = nib.load(str(path))
    return nib.Nifti1Image(np.asanyarray(img.dataobj), img.affine, img.header)


def _read_json(path) -> dict:
    return json.loads(Path(path).read_text())


class DecentralizedICA(_Decentralized):
    """Group ICA of a consortium's fMRI with a per-subject differential-privacy guarantee.

    capePCA (one private release per site), then the unmixing: by default
    spatial ICA (``ica="spatial"``: FastICA of the released basis, no further
    release), or temporal ICA by capeDJICA's private rounds (``ica="temporal"``).

    Parameters
    ----------
    Every :class:`~dpneuro.config.RunConfig` field but ``sites`` is a parameter
    of the same name unless noted; ``None`` stands for the field's default.

    {parameters}

    Attributes
    ----------
    components_img_ : Nifti1Image
        4-D, one z-scored spatial map per component, in network order.
    components_ : ndarray (n_components, n_voxels)
        The maps inside the mask (``mask_img_``).
    component_labels_ : list of dict
        One row of ``components.tsv`` per component: ``network`` (a network of the
        Schaefer 2018 atlas, "Subcortical", "Cerebellum", "Other", or "unnamed" off MNI
        grids), ``overlap_<network>``, ``peak_x/y/z`` (MNI mm), ``hemisphere``,
        ``variance_share`` (of the released spectrum), ``noise_fraction``, ``signal`` (above the
        privacy noise), ``signal_share``, ``noise`` (below the privacy noise, or mostly outside grey matter).
    signal_components_ : ndarray of bool (n_components,)
        Which components stand above the privacy noise (released eigenvalues above the noise's edge); the
        others are named "noise" and are no finding in the FNC or the group statistics.
    fnc_ : ndarray (n_components, n_components) or None
        The consortium's static FNC (Fisher z, diagonal 0; ``fnc.tsv``), None with ``fnc = False``;
        its noise's standard deviation per entry is in ``fnc.json`` beside it.
    group_effects_ : list of dict or None
        With a ``design``: one row of ``group_effects.tsv`` per contrast and measure (``contrast``,
        ``measure``, ``estimate``, ``se``, ``ci_low``, ``ci_high``, ``p``, ``q``, ``noise_sd``); None without.
    unmixing_ : ndarray (n_components, n_components)
        W in the whitened space; ``bias_`` its bias.
    basis_, eigenvalues_ : ndarray
        The released PCA basis (features x n_components) and eigenvalues.
    timecourses_ : dict
        site -> subject -> ndarray (n_volumes, n_components): each site's own
        time courses (in a deployment a site sees only its own).
    site_maps_imgs_ : dict
        site -> 4-D Nifti1Image: with parcels, each site's own maps at the
        mask's voxel resolution (``site_maps_method``: guided spatial ICA of
        its own voxels, or dual regression; no privacy spent; a site sees
        only its own). Empty without parcels or with ``site_voxel_maps=False``.
    privacy_ : PrivacySummary
    report_ : Report
    budget_ : BudgetPlan or None
        The plan that split ``epsilon`` over the stages.
    metrics_ : dict or None
        Agreement with a synthetic ground truth (``truth=``).
    states_ : ndarray (brain_states, n_components, n_components) or None
        The dFNC states: each state's correlation matrix between the
        components (indexed like ``components_``).
    state_occupancy_ : dict or None
        site -> subject -> fraction of its windows in each state (each site
        computes its own from the public states; in a deployment a site sees
        only its own). ``states_occupancy_consortium_``: the consortium's
        (the states' last private release).
    warnings_ : list of str
    config_ : RunConfig
        Exactly what ran.
    """

    __doc__ = __doc__.replace("{parameters}", textwrap.indent(_parameters_doc(), "    ").lstrip())

    def _read_outputs(self, outputs: dict) -> None:
        mp = _read_json(outputs["maps"])
        public = public_results(mp["chain"])
        red, unm = public["reduce"], public["unmix"]
        self._read_space(outputs["space"])
        self.components_img_ = _in_memory(mp["components"])
        self.components_ = np.asarray(self.components_img_.dataobj)[self._mask].T.astype(np.float64)
        self.component_labels_ = read_component_table(table_path(mp["components"]))
        self.signal_components_ = _signal(self.component_labels_)
        self.fnc_ = read_fnc(mp["components"])
        self.group_effects_ = _group_effects(mp["components"])
        self.basis_, self.eigenvalues_ = red["basis"], red["eigenvalues"]
        self.unmixing_, self.bias_ = unm["W"], unm["b"]
        self.n_iter_ = int(unm["rounds"])
        self.timecourses_ = {}
        for site, path in mp["timecourses"].items():
            subj, S = read_timecourses(path)
            self.timecourses_[site] = _by_subject(subj, S)
        self.site_maps_imgs_ = {site: _in_memory(p) for site, p in mp.get("site_maps", {}).items()}
        self.privacy_ = PrivacySummary(_read_json(mp["privacy"]))
        self.report_ = Report(outputs["report"])
        self._read_states(mp.get("states"))
        self.metrics_ = (mp.get("truth") or {}).get("metrics")
        self.warnings_ = list(mp.get("warnings", []))

    def _read_states(self, st: dict | None) -> None:
        self.states_ = self.state_occupancy_ = self.states_occupancy_consortium_ = None
        if not st:
            return
        self.states_ = np.load(st["matrices"])
        self.states_occupancy_consortium_ = np.asarray(st["occupancy"])
        self.state_occupancy_ = {site: _read_occupancy(p) for site, p in st["occupancy_sites"].items()}

    def _fit_party(self, cfg: RunConfig) -> None:
        cfg = cfg.validate(data_sites=[self.site] if self.role == "site" else ())
        cfg.check_deployment(f"the {self.role}")
        self.site_maps_imgs_ = {}
        if self.role == "site":
            if self.site not in [s.name for s in cfg.sites]:
                raise ValueError(f"site={self.site!r} is not among the sites {[s.name for s in cfg.sites]}")
            res = site_main(cfg, self.site, key_file=self.key_file, keys_file=self.keys)
            self.timecourses_ = {self.site: _by_subject(*read_timecourses(res["timecourses"]))}
            if res.get("site_maps"):
                self.site_maps_imgs_ = {self.site: _in_memory(res["site_maps"])}
            if res.get("states_occupancy"):
                self.state_occupancy_ = {self.site: _read_occupancy(res["states_occupancy"])}
            self.report_ = Report(res["report"])
            priv = _site_privacy(cfg, _read_json(res["privacy"]))
        else:
            res = aggregator_main(cfg, key_file=self.key_file, keys_file=self.keys, progress=bool(self.verbose))
            self.report_ = Report(res["report"])
            self.warnings_ = list(res.get("warnings", []))
            priv = _read_json(res["privacy"])
        self.config_ = cfg
        self.output_dir_ = Path(res["components"]).parent
        self.components_img_ = _in_memory(res["components"])
        self.component_labels_ = read_component_table(table_path(res["components"]))
        self.signal_components_ = _signal(self.component_labels_)
        self.fnc_ = read_fnc(res["components"])
        self.group_effects_ = _group_effects(res["components"])
        self.privacy_ = PrivacySummary(priv)

    def transform(self, imgs) -> list[np.ndarray]:
        """Time courses (n_volumes x n_components per subject) of new subjects of a site.

        A site-local computation with the released basis and unmixing: nothing
        is released and nothing leaves the site. ``imgs``: a list of 4-D
        Niimg-like (paths or images, one per subject), a folder or a BIDS /
        fMRIPrep root. The subjects are read as the fit read its sites: the
        same BIDS filters (task, space, res, desc, ...), cleaning, smoothing
        and resampling to the grid.
        """
        check_is_fitted(self)
        if not hasattr(self, "unmixing_"):
            raise ValueError("transform needs the fitted unmixing (a simulation or the aggregator's run)")
        with tempfile.TemporaryDirectory(prefix="dpneuro-transform-") as tmp:
            src = _site_inputs({"new": imgs}, Path(tmp))[0]
            cfg = self.config_
            sd = load_site(src.files or src.path, self._space["mask"], standardize=cfg.standardize,
                           min_volumes=cfg.min_volumes, parcels=space_parcels(self._space), bids=cfg.bids,
                           cleaning=cfg.cleaning())
            S = time_courses(self.unmixing_, unmixing_input(cfg, sd.X, self.basis_, self.eigenvalues_), self.bias_)
        return [np.ascontiguousarray(S[:, a:b].T) for a, b in sd.boundaries]

    @property
    def n_features_in_(self) -> int:
        return int(self.basis_.shape[0])


def _read_occupancy(path) -> dict[str, np.ndarray]:
    """A site's states TSV (subject, state1, ..., dwell times, transitions) as subject -> fractions of time."""
    lines = [line.split("\t") for line in Path(path).read_text().splitlines() if line]
    cols = [i for i, h in enumerate(lines[0]) if h.startswith("state")]
    return {r[0]: np.array([float(r[i]) for i in cols]) for r in lines[1:]}


def _site_privacy(cfg: RunConfig, site_priv: dict) -> dict:
    """A site's own privacy.json in the consortium's form (one site: the only ledger it holds)."""
    n_sites = len(cfg.sites)
    colluding = cfg.n_colluding if cfg.n_colluding is not None else max_colluding(n_sites)
    rep = privacy_report({site_priv["site"]: PrivacyLedger.from_dict(site_priv["ledger"])}, delta=cfg.delta,
                         n_subjects={site_priv["site"]: site_priv["n_subjects"]}, plan=cfg.plan,
                         n_colluding=colluding, seeded=cfg.seed is not None)
    return {**rep, "n_sites": n_sites}


def _by_subject(subjects: list[str], S: np.ndarray) -> dict[str, np.ndarray]:
    """Rows of a time-course table grouped by subject, each (n_volumes, n_components)."""
    out: dict[str, list[int]] = {}
    for i, s in enumerate(subjects):
        out.setdefault(s, []).append(i)
    return {s: np.ascontiguousarray(S[:, idx].T) for s, idx in out.items()}


class DecentralizedPCA(_Decentralized):
    """The consortium's private principal components (capePCA alone: one release per site).

    Parameters are those of :class:`DecentralizedICA`; ``epsilon`` is then all
    spent on the one PCA release.

    Attributes
    ----------
    components_ : ndarray (n_components, n_voxels)
        Principal components painted back to the mask's voxels.
    components_img_ : Nifti1Image
    explained_variance_ : ndarray (n_components,)
        Eigenvalues of the (noisy) second-moment matrix of unit-norm time points.
    basis_ : ndarray (n_features, n_components)
    privacy_ : PrivacySummary
    """

    _until = "reduce"

    def to_config(self, sites=None) -> RunConfig:
        if self.brain_states:
            raise ConfigError("brain_states: brain states are found on the ICA's component time courses; "
                              "use DecentralizedICA(brain_states=...)")
        cfg = super().to_config(sites)
        if cfg.pca_contribution == "auto":  # a PCA's eigenvalues are variances: second moments
            cfg = replace(cfg, pca_contribution="moment")
        return cfg

    def _read_outputs(self, outputs: dict) -> None:
        chain = _read_json(outputs["reduce"])["chain"]
        red = public_results(chain)["reduce"]
        self._read_space(outputs["space"])
        self.basis_, self.explained_variance_ = red["basis"], red["eigenvalues"]
        vox = to_voxels(self._space, self.basis_)
        self.components_ = np.ascontiguousarray(vox.T)
        self.components_img_ = mask_to_image(vox, self._space["mask"])
        self.privacy_ = PrivacySummary(run_privacy(self.config_, [_read_json(p) for p in outputs["load"]], chain))


def plan_budget(epsilon: float | None = None, *, sites=4, subjects: int | None = None, timepoints: int = 150,
                n_components: int = 20, features: int | None = None, **settings):
    """What a consortium run spends per site, or (with ``epsilon``) the per-stage settings that spend it.

    ``sites``: a number of sites (with ``subjects`` per site and
    ``timepoints`` per subject), or a mapping site name -> data (counts are
    read from the file headers). ``settings``: other parameters of the
    estimators, which are the RunConfig fields (``parcels``, ``plan``,
    ``ica_rounds``, ...). Returns a :class:`~dpneuro.run.planner.BudgetPlan`, which
    prints as a table.
    """
    if not isinstance(sites, Mapping) and subjects is None:
        raise ValueError("give subjects= (per site) with a number of sites, or a mapping of the sites' data")
    # in-memory images are written where only their headers are read, and removed with the folder
    with tempfile.TemporaryDirectory(prefix="dpneuro-plan-") as staging:
        if isinstance(sites, Mapping):
            site_inputs = _site_inputs(sites, Path(staging))
        else:
            site_inputs = [SiteEntry(f"site-{i + 1:02d}", "") for i in range(int(sites))]
        cfg = RunConfig(**{**_as_fields(settings, "plan_budget"), "sites": site_inputs, "out": "",
                           "n_components": n_components})
        cfg.validate(data_sites=())
        shapes = site_shapes(cfg, subjects=None if isinstance(sites, Mapping) else subjects, timepoints=timepoints)
        dim = feature_count(cfg, features)
        return spend(cfg, shapes, dim) if epsilon is None else plan_for_target(cfg, shapes, dim, epsilon)
