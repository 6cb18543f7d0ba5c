"""Run configuration: one TOML file, validated as a whole before anything runs."""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .cape.plans import PLAN_KINDS as PLANS
from .privacy import CALIBRATIONS, noise_multiplier
from .privacy.ledger import UNITS

BACKENDS = ("inprocess", "directory")
#: the run id of a run that names none: its outputs go to <out>/dpneuro/
DEFAULT_RUN_ID = "dpneuro"
#: reductions a consortium run performs, each a protocol every entry point runs: capePCA (one private
#: release, or private power iterations), "none" (the PCA without noise) and "pdsvd" (PD-SVD: secure sums,
#: no noise; its privacy is the blinding of the singular values, not differential privacy)
REDUCTIONS = ("capepca", "capepca-power", "none", "pdsvd")
#: the group ICA model: independent maps (spatial: CanICA/MELODIC/GIFT, post-processing of the released basis)
#: or independent time courses (temporal: capeDJICA, private rounds of its own)
ICA_MODELS = ("spatial", "temporal")
#: how temporal ICA unmixes: capeDJICA's private gradient rounds, or two releases (a refined whitening, then the
#: subjects' fourth-order cumulants: dpneuro.algorithms.cumulant_ica)
UNMIXINGS = ("capedjica", "cumulant")
#: what a subject adds to the PCA's second moment ("auto": subspace under spatial ICA, moment otherwise)
PCA_CONTRIBUTIONS = ("auto", "subspace", "moment")
#: how a site makes its own voxel maps (``dpneuro.site_maps``)
SITE_MAPS_METHODS = ("guided_ica", "dual_regression")
#: Pydra workers a site may run its per-subject decoding on (``cluster.worker``), and the keys of ``cluster``
CLUSTER_WORKERS = ("dask", "slurm")
CLUSTER_KEYS = ("worker", "subjects_per_task", "address", "sbatch_args")
#: subjects one cluster task decodes when ``cluster.subjects_per_task`` is not given (a SLURM job each)
SUBJECTS_PER_TASK = 8


#: What ``dpneuro synth`` writes by default and the demo analyses: 128 subjects at 6 mm.
SYNTHETIC_CONSORTIUM: dict[str, Any] = {
    "sites": 4, "subjects": 32, "components": 8, "timepoints": 120, "space": "mni6mm", "dtype": "int16",
}


#: The tuned analysis settings (the field defaults above): measured on :data:`SYNTHETIC_CONSORTIUM` by
#: ``benchmarks/demo_speed.py``; the demo and ``site_templates/run.toml`` use them (a test checks).
#: Subject-level noise scales like 1/(subjects per site): a smaller consortium needs ``dpneuro budget``.
TUNED_FIELDS = ("space", "parcels", "ica", "pca_epsilon", "pca_subject_bound", "pca_contribution", "ica_epsilon_i",
                "ica_rounds", "clip_G", "clip_h", "plan", "reduction", "optimizer", "calibration", "ica_clip_unit",
                "ica_bias", "ica_unmixing", "cumulant_epsilon")

#: What a consortium of real, fMRIPrep-preprocessed data sets beyond the defaults (``site_templates/fmriprep.toml``;
#: a test checks): a functional atlas as the features, CanICA's 6 mm smoothing and nilearn's standard confound
#: strategy. On real fMRI, 4 x 100 subjects, eps 4, maps agree with CanICA's at 0.65 against 0.51 with coordinate
#: parcels (benchmarks/feature_frontier.py). Not the defaults: the atlas is downloaded once per site and a
#: confounds table is needed, while the defaults run offline on any grid, synthetic data included.
REAL_DATA_SETTINGS = {"atlas": "basc_multiscale_2015:122", "smoothing_fwhm": 6.0, "confounds": "simple"}


class ConfigError(ValueError):
    """A field of the run configuration is missing or invalid (the message names it)."""


@dataclass
class SiteEntry:
    name: str
    path: str  # folder of 4-D NIfTI files (one per subject) or a single file
    files: list[str] = field(default_factory=list)  # explicit file list instead of a folder
    # non-BIDS folders: TSV (columns file, subject) grouping files into subjects; default one file = one subject
    subjects_tsv: str = ""
    # subjects of this site to leave out (e.g. ["sub-07"], a corrupt file); listed in the site's record and report
    exclude: list[str] = field(default_factory=list)


@dataclass
class RunConfig:
    """Everything a consortium run needs; see ``site_templates/run.toml`` for every field commented."""

    sites: list[SiteEntry]
    out: str
    mask: str = ""  # NIfTI mask; empty: the template at ``space``
    space: str = "mni6mm"
    parcels: int = 100  # data-independent parcellation of the mask (0: voxels); not used with an atlas
    # an atlas whose regions are the features instead of coordinate parcels, at any resolution: a label image
    # (3-D NIfTI of integer regions; nearest-neighbour onto the grid) or probabilistic maps (4-D, one volume per
    # map; the features are coordinates on an orthonormal basis of their span); every party needs the same file.
    # Or a name (dpneuro.atlases): "power_2011", "dosenbach_2010", "seitzman_2018" (coordinates shipped with nilearn:
    # spheres on the grid), "schaefer_2018:100", "difumo:64", ... (nilearn downloads once into NILEARN_DATA)
    atlas: str = ""
    # with parcels, each site also refines the components on its own subjects' voxels: maps at the mask's resolution,
    # computed and kept at the site, no privacy spent (benchmarks/site_maps.py)
    site_voxel_maps: bool = True
    # how: "guided_ica" (spatial ICA of the site's own principal subspace, guided by the dual-regression maps) or
    # "dual_regression" (the subjects' regressions on their time courses, averaged). 4 mm networks, 4 x 100, eps 8:
    # mean |r| with the truth 0.87 and 0.73, against 0.47 for the painted parcels
    site_maps_method: str = "guided_ica"
    n_components: int = 20
    reduction: str = "capepca"
    # spatial: the maps users know from CanICA/MELODIC/GIFT (0.73 with CanICA on the same real fMRI, temporal 0.37), and
    # the PCA is its only release (benchmarks/real_frontier.py)
    ica: str = "spatial"
    plan: str = "cape"
    n_colluding: int | None = None
    delta: float = 1e-5  # total delta per site
    # total eps per site in the headline sense (against the aggregator and its colluders): when set, the
    # budget planner chooses pca_epsilon and ica_epsilon_i from the sites' subject counts before the run
    epsilon: float | None = None
    # the one PCA release at (pca_epsilon, delta/2): 6 gives eps 6.9 against the aggregator colluding with one of
    # four sites; on the demo's consortium mean |r| 0.73 with the truth (0.74 without noise)
    pca_epsilon: float = 6.0
    # public bound c on each subject's normalised second moment ||X_m X_m^T / n_m||_F in the PCA: a subject
    # above it is scaled down to it, and the PCA's sensitivity (so its noise) shrinks by c; 1 = no clipping.
    # Real fMRI subjects sit at 0.28-0.35 (122 regions): 0.25 scales nearly all of them, the noise by 1/4 and
    # the signal by ~1/1.2. Subspace contributions have norm 1/sqrt(n_components): the bound only rescales them
    pca_subject_bound: float = 0.25
    # what each subject adds to the PCA's second moment: "subspace" its own top-n_components principal subspace
    # (as CanICA/MELODIC reduce each subject first; norm 1/sqrt(n_components) by construction, every subject
    # weighs the same), "moment" its X X^T / n (the papers'). Real fMRI, 4 sites x 100, 20 components, eps 8:
    # private maps agree with the non-private ones at 0.83 against 0.60 (benchmarks/real_frontier.py).
    # Temporal ICA whitens with variances, which subspace contributions lack: it then also releases the k x k
    # second moment of the data projected on the released basis (one more, small release; the PCA's eps is split
    # between the two). [capeDJICA]'s synthetic set-up end to end (4 x 256 subjects, D = 900), PCA eps 2: qNGI
    # 0.016 from the whitening alone, 0.29-0.36 with "moment" (benchmarks/djica_end_to_end.py).
    # "auto": subspace for spatial and temporal ICA; "moment" with brain states (not measured with subspaces) and
    # PD-SVD (it sums second moments)
    pca_contribution: str = "auto"
    # memory (GB) one site may use for the reduction: capePCA's covariance mode forms D x D matrices (about
    # 9 D^2 doubles, so D <= ~7,700 at 4 GB) and releases one, which must fit a message (256 MB: D <= 5,792;
    # parcels fit, the 6 mm grid's 8,735 voxels do not) and is refused before anything runs when they do not;
    # "capepca-power" and the PCA without noise ("none", then streamed) hold O(D k)
    max_memory_gb: float = 4.0
    # noise of each ICA release (G and h, every round) as (eps_i, delta_i), as in [capeDJICA] Sec. V;
    # totals over all rounds are composed exactly from the ledgers at ``delta``
    ica_epsilon_i: float = 0.7
    ica_delta_i: float = 1e-2
    ica_rounds: int = 40
    # how temporal ICA unmixes: "capedjica" (ica_rounds private gradient rounds at ica_epsilon_i each) or
    # "cumulant" (two releases at cumulant_epsilon together: the whitening refined by the subjects' R x R second
    # moments, then their fourth-order cumulants, separated by the aggregator). [capeDJICA]'s set-up end to end
    # (4 x 256 subjects, D = 900), median qNGI <= 0.1 from a total eps of 3.8 with "cumulant" (0.093; 0.085 at
    # 4.0), from 14.5 with capeDJICA (benchmarks/djica_end_to_end.py)
    ica_unmixing: str = "capedjica"
    # the cumulant unmixing's (eps, delta / 2), split between its two releases (0.1 of mu^2 to the refinement)
    cumulant_epsilon: float = 6.0
    # clipping bound of the ICA gradients; with ica_clip_unit = "subject" it bounds each subject's
    # mean gradient ([capeDJICA] as published: "sample", B = 30, bias on)
    clip_G: float = 0.7
    clip_h: float = 0.7
    ica_clip_unit: str = "subject"
    ica_bias: bool = False
    # power iterations of reduction = "pdsvd" (each one secure sum; no privacy noise)
    pdsvd_iterations: int = 30
    # brain states (capeAGN): K recurring states over the whitened time points, 0 = off; each of its two
    # releases (second and third moments) is calibrated to (states_epsilon, delta/2) on its own. At 4 x 128
    # subjects the planted states come back erratically at every budget: median r 0.62 at 8, 0.32 at 16, 0.72
    # at 32 over 3 noise draws (benchmarks/states_utility.py)
    brain_states: int = 0
    states_epsilon: float = 16.0
    optimizer: str = "fast"
    calibration: str = "analytic"
    standardize: bool = True
    min_volumes: int = 10
    # BIDS filters: keep only the runs whose entities match (keys task, space, session, run, res, desc); in an
    # fMRIPrep tree without a desc filter only desc-preproc runs are read (desc-smoothAROMAnonaggr for ica_aroma)
    bids: dict[str, str] = field(default_factory=dict)
    # -- site-local cleaning, by nilearn, before anything is released (no privacy cost); consortium settings --
    # confound removal: "" (off, the default: the same cleaning at every site whatever files it has, and the
    # synthetic data have no confounds table), a nilearn strategy ("simple", "scrubbing", "compcor",
    # "ica_aroma": load_confounds_strategy on each run's fMRIPrep confounds table; a run without one is refused),
    # or a list of confound column names of that table
    confounds: str | list[str] = ""
    # keyword arguments the strategy takes in nilearn's load_confounds_strategy, e.g. {fd_threshold = 0.3} for
    # scrubbing (others, which nilearn ignores, are refused; "ica_aroma" reads only desc-smoothAROMAnonaggr runs)
    confounds_options: dict[str, Any] = field(default_factory=dict)
    # per run, through nilearn.signal.clean with the run's own TR (header or sidecar RepetitionTime), together
    # with confounds and standardize (then nilearn's zscore_sample); left at their defaults with no confounds,
    # each voxel is only z-scored as before
    detrend: bool = False
    high_pass: float | None = None  # Hz, e.g. 0.01; left out: off
    low_pass: float | None = None  # Hz, e.g. 0.1; left out: off
    # spatial smoothing (mm FWHM) of each run on the analysis grid, nilearn.image.smooth_img; left out: off
    smoothing_fwhm: float | None = None
    # a subject whose files are bad (corrupt gzip, wrong shape, unreadable confounds): "stop" the site, or
    # "skip": leave the subject out with the reason, listed in the site's record and the report
    on_bad_subject: str = "stop"
    # a site's own cluster for its per-subject work (decoding, masking, standardising): Pydra's Dask or SLURM
    # worker, e.g. {worker = "dask", address = "tcp://host:8786"}; empty: threads on this machine. The result is
    # the same either way, so it is a site's own setting, not a consortium one
    cluster: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None  # None: OS entropy (deployments); an int: reproducible simulation
    # a deployed party (dpneuro site / aggregator, COINSTAC) refuses a seed unless this says the run is a test
    simulation: bool = False
    backend: str = "inprocess"
    exchange_dir: str = ""
    # the run's name: its outputs go to <out>/<run_id>/ (a deployed site's to <out>/<run_id>/<site>/), so runs
    # with different ids into the same out keep each their own; a deployed run's folder in exchange_dir too
    run_id: str = DEFAULT_RUN_ID
    truth: str = ""  # optional ground truth (synthetic data): folder with manifest.json
    interactive_maps: bool = False  # embed nilearn's interactive viewer per component in the report (~0.6 MB each)
    timeout: float = 600.0

    # -- derived -------------------------------------------------------------------------
    @classmethod
    def recommended(cls) -> dict[str, Any]:
        """The tuned settings (:data:`TUNED_FIELDS`) at their defaults."""
        return {f: cls.__dataclass_fields__[f].default for f in TUNED_FIELDS}

    @property
    def contribution(self) -> str:
        """The PCA's subject contribution ``pca_contribution`` resolves to."""
        if self.pca_contribution != "auto":
            return self.pca_contribution
        return "moment" if self.brain_states or self.reduction == "pdsvd" else "subspace"

    @property
    def pca_variances(self) -> bool:
        """Whether the PCA also releases variances in its subspace: subspace contributions whose eigenvalues a
        later stage whitens with (temporal ICA, brain states)."""
        return self.contribution == "subspace" and (self.ica == "temporal" or bool(self.brain_states))

    @property
    def cumulant_unmixing(self) -> bool:
        """Whether temporal ICA unmixes by the cumulant ICA (``ica_unmixing``; spatial ICA has no unmixing stage)."""
        return self.ica == "temporal" and self.ica_unmixing == "cumulant"

    def cleaning(self):
        """The site-local cleaning every party applies (:class:`dpneuro.cleaning.Cleaning`)."""
        from .cleaning import Cleaning

        return Cleaning.from_config(self)

    @property
    def run_dir(self) -> Path:
        """Where this run's outputs go: ``<out>/<run_id>``."""
        return Path(self.out) / self.run_id

    @property
    def pca_delta(self) -> float:
        """delta used to calibrate the one PCA release (totals are composed at ``delta``)."""
        return self.delta / 2

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self, *fields: str) -> str:
        import hashlib

        d = self.to_json()
        sel = {k: d[k] for k in fields} if fields else d
        return hashlib.sha1(json.dumps(sel, sort_keys=True, default=str).encode()).hexdigest()[:12]

    #: fields holding a file or folder path (besides the sites' path, files and subjects_tsv)
    PATH_FIELDS = ("out", "mask", "exchange_dir", "truth", "atlas")

    def resolved(self, base: Path | str | None = None) -> RunConfig:
        """A copy with every path absolute: relative ones are taken against ``base`` (default: the working folder).

        Every entry point calls this before anything runs, so that stages that
        run elsewhere (Pydra tasks run in their own cache folders) find the files.
        """
        from dataclasses import replace

        root = Path.cwd() if base is None else Path(base)

        def ab(p: str) -> str:
            return str((root / p).resolve()) if p and not Path(p).is_absolute() else p

        sites = [replace(s, path=ab(s.path), files=[ab(f) for f in s.files], subjects_tsv=ab(s.subjects_tsv))
                 for s in self.sites]
        from .atlases import is_atlas_name

        paths = {f: ab(getattr(self, f)) for f in self.PATH_FIELDS}
        if is_atlas_name(self.atlas):
            paths["atlas"] = self.atlas  # a name nilearn resolves, not a file
        return replace(self, sites=sites, **paths)

    def grid(self):
        """The run's mask (boolean) and affine: the mask file, or the template named by ``space``."""
        if self.mask:
            from .io import load_mask

            return load_mask(self.mask)
        from .io import load_space

        return load_space(self.space)

    def check_deployment(self, party: str) -> RunConfig:
        """Refuse a fixed noise seed in a deployed party unless the configuration says it is a simulation.

        The configuration is shared by every party, so a seed in it lets anyone
        regenerate a site's noise and subtract it from its releases.
        """
        if self.seed is not None and not self.simulation:
            raise ConfigError(
                f"config field 'seed': {party} refuses a fixed noise seed ({self.seed}) in a deployed run: the "
                "seed is in the shared configuration, so anyone could regenerate a site's noise and remove it. "
                "Leave 'seed' out (noise then comes from OS entropy); only a test or simulation may set "
                "simulation = true to keep it")
        if self.epsilon is not None:
            raise ConfigError(
                f"config field 'epsilon': {party} cannot plan a total budget: the split depends on every site's "
                "subject counts, which no single party sees. Plan it once with `dpneuro budget run.toml "
                "--target-epsilon E` (or --sites/--subjects) and write the proposed pca_epsilon and "
                "ica_epsilon_i into the configuration instead")
        return self

    # -- validation ----------------------------------------------------------------------
    def validate(self, *, data_sites: Collection[str] | None = None) -> RunConfig:
        """Check every field; raise :class:`ConfigError` naming the first bad one.

        ``data_sites``: names of the sites whose data must be readable here
        (default: all). One party of a distributed run (``dpneuro site`` /
        ``dpneuro aggregator``) holds at most its own site's data and passes
        ``[its name]`` or ``()``.
        """
        def bad(fieldname: str, why: str):
            raise ConfigError(f"config field {fieldname!r}: {why}")

        if not self.sites:
            bad("sites", "at least one site is needed")
        names = [s.name for s in self.sites]
        if len(set(names)) != len(names):
            bad("sites", f"site names must be unique, got {names}")
        for i, s in enumerate(self.sites):
            if not s.name:
                bad(f"sites[{i}].name", "empty")
            if data_sites is not None and s.name not in data_sites:
                continue  # another party's data: not on this machine
            if not s.files and not s.path:
                bad(f"sites[{i}]", "give 'path' (a folder of NIfTI files) or 'files'")
            for f in s.files or [s.path]:
                if not Path(f).exists():
                    bad(f"sites[{i}] ({s.name})", f"{f} does not exist")
            if s.subjects_tsv and not Path(s.subjects_tsv).is_file():
                bad(f"sites[{i}].subjects_tsv ({s.name})", f"{s.subjects_tsv} does not exist")
        if self.mask and not Path(self.mask).exists():
            bad("mask", f"{self.mask} does not exist")
        if not isinstance(self.atlas, str):
            bad("atlas", f"the path of a label image or an atlas name, got {self.atlas!r}")
        from .atlases import check as check_atlas

        if problem := check_atlas(self.atlas):
            bad("atlas", problem)
        from .io import SPACES

        if not self.mask and self.space not in SPACES:
            bad("space", f"unknown template {self.space!r} ({', '.join(SPACES)}) and no mask given")
        if self.parcels < 0:
            bad("parcels", "must be >= 0")
        from .io import BIDS_FILTERS

        if not isinstance(self.bids, dict) or set(self.bids) - set(BIDS_FILTERS):
            bad("bids", f"a table with keys among {list(BIDS_FILTERS)}, got {self.bids!r}")
        for k, v in self.bids.items():
            if isinstance(v, bool) or not isinstance(v, (str, int)):
                bad(f"bids.{k}", f"a label (text or integer), got {v!r}")
        for i, s in enumerate(self.sites):
            if not isinstance(s.exclude, list) or not all(isinstance(x, str) and x for x in s.exclude):
                bad(f"sites[{i}].exclude ({s.name})", f"a list of subject ids (e.g. [\"sub-07\"]), got {s.exclude!r}")
        from .cleaning import check as check_cleaning
        from .io import ON_BAD_SUBJECT

        for name, why in check_cleaning(self.cleaning()):
            bad(name, why)
        from .cleaning import AROMA_DESC

        if self.cleaning().strategy == "ica_aroma" and str(self.bids.get("desc", AROMA_DESC)) != AROMA_DESC:
            bad("bids.desc", f"confounds = 'ica_aroma' reads the ICA-AROMA denoised runs (desc-{AROMA_DESC}), "
                f"not desc-{self.bids['desc']}; leave desc out or use another strategy")
        if self.on_bad_subject not in ON_BAD_SUBJECT:
            bad("on_bad_subject", f"one of {ON_BAD_SUBJECT}, got {self.on_bad_subject!r}")
        if self.cluster and (self.cleaning().temporal or self.smoothing_fwhm):
            bad("cluster", "a site's cluster decodes runs without cleaning; confounds, detrend, filters and "
                "smoothing run in the site's own process (leave cluster out)")
        self._check_cluster(bad, check_here=data_sites is None or bool(data_sites))
        if self.n_components < 2:
            bad("n_components", "must be >= 2")
        if self.reduction not in REDUCTIONS:
            bad("reduction", f"one of {REDUCTIONS}")
        if isinstance(self.pdsvd_iterations, bool) or not isinstance(self.pdsvd_iterations, int) \
                or self.pdsvd_iterations < 1:
            bad("pdsvd_iterations", f"a positive integer, got {self.pdsvd_iterations!r}")
        if isinstance(self.brain_states, bool) or not isinstance(self.brain_states, int) or self.brain_states < 0:
            bad("brain_states", f"a number of states >= 0 (0: off), got {self.brain_states!r}")
        if self.brain_states == 1:
            bad("brain_states", "one state is the mean of all time points; ask for 2 or more, or 0 for none")
        if self.brain_states and self.brain_states >= self.n_components:
            bad("brain_states", f"{self.brain_states} states need more components: capeAGN's mixture model "
                f"separates fewer states than dimensions (n_components = {self.n_components})")
        if self.brain_states and self.plan != "none" and not (
                isinstance(self.states_epsilon, (int, float)) and not isinstance(self.states_epsilon, bool)
                and self.states_epsilon > 0 and math.isfinite(self.states_epsilon)):
            bad("states_epsilon", f"must be a positive number, got {self.states_epsilon!r}")
        from .algorithms.pca import check_subject_bound

        try:
            check_subject_bound(self.pca_subject_bound)
        except ValueError as exc:
            bad("pca_subject_bound", str(exc))
        if isinstance(self.max_memory_gb, bool) or not isinstance(self.max_memory_gb, (int, float)) \
                or not (0 < self.max_memory_gb < math.inf):
            bad("max_memory_gb", f"a positive number of GB, got {self.max_memory_gb!r}")
        if self.pca_contribution not in PCA_CONTRIBUTIONS:
            bad("pca_contribution", f"one of {PCA_CONTRIBUTIONS}, got {self.pca_contribution!r}")
        elif self.pca_contribution == "subspace" and self.reduction == "pdsvd":
            bad("pca_contribution", "PD-SVD sums the data's second moment; 'subspace' is capePCA's (use 'auto')")
        if self.ica not in ICA_MODELS:
            bad("ica", f"one of {ICA_MODELS}: 'spatial' (independent maps, as CanICA/MELODIC/GIFT; no release "
                "after the PCA) or 'temporal' (capeDJICA)")
        if self.plan not in PLANS:
            bad("plan", f"one of {PLANS}")
        if self.plan == "cape" and len(self.sites) < 3:
            bad("plan", f"CAPE needs at least 3 sites, got {len(self.sites)}; use 'conv'")
        if self.backend not in BACKENDS:
            bad("backend", f"one of {BACKENDS}")
        from .exchange.codec import check_name

        try:
            check_name("run id", self.run_id)
        except ValueError as exc:
            bad("run_id", f"{exc}; it names the run's output folder")
        if self.backend == "directory" and not self.exchange_dir:
            bad("exchange_dir", "the directory backend needs a shared folder")
        if not 0 < self.delta < 1:
            bad("delta", "must be in (0, 1)")
        if self.epsilon is not None:
            if isinstance(self.epsilon, bool) or not (isinstance(self.epsilon, (int, float)) and self.epsilon > 0
                                                       and math.isfinite(self.epsilon)):
                bad("epsilon", f"a finite number > 0 (total per site), or left out, got {self.epsilon!r}")
            if self.plan == "none" or self.reduction in ("none", "pdsvd"):
                bad("epsilon", f"plan {self.plan!r} / reduction {self.reduction!r}: the reduction adds no noise, so "
                    "the run has no differential-privacy budget to plan")
        if self.plan != "none":
            for name in ("pca_epsilon", "ica_epsilon_i"):
                v = getattr(self, name)
                if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                    bad(name, f"must be a positive number, got {v!r}")
            if not 0 < self.ica_delta_i < 1:
                bad("ica_delta_i", "must be in (0, 1)")
            if self.calibration == "classic" and self.ica_epsilon_i >= 1:
                bad("ica_epsilon_i", "the classic Gaussian formula needs eps < 1; use calibration = 'analytic'")
            if self.calibration not in CALIBRATIONS:
                bad("calibration", f"one of {CALIBRATIONS}, got {self.calibration!r}")
            try:
                noise_multiplier(self.ica_epsilon_i, self.ica_delta_i, method=self.calibration)
            except ValueError as exc:
                bad("calibration", str(exc))
        if self.ica_rounds < 1:
            bad("ica_rounds", "must be >= 1")
        if self.ica_unmixing not in UNMIXINGS:
            bad("ica_unmixing", f"one of {UNMIXINGS}, got {self.ica_unmixing!r}")
        elif self.ica_unmixing == "cumulant" and self.plan != "none" and not (
                isinstance(self.cumulant_epsilon, (int, float)) and not isinstance(self.cumulant_epsilon, bool)
                and 0 < self.cumulant_epsilon < math.inf):
            bad("cumulant_epsilon", f"must be a positive number, got {self.cumulant_epsilon!r}")
        if self.ica_clip_unit not in UNITS:
            bad("ica_clip_unit", "'sample' (as published in [capeDJICA]) or 'subject'")
        if not isinstance(self.ica_bias, bool):
            bad("ica_bias", "true or false")
        if not isinstance(self.simulation, bool):
            bad("simulation", "true or false")
        if not isinstance(self.site_voxel_maps, bool):
            bad("site_voxel_maps", "true or false")
        if self.site_maps_method not in SITE_MAPS_METHODS:
            bad("site_maps_method", f"one of {SITE_MAPS_METHODS}, got {self.site_maps_method!r}")
        if not isinstance(self.interactive_maps, bool):
            bad("interactive_maps", "true or false")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", f"an integer (or left out for OS entropy), got {self.seed!r}")
        for name in ("clip_G", "clip_h"):
            if not getattr(self, name) > 0:
                bad(name, "must be > 0")
        from .algorithms.djica import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"one of {tuple(OPTIMIZERS)}")
        if self.truth and not (Path(self.truth) / "manifest.json").exists():
            bad("truth", f"{self.truth} has no manifest.json")
        return self

    def _check_cluster(self, bad, *, check_here: bool) -> None:
        c = self.cluster
        if not isinstance(c, dict) or set(c) - set(CLUSTER_KEYS):
            bad("cluster", f"a table with keys among {list(CLUSTER_KEYS)} (or empty: threads on this machine), "
                f"got {c!r}")
        if not c:
            return
        worker = c.get("worker")
        if worker not in CLUSTER_WORKERS:
            bad("cluster.worker", f"one of {CLUSTER_WORKERS}, got {worker!r}")
        n = c.get("subjects_per_task", SUBJECTS_PER_TASK)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            bad("cluster.subjects_per_task", f"a positive integer, got {n!r}")
        for key, owner in (("address", "dask"), ("sbatch_args", "slurm")):
            if key in c and (not isinstance(c[key], str) or worker != owner):
                bad(f"cluster.{key}", f"text, and only for worker = {owner!r}, got {c[key]!r}")
        if worker == "dask" and not c.get("address"):
            bad("cluster.address", "the Dask worker needs the address of the site's scheduler, e.g. "
                "'tcp://10.0.0.5:8786' (dask scheduler, or dask-jobqueue on a batch system)")
        if not check_here:  # a party without data here (the aggregator) runs no per-subject work
            return
        import importlib.util
        import shutil

        if worker == "dask" and importlib.util.find_spec("distributed") is None:
            bad("cluster.worker", "the Dask worker needs dask.distributed on this machine: "
                "pip install 'dpneuro[cluster]'")
        if worker == "slurm" and shutil.which("sbatch") is None:
            bad("cluster.worker", "the SLURM worker submits with sbatch, which is not on this machine's PATH; run "
                "from a SLURM login node, or leave cluster out to decode in threads here")

    @classmethod
    def from_dict(cls, d: dict[str, Any], base: Path | None = None) -> RunConfig:
        d = dict(d)
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config field(s) {sorted(unknown)}; known: {sorted(known)}")
        if "sites" not in d:
            raise ConfigError("config field 'sites': missing")
        if "out" not in d:
            raise ConfigError("config field 'out': missing")

        def rel(p: str) -> str:
            return str((base / p).resolve()) if base is not None and p and not Path(p).is_absolute() else p

        sites = []
        for i, s in enumerate(d.pop("sites")):
            if not isinstance(s, dict):
                raise ConfigError(f"config field 'sites[{i}]': must be a table with name and path")
            extra = set(s) - {"name", "path", "files", "subjects_tsv", "exclude"}
            if extra:
                raise ConfigError(f"config field 'sites[{i}]': unknown keys {sorted(extra)}")
            sites.append(SiteEntry(name=str(s.get("name", "")), path=rel(str(s.get("path", ""))),
                                   files=[rel(str(f)) for f in s.get("files", [])],
                                   subjects_tsv=rel(str(s.get("subjects_tsv", ""))),
                                   exclude=s.get("exclude", [])))
        from .atlases import is_atlas_name

        for key in cls.PATH_FIELDS:
            if d.get(key) and not (key == "atlas" and is_atlas_name(d[key])):  # a name is not a file
                d[key] = rel(str(d[key]))
        for key, typ in (("parcels", int), ("n_components", int), ("ica_rounds", int), ("min_volumes", int),
                         ("pdsvd_iterations", int), ("brain_states", int)):
            if key in d and (not isinstance(d[key], int) or isinstance(d[key], bool)):
                raise ConfigError(f"config field {key!r}: must be an integer, got {d[key]!r}")
        try:
            return cls(sites=sites, **d)
        except TypeError as exc:
            raise ConfigError(f"config: {exc}") from exc

    @classmethod
    def read(cls, path) -> RunConfig:
        """Parse a TOML config (paths relative to its folder) without validating the inputs."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        try:
            d = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from exc
        return cls.from_dict(d, base=path.parent)

    @classmethod
    def load(cls, path) -> RunConfig:
        """Parse and validate a TOML config and every input it names."""
        return cls.read(path).validate()
