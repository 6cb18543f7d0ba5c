"""The run configuration's schema: every setting declared once, validated as a whole before anything runs."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tomllib
from collections.abc import Collection
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from dpneuro._utils.errors import ConfigError
from dpneuro.algorithms.dfnc import METHODS as STATE_METHODS
from dpneuro.algorithms.dfnc import METRICS as STATE_METRICS
from dpneuro.algorithms.djica import OPTIMIZERS
from dpneuro.algorithms.glm import MEASURES as GLM_MEASURES
from dpneuro.algorithms.glm import kind, normal_hypothesis, parse_design
from dpneuro.config.constraints import (
    Boolean,
    Constraint,
    Excluding,
    Interval,
    Label,
    OrNone,
    StrOptions,
    Table,
    Text,
    TextList,
)
from dpneuro.data.atlases import check as check_atlas
from dpneuro.data.atlases import is_atlas_name
from dpneuro.data.cleaning import AROMA_DESC, Cleaning
from dpneuro.data.cleaning import check as check_cleaning
from dpneuro.data.discovery import BIDS_FILTERS
from dpneuro.data.images import SPACES, load_mask, load_space
from dpneuro.data.load import ON_BAD_SUBJECT
from dpneuro.privacy import CALIBRATIONS, noise_multiplier
from dpneuro.privacy.cape_delta import check_collusion
from dpneuro.privacy.ledger import UNITS
from dpneuro.protocol.cape.plans import PLAN_KINDS as PLANS
from dpneuro.protocol.exchange.codec import check_name

#: what a run can be for (config field ``question``), and the largest share of mu^2 of a total epsilon each gives a
#: stage (the other stages share the rest in the ratio of their own settings; "maps": every stage keeps its share).
#: The planner lowers a share until the maps keep at least half the components they support alone
#: (:func:`dpneuro.run.planner.plan_for_target`); benchmarks/group_findings.py measures what it buys
QUESTIONS: dict[str, dict[str, float]] = {"maps": {}, "fnc": {"fnc": 1 / 3}, "group differences": {"glm": 0.75}}

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
#: what a subject adds to the PCA's second moment ("auto": subspace, moment with PD-SVD)
PCA_CONTRIBUTIONS = ("auto", "subspace", "moment")
#: how a site makes its own voxel maps (``dpneuro.run.site_maps``)
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


#: The tuned analysis settings (the field defaults below): chosen on :data:`SYNTHETIC_CONSORTIUM` by
#: ``benchmarks/demo_speed.py`` (its figures: ``benchmarks/README.md``); the demo and ``site_templates/run.toml``
#: use them (a test checks). Subject-level noise scales like 1/(subjects per site): a smaller consortium needs
#: ``dpneuro budget``.
TUNED_FIELDS = ("space", "parcels", "ica", "pca_epsilon", "pca_subject_bound", "pca_contribution", "ica_epsilon_i",
                "ica_rounds", "clip_G", "clip_h", "plan", "reduction", "optimizer", "calibration", "ica_clip_unit",
                "ica_bias", "ica_unmixing", "cumulant_epsilon")

#: What a consortium of real, fMRIPrep-preprocessed data sets beyond the defaults (``site_templates/fmriprep.toml``;
#: a test checks): the shipped functional atlas with coordinate parcels of the voxels it leaves out, CanICA's 6 mm
#: smoothing and nilearn's standard confound strategy; ``benchmarks/feature_frontier.py`` measures them
#: (``benchmarks/README.md``). Not the defaults: the atlas's 250 features beat the 100 coordinate parcels only
#: from about eps 4 and 100 subjects per site, and the confounds need fMRIPrep's tables.
REAL_DATA_SETTINGS = {"atlas": "schaefer_2018:200", "atlas_fill": 50, "smoothing_fwhm": 6.0, "confounds": "simple"}


@dataclass
class SiteEntry:
    name: str
    path: str  # folder of 4-D NIfTI files (one per subject) or a single file
    files: list[str] = field(default_factory=list)  # explicit file list instead of a folder
    # non-BIDS folders: TSV (columns file, subject) grouping files into subjects; default one file = one subject
    subjects_tsv: str = ""
    # subjects of this site to leave out (e.g. ["sub-07"], a corrupt file); listed in the site's record and report
    exclude: list[str] = field(default_factory=list)
    # the subjects' covariates for group statistics (TSV, participant_id first); default: participants.tsv at path
    participants: str = ""


class Sites(Constraint):
    """The [[sites]] tables: at least one (each checked by validate(): names, paths)."""

    def accepts(self, value) -> bool:
        return isinstance(value, list) and len(value) > 0 and all(isinstance(s, SiteEntry) for s in value)

    def describe(self) -> str:
        return "at least one [[sites]] table (name and path)"


#: the pipeline stages whose outputs a field changes (``stages`` of its metadata)
STAGES = ("space", "load", "reduce", "unmix", "fnc", "states", "glm", "maps")
#: run.toml's sections, in order (``section`` of a field's metadata)
SECTIONS = ("run and outputs", "data grid", "data preparation",
            "site-local cleaning (nilearn; before anything is released, no privacy cost)", "analysis",
            "connectivity", "brain states", "group statistics", "privacy", "sites")

#: before the subject counts are known delta must be below this: delta >= 1/N is no privacy for a site of N
#: subjects (each subject may be released whole with probability delta), and 0.1 already fails every site of
#: 10 or more; once the counts are known the run applies delta < 1/N itself (:func:`check_delta`)
DELTA_BOUND = 0.1


def check_delta(delta: float, n_subjects: int) -> None:
    """Refuse ``delta`` >= 1/N for the smallest site's N subjects (the meaningful bound, once N is known)."""
    if not delta < 1 / n_subjects:
        raise ConfigError(f"config field 'delta': {delta:g} is no privacy for a site of {n_subjects} subjects: "
                          f"delta must be below 1/N = {1 / n_subjects:.3g} for the smallest site's N subjects "
                          "(the usual choice is far below, e.g. 1e-5)")


def check_colluding(plan: str, n_colluding: int | None, n_sites: int) -> None:
    """Refuse a collusion assumption CAPE's theorem does not cover: more than ceil(S/3) - 1 of ``n_sites``, or
    fewer than 0 (the rule and its reason: :func:`dpneuro.privacy.cape_delta.check_collusion`)."""
    if plan != "cape" or n_colluding is None or n_sites < 3:  # fewer sites: the 'plan' field is refused
        return
    try:
        check_collusion(n_sites, n_colluding)
    except ValueError as exc:
        raise ConfigError(f"config field 'n_colluding': {exc}; leave n_colluding out for the most CAPE "
                          "allows") from None


def setting(default=MISSING, *, doc: str, constraint: Constraint, section: str, agree: bool = False,
            stages: tuple[str, ...] = (), example: tuple[str, ...] = (), template: str | None = None,
            estimator: str | None = None, flag: str | None = None, factory=MISSING):
    """A RunConfig field with its one description (the dataclass field's metadata).

    ``doc``: what it means (its first sentence is the summary ``--help`` shows); ``agree``: every party of a
    run must use the same value (the run manifest checks it); ``stages``: the pipeline stages it changes;
    ``example``: TOML values the template shows commented out, ``template``: the value it sets when not the
    default; ``estimator``: its name as an estimator
    parameter when not the field's own; ``flag``: the ``dpneuro budget`` option overriding it.
    """
    if section not in SECTIONS or set(stages) - set(STAGES):
        raise ValueError(f"section {section!r} / stages {stages!r}")
    meta = {"doc": doc, "constraint": constraint, "agree": agree, "stages": tuple(stages), "section": section,
            "example": tuple(example)}
    if template is not None:
        meta["template"] = template
    if estimator is not None:
        meta["estimator"] = estimator
    if flag is not None:
        meta["flag"] = flag
    return field(default=default, default_factory=factory, metadata=meta)




def _design_problem(design: str) -> str | None:
    terms = [t.strip() for t in design.split("+")]
    if design.strip() and not all(t.isidentifier() for t in terms):
        return f"{design!r} is not covariate names joined by + (e.g. \"group + age + sex\")"
    return None


class _CovariateSpec(Constraint):
    """A design term's public description: its levels, or its range [low, high]."""

    def accepts(self, value) -> bool:
        return isinstance(value, list) and len(value) >= 2 and (
            all(isinstance(v, str) for v in value)
            or (len(value) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)))

    def describe(self) -> str:
        return "a list of level names, or a range [low, high]"


def _run_id_problem(run_id: str) -> str | None:
    try:
        check_name("run id", run_id)
    except ValueError as exc:
        return f"{exc}; it names the run's output folder"
    return None


@dataclass
class RunConfig:
    """Everything a consortium run needs: each field's type, range and meaning are its metadata
    (``docs/api.md`` and ``site_templates/run.toml`` are generated from them: ``python -m dpneuro.config``)."""

    sites: list[SiteEntry] = setting(
        section="sites", constraint=Sites(), stages=("load",),
        doc="One [[sites]] table per site, in the agreed order (it fixes the protocol's site ids). `name`: unique; "
            "`path`: a BIDS folder (sub-*/[ses-*/]func/*_bold.nii[.gz]; anat/ and other files are skipped and "
            "listed), a folder of 4-D NIfTI files (files named sub-<label>_... belong to subject sub-<label>, any "
            "other file is one subject), or `files` = [...] instead. A non-BIDS folder whose files are several runs "
            "of one person needs `subjects_tsv = \"subjects.tsv\"` (columns file, subject). `exclude` = [...]: "
            "subjects of that site to leave out (listed in its record and the report). `participants`: the subjects' "
            "covariates for group statistics (a TSV whose first column is participant_id; default: participants.tsv "
            "in the site's folder). In a deployed run each site "
            "needs only its own path; the others may stay empty (path = \"\").")
    out: str = setting(
        section="run and outputs", constraint=Text("a folder"), template='"run"',
        doc="Output folder. `dpneuro run` and `dpneuro aggregator` write components.nii.gz, privacy.json and "
            "report.html to <out>/<run_id>/; a site writes its own outputs to <out>/<run_id>/<name>/. Private "
            "working files go to <out>/work (`dpneuro run`'s cache of stages, shared by its runs) or "
            "<out>/.dpneuro/<run_id>/ (a deployed party's).")
    mask: str = setting(
        "", section="data grid", constraint=Text("the path of a NIfTI mask, or empty"), stages=("space",),
        doc="Consortium-wide brain mask (NIfTI); empty: the template named by `space`. Every subject image must be "
            "on the mask's grid (same shape and affine).")
    space: str = setting(
        "mni6mm", section="data grid", constraint=Text("a template name"), stages=("space",),
        doc="Template grid when no mask is given: \"mni3mm\" (69,765 voxels), \"mni4mm\" (29,398), \"mni6mm\" "
            "(8,735) or \"grid30\" (the papers' 30 x 30 simulation grid, 900 voxels).")
    parcels: int = setting(
        100, section="data grid", constraint=Interval(Integral, 0, None), stages=("space",), agree=True,
        doc="Data-independent parcellation of the mask into this many parcels (k-means on voxel coordinates, never "
            "on data; 0: keep voxels). Fewer features mean less noise per entry and smaller messages; maps are "
            "painted back to voxels. Not used with an atlas.")
    atlas: str = setting(
        "", section="data grid", constraint=Text("the path of an atlas image or an atlas name"), stages=("space",),
        example=('"atlas/MIST_122.nii.gz"', '"dosenbach_2010"', '"schaefer_2018:100"'),
        doc="An atlas whose regions are the features instead of the coordinate parcels, in MNI space at any "
            "resolution (every party needs the same one; the run manifest checks its regions on the grid). A label "
            "image (3-D, integer regions, nearest neighbour onto the grid) weighs each region as its voxels weigh "
            "(sum over sqrt(voxels)); probabilistic maps (4-D, e.g. DiFuMo) give the coordinates on an orthonormal "
            "basis of their span. Or a name (dpneuro.data.atlases): \"schaefer_2018:200\" (the Schaefer 2018 "
            "atlas of 200 cortical parcels in 7 networks, shipped with dpneuro under its authors' MIT licence: no "
            "download), \"power_2011\", \"dosenbach_2010\", "
            "\"seitzman_2018\" (MNI coordinates shipped with nilearn, no download: a 5 mm sphere of labels around "
            "each; \"power_2011:8mm\" for another radius), or one nilearn downloads once into its data folder "
            "(NILEARN_DATA, default ~/nilearn_data): \"schaefer_2018:100\", \"difumo:64\", "
            "\"basc_multiscale_2015:122\", \"msdl\", \"harvard_oxford:cort-maxprob-thr25-2mm\", "
            "\"smith_2009:rsn20\", \"allen_rsn_2011\". A site without internet fetches it elsewhere "
            "(`python -m dpneuro.data.atlases NAME`) and copies that folder, or gives the file's path. The maps come "
            "back at voxel resolution.")
    atlas_fill: int = setting(
        0, section="data grid", constraint=Interval(Integral, 0, None), stages=("space",), agree=True,
        doc="With a label atlas: the mask voxels no region covers (the cerebellum and subcortex for a cortical "
            "atlas such as Schaefer's) become this many coordinate parcels of their own (k-means on their "
            "coordinates), weighed as the atlas's regions; 0: they are left out of the features and the maps.")
    site_voxel_maps: bool = setting(
        True, section="data grid", constraint=Boolean(), stages=("maps",),
        doc="With parcels, each site also writes its own maps at the mask's voxel resolution. They are computed at "
            "the site from its own data, never sent, and spend no privacy (site_maps.nii.gz in the site's outputs).")
    site_maps_method: str = setting(
        "guided_ica", section="data grid", constraint=StrOptions(SITE_MAPS_METHODS), stages=("maps",),
        doc="How a site makes its own voxel maps: \"guided_ica\" runs the spatial ICA on the site's own principal "
            "subspace over voxels, started from the components' dual-regression maps and paired with them one to "
            "one (as GIFT's GIG-ICA); \"dual_regression\" keeps its subjects' voxels regressed on their time "
            "courses, averaged. Their agreement with the truth is measured in benchmarks/README.md.")
    n_components: int = setting(
        20, section="analysis", constraint=Interval(Integral, 2, None), stages=("reduce",), agree=True,
        flag="components",
        doc="Number of independent components R, also the PCA dimension k. 20 is the usual choice for "
            "resting-state networks; the synthetic consortium of `dpneuro synth` has 8 networks (the demo uses 8). "
            "At most the number of features D (parcels, atlas regions or voxels).")
    reduction: str = setting(
        "capepca", section="analysis", constraint=StrOptions(REDUCTIONS), stages=("reduce",), agree=True,
        flag="reduction",
        doc="Dimension reduction: \"capepca\", \"capepca-power\", \"none\" or \"pdsvd\". \"capepca\": one noisy "
            "D x D release per site; \"capepca-power\": noisy subspace iteration, D x k releases; \"none\": "
            "non-private PCA, only for simulations; \"pdsvd\" (PD-SVD: "
            "secure sums that hide the iterations' singular values, NO differential privacy: the report says what "
            "it reveals and to whom).")
    ica: str = setting(
        "spatial", section="analysis", constraint=StrOptions(ICA_MODELS), stages=("reduce", "unmix"), agree=True,
        flag="ica",
        doc="Group ICA model: \"spatial\" or \"temporal\". \"spatial\": independent maps, the model of CanICA, "
            "MELODIC and GIFT: FastICA on the released PCA basis, which is post-processing (the PCA is the only "
            "release; the ICA settings are unused); each site fits its own time courses on the maps, locally. "
            "\"temporal\": independent time courses (capeDJICA; every round is a private release of its own).")
    plan: str = setting(
        "cape", section="privacy", constraint=StrOptions(PLANS),
        stages=("reduce", "unmix", "fnc", "states", "glm", "maps"),
        agree=True, flag="plan",
        doc="Noise plan: \"cape\", \"conv\" or \"none\". \"cape\": correlated noise, each site's release carries the "
            "noise its own budget needs and the average carries the pooled-data noise (needs >= 3 sites); "
            "\"conv\": independent noise at every site; \"none\": NOT private.")
    n_colluding: int | None = setting(
        None, section="privacy", constraint=OrNone(Interval(Integral, 0, None), "ceil(S/3) - 1"),
        stages=("reduce", "unmix", "fnc", "states", "glm", "maps"), agree=True, flag="n-colluding", example=("1",),
        doc="How many sites may collude with the aggregator. Left out: ceil(S/3) - 1 for S sites, the most CAPE "
            "allows; larger values are refused.")
    delta: float = setting(
        1e-5, section="privacy", constraint=Interval(Real, 0, DELTA_BOUND, closed="neither",
                                                     why="delta >= 1/N is no privacy for a site of N subjects"),
        stages=("reduce", "fnc", "states", "glm", "maps"), agree=True, flag="delta",
        doc="Total delta per site: the delta at which every site's total epsilon is reported (half of it "
            "calibrates the PCA release). It must be below 1/N for the smallest site's N subjects: the "
            "configuration refuses 0.1 and above, the run refuses 1/N and above once it knows the counts.")
    epsilon: float | None = setting(
        None, section="privacy", constraint=OrNone(Interval(Real, 0, None, closed="neither"),
                                                   "the per-release settings are used as they are"),
        agree=True, example=("8.0",),
        doc="Total epsilon per site in the headline sense, against the aggregator and its colluders. When set, "
            "the run plans the per-stage settings (pca_epsilon, ica_epsilon_i, cumulant_epsilon, fnc_epsilon, "
            "states_epsilon, glm_epsilon) "
            "from the sites' subject counts (as `dpneuro budget --target-epsilon` does) and those fields are "
            "ignored. A deployed run first exchanges every site's public counts (subjects and their time points); "
            "every party then plans the same split, and each site refuses one that would spend more than this.")
    allow_noise_maps: bool = setting(
        False, section="privacy", constraint=Boolean(), agree=True, flag="allow-noise-maps",
        doc="A run whose planned noise (from `epsilon` and the sites' counts) exceeds even the largest eigenvalue "
            "of typical fMRI would give noise maps only: it stops before anything is released and says the "
            "subjects per site or the epsilon it would take. true runs it anyway (for tests and teaching; every "
            "output then marks its components as noise).")
    question: str = setting(
        "maps", section="privacy", constraint=StrOptions(QUESTIONS), agree=True, flag="question",
        doc="What the run is for, which decides how a total `epsilon` is split: \"maps\" (the default: each "
            "stage keeps its share under its own settings, the maps first), \"fnc\" (the consortium's mean FNC "
            "gets up to a third of the budget), \"group differences\" (the group statistics get up "
            "to three quarters; needs a design); a share is lowered until the maps keep at least half the "
            "components they would support alone. `dpneuro budget` says what each output gets, what the maps lose "
            "and, with a design, the smallest effect found with 80 % power.")
    pca_epsilon: float = setting(
        6.0, section="privacy", constraint=Interval(Real, 0, None, closed="neither"), stages=("reduce",),
        agree=True, flag="pca-epsilon",
        doc="Privacy budget of the one capePCA release (at delta / 2). With spatial ICA it is the whole run's "
            "budget; `dpneuro budget` prints the total per site. With ica = \"temporal\", plan a total budget "
            "(`epsilon`) instead.")
    pca_subject_bound: float = setting(
        0.25, section="privacy", constraint=Interval(Real, 0, 1, closed="right"), stages=("reduce",), agree=True,
        flag="subject-bound",
        doc="Public bound c in (0, 1] on each subject's normalised second moment ||X_m X_m^T / n_m||_F in the PCA. "
            "A subject above c is scaled down to it, and the PCA's noise shrinks by the factor c; 1 = no clipping "
            "(time points have unit norm, so the moment is at most 1). Subspace contributions have their norm "
            "1/sqrt(n_components) by construction: for them the bound changes only the scale.")
    pca_contribution: str = setting(
        "auto", section="privacy", constraint=StrOptions(PCA_CONTRIBUTIONS), stages=("reduce",), agree=True,
        flag="contribution",
        doc="What each subject adds to the PCA's second moment. \"subspace\": the projector on its own top "
            "n_components principal directions (as CanICA and MELODIC reduce each subject first), so every subject "
            "weighs the same; \"moment\": its normalised second moment X X^T / n (the papers'). Temporal ICA "
            "whitens with variances, which subspaces do not carry: with \"subspace\" the PCA then adds one small "
            "release (the n_components x n_components second moment in the released basis; the PCA's epsilon is "
            "split between the two). \"auto\": subspace, except with PD-SVD (\"moment\").")
    max_memory_gb: float = setting(
        4.0, section="privacy", constraint=Interval(Real, 0, None, closed="neither"), stages=("reduce",),
        agree=True,
        doc="Memory (GB) one site may use for the reduction. capePCA's covariance mode forms D x D matrices (about "
            "9 D^2 doubles) and releases one, which must fit a message (256 MB: D <= 5,792; 10 MB on COINSTAC): "
            "parcels fit, voxels do not. It is refused before anything runs when they do not fit; reduction = "
            "\"capepca-power\" and \"none\" need O(D k).")
    ica_epsilon_i: float = setting(
        0.7, section="privacy", constraint=Interval(Real, 0, None, closed="neither"), stages=("unmix",),
        agree=True, flag="ica-epsilon-i",
        doc="Epsilon of each single ICA release (G and h, every round). As in [capeDJICA] Sec. V; the totals over "
            "all rounds are composed exactly from the ledgers at `delta`.")
    ica_delta_i: float = setting(
        1e-2, section="privacy", constraint=Interval(Real, 0, 1, closed="neither"), stages=("unmix",), agree=True,
        flag="ica-delta-i",
        doc="Delta of each single ICA release, with ica_epsilon_i. It sets the release's noise only: the totals "
            "are reported at `delta`.")
    ica_rounds: int = setting(
        40, section="analysis", constraint=Interval(Integral, 1, None), stages=("unmix",), agree=True,
        flag="rounds",
        doc="capeDJICA round limit J. Each round every site releases one noisy gradient G (R x R) and one bias "
            "gradient h (R); the ledger composes all of them.")
    ica_unmixing: str = setting(
        "capedjica", section="analysis", constraint=StrOptions(UNMIXINGS), stages=("unmix",), agree=True,
        flag="unmixing",
        doc="How temporal ICA unmixes (with ica = \"temporal\"). \"capedjica\": ica_rounds private gradient rounds; "
            "\"cumulant\": two releases at cumulant_epsilon together (the subjects' second moments of the whitened "
            "data refine the whitening, then their fourth-order cumulants, which the aggregator separates). Their "
            "accuracy per budget is measured in benchmarks/README.md.")
    cumulant_epsilon: float = setting(
        6.0, section="analysis", constraint=Interval(Real, 0, None, closed="neither"), stages=("unmix",),
        agree=True, flag="cumulant-epsilon",
        doc="Privacy budget of the cumulant unmixing's two releases together (at delta / 2). A tenth of its mu^2 "
            "goes to the refined whitening.")
    clip_G: float = setting(
        0.7, section="analysis", constraint=Interval(Real, 0, None, closed="neither"), stages=("unmix",),
        agree=True, flag="clip",
        doc="Clipping bound B_G of the ICA gradients G. It sets the sensitivity of each release: 2 B / M_s for M_s "
            "subjects at the site.")
    clip_h: float = setting(
        0.7, section="analysis", constraint=Interval(Real, 0, None, closed="neither"), stages=("unmix",),
        agree=True, flag="clip",
        doc="Clipping bound B_h of the ICA bias gradients h. It sets the sensitivity of each release: 2 B / M_s "
            "for M_s subjects at the site.")
    ica_clip_unit: str = setting(
        "subject", section="analysis", constraint=StrOptions(UNITS), stages=("unmix",), agree=True,
        flag="clip-unit",
        doc="What the ICA clips: \"subject\" or \"sample\". \"subject\": each subject's mean gradient (the same "
            "sensitivity with a bound about 10x smaller, so less noise); \"sample\": every time point's gradient, "
            "as published in [capeDJICA] (use a clip of 30 then).")
    ica_bias: bool = setting(
        False, section="analysis", constraint=Boolean(), stages=("unmix",), agree=True, flag="ica-bias",
        doc="Release the bias gradient h every round too (as in [capeDJICA]). Whitened data are centred, so false "
            "halves the releases per round.")
    pdsvd_iterations: int = setting(
        30, section="analysis", constraint=Interval(Integral, 1, None), stages=("reduce",), agree=True,
        doc="Power iterations of reduction = \"pdsvd\". Each one is a secure sum; PD-SVD adds no privacy noise.")
    fnc: bool = setting(
        True, section="connectivity", constraint=Boolean(), stages=("fnc",), agree=True, flag="fnc",
        doc="Static functional network connectivity (FNC), as GIFT and COINSTAC's group ICA report it: each site "
            "computes every subject's correlation between the component time courses (Fisher z), bounds each "
            "subject's and releases their mean through CAPE; the consortium's mean is fnc.tsv and the report's "
            "matrix, and each subject's own stays at its site (fnc_subjects.tsv). false: no FNC and no release.")
    fnc_epsilon: float = setting(
        2.0, section="connectivity", constraint=Interval(Real, 0, None, closed="neither"), stages=("fnc",),
        agree=True, flag="fnc-epsilon",
        doc="Privacy budget of the FNC release per site (against the aggregator and its colluders, at delta / 2); "
            "the run's total composes every stage, and a total `epsilon` is split over the stages in the ratio of "
            "their settings.")
    brain_states: int = setting(
        0, section="brain states", stages=("states",), agree=True, flag="brain-states",
        constraint=Excluding(Interval(Integral, 0, None), 1, "one state is the mean of all windows; 0: off"),
        doc="Brain states: K dynamic functional network connectivity (dFNC) states, as GIFT's dFNC computes them, "
            "0 = off. Each site cuts its subjects' component time courses into tapered windows "
            "(states_window, states_step) and computes each window's connectivity between components; the "
            "consortium clusters the windows from private releases (states_method). Written: the K state "
            "connectivity matrices, the consortium's occupancy and, at each site, its subjects' fraction of time, "
            "dwell times and transitions. Needs 2 <= K <= n_components (n_components - 1) / 2.")
    states_epsilon: float = setting(
        4.0, section="brain states", constraint=Interval(Real, 0, None, closed="neither"), stages=("states",),
        agree=True, flag="states-epsilon",
        doc="Privacy budget of the whole brain-states stage per site (every release of it composed, against the "
            "aggregator and its colluders, at delta / 2); the run's total composes every stage.")
    states_method: str = setting(
        "kmeans", section="brain states", constraint=StrOptions(STATE_METHODS), stages=("states",), agree=True,
        flag="states-method",
        doc="How the consortium clusters the windows: \"kmeans\" (the CAPE k-means: the mean window, rounds of "
            "clipped per-state sums and counts, the occupancy) or \"agn\" (capeAGN's one-shot moments of the "
            "windows). Measured in benchmarks/README.md (\"dFNC states\").")
    states_window: int = setting(
        22, section="brain states", constraint=Interval(Integral, 3, None), stages=("states",), agree=True,
        flag="states-window",
        doc="Window length in volumes (GIFT: 22 TRs, a rectangle convolved with a Gaussian of 3 TRs). Every "
            "subject needs at least this many volumes.")
    states_step: int = setting(
        1, section="brain states", constraint=Interval(Integral, 1, None), stages=("states",), agree=True,
        flag="states-step", doc="Volumes between the starts of two windows (GIFT: 1).")
    states_metric: str = setting(
        "correlation", section="brain states", constraint=StrOptions(STATE_METRICS), stages=("states",),
        agree=True, flag="states-metric",
        doc="How a subject's windows are assigned to the consortium's states for its statistics and the released "
            "occupancy: \"correlation\", \"cityblock\" (GIFT's) or \"euclidean\". The k-means rounds themselves "
            "assign by distance less each state's public noise energy.")
    design: str = setting(
        "", section="group statistics", constraint=Text("a design such as \"group + age + sex\"", _design_problem),
        stages=("glm",), agree=True, example=('"group + age + sex"',),
        doc="Private group statistics: the covariates of the consortium's linear model, joined by + (\"\": off). "
            "Each site reads its subjects' values from its participants table (the BIDS participants.tsv at its "
            "root, or its site entry's participants) and adds the site itself as a covariate; every measure of "
            "glm_measures gets the model, fitted from sufficient statistics each site releases through CAPE. "
            "Written: group_effects.tsv (each contrast's estimate, interval, p and FDR q per measure, with the "
            "noise each carries) and the report's section. Each term needs its entry in covariates.")
    covariates: dict[str, Any] = setting(
        section="group statistics", constraint=Table(values=_CovariateSpec()), stages=("glm",), agree=True,
        factory=dict, example=('{ group = ["control", "patient"], age = [18, 80], sex = ["F", "M"] }',),
        doc="What every design term is, agreed by the consortium: a list of levels (categorical; the first is the "
            "reference each other level is compared with) or [low, high] (continuous: its public range, which "
            "bounds a subject's contribution; values outside are clipped to it and counted at the site).")
    glm_measures: list[str] = setting(
        section="group statistics", constraint=TextList(), stages=("glm",), agree=True,
        factory=lambda: ["fnc", "amplitude"], flag="glm-measures",
        doc="What is compared per subject: \"fnc\" (each static FNC edge, Fisher z, centred on the consortium's "
            "mean FNC when the run has the FNC stage) and \"amplitude\" (each component's time-course standard "
            "deviation over the RMS of the subject's components, log) and, with brain_states, \"states\" (each "
            "state's fraction of time, its mean dwell as a fraction of the subject's windows, the transitions per "
            "window) and \"networks\" (the FNC between two atlas networks: the mean of the edges between their "
            "components, and within a network of two or more; the networks are the components' names, which every "
            "party computes from the released maps). Every measure shares the release's bound, so fewer measures "
            "give tighter intervals: \"networks\" instead of \"fnc\" at 20 components tests about 30 measures "
            "instead of 190.")
    glm_hypotheses: list[str] = setting(
        section="group statistics", constraint=TextList(), stages=("glm",), agree=True, factory=list,
        example=('["networks Vis-Default", "networks SalVentAttn-Cont"]',),
        doc="The measures the consortium tests, named before the run: \"networks A-B\" by the atlas's network "
            "abbreviations (Vis, SomMot, DorsAttn, SalVentAttn, Limbic, Cont, Default, Subcortical, Cerebellum), "
            "\"fnc IC01-IC02\", \"amplitude IC03\", \"occupancy S1\". Only these are released, each with a bound "
            "of its own, so each interval is as tight as a single measure's; the FDR runs over them. A network "
            "pair the run has no components for is reported as not measured. Empty (the default): every measure "
            "of glm_measures.")
    glm_epsilon: float = setting(
        2.0, section="group statistics", constraint=Interval(Real, 0, None, closed="neither"), stages=("glm",),
        agree=True, flag="glm-epsilon",
        doc="Privacy budget of the group-statistics release per site (against the aggregator and its colluders, "
            "at delta / 2); the run's total composes every stage.")
    optimizer: str = setting(
        "fast", section="analysis", constraint=StrOptions(OPTIMIZERS), stages=("unmix",), agree=True,
        doc="ICA learning-rate rules: \"fast\" or \"paper\". \"fast\": momentum, noise-proof annealing, averaging; "
            "\"paper\": the reference djICA rules of Baker et al. / [capeDJICA] Sec. V.")
    calibration: str = setting(
        "analytic", section="privacy", constraint=StrOptions(CALIBRATIONS), stages=("unmix",), agree=True,
        flag="calibration",
        doc="Gaussian calibration of the noise: \"analytic\" or \"classic\". \"analytic\": Balle & Wang 2018, any "
            "epsilon; \"classic\": sigma = Delta "
            "sqrt(2 ln(1.25/delta)) / eps, valid for eps < 1.")
    standardize: bool = setting(
        True, section="data preparation", constraint=Boolean(), stages=("load",), agree=True,
        doc="Detrend and standardise every voxel time course of every subject. With confounds, detrend or filters "
            "it is nilearn's \"zscore_sample\".")
    min_volumes: int = setting(
        10, section="data preparation", constraint=Interval(Integral, 1, None), stages=("load",), agree=True,
        doc="Runs with fewer volumes are refused (with the file named).")
    bids: dict[str, str] = setting(
        section="data preparation", constraint=Table(BIDS_FILTERS, Label()), stages=("load",), factory=dict,
        example=('{ task = "rest", space = "MNI152NLin2009cAsym", res = "2" }',),
        doc="BIDS filters: keep only the runs whose file-name entities match (keys task, space, session, run, res, "
            "desc). The privacy unit is the person: every run and session of one BIDS subject (sub-<label>) counts "
            "as one subject. fMRIPrep derivatives are read as they are: *_space-<MNI space>[_res-<r>]_desc-preproc_"
            "bold (desc-preproc unless you filter desc; desc-smoothAROMAnonaggr for confounds = \"ica_aroma\"), "
            "with the run's brain mask, JSON sidecar (TR) and confounds table beside it; anat/, figures/, surface "
            "and CIFTI outputs and every file not used are listed on the site's console and in its record. Runs on "
            "another MNI grid are resampled to the analysis grid by nilearn (once, at the site); native-space runs "
            "(space-T1w) are refused by name; one run in two spaces or resolutions needs a space/res filter.")
    confounds: str | list[str] = setting(
        "", section="site-local cleaning (nilearn; before anything is released, no privacy cost)",
        constraint=TextList(), stages=("load",), agree=True,
        example=('"simple"', '["trans_x", "trans_y", "trans_z", "rot_x", "rot_y", "rot_z", "csf", "white_matter"]'),
        doc="Confound removal from each run's fMRIPrep confounds table: \"\" (off, the default: the same cleaning "
            "at every site whatever files it holds; synthetic data have no table), a nilearn strategy (\"simple\", "
            "\"scrubbing\", \"compcor\", \"ica_aroma\": nilearn.interfaces.fmriprep.load_confounds_strategy; a run "
            "without its table is refused; \"ica_aroma\" cleans the ICA-AROMA denoised desc-smoothAROMAnonaggr "
            "runs of fMRIPrep --use-aroma, and refuses others), or a list of column names of the table.")
    confounds_options: dict[str, Any] = setting(
        section="site-local cleaning (nilearn; before anything is released, no privacy cost)", constraint=Table(),
        stages=("load",), agree=True, factory=dict, example=("{ fd_threshold = 0.3, std_dvars_threshold = 1.5 }",),
        doc="Keyword arguments the confounds strategy takes in nilearn's load_confounds_strategy. Others, which "
            "nilearn would ignore, are refused (and so is ica_aroma's option: nilearn always uses the "
            "non-aggressive outputs).")
    detrend: bool = setting(
        False, section="site-local cleaning (nilearn; before anything is released, no privacy cost)",
        constraint=Boolean(), stages=("load",), agree=True,
        doc="Detrend each run with nilearn.signal.clean. With confounds, detrend or filters every run goes through "
            "nilearn.signal.clean with its own TR (header, or the sidecar's RepetitionTime).")
    high_pass: float | None = setting(
        None, section="site-local cleaning (nilearn; before anything is released, no privacy cost)",
        constraint=OrNone(Interval(Real, 0, None, closed="neither"), "off"), stages=("load",), agree=True,
        example=("0.01",),
        doc="High-pass filter (Hz) of nilearn.signal.clean; left out: off.")
    low_pass: float | None = setting(
        None, section="site-local cleaning (nilearn; before anything is released, no privacy cost)",
        constraint=OrNone(Interval(Real, 0, None, closed="neither"), "off"), stages=("load",), agree=True,
        example=("0.1",),
        doc="Low-pass filter (Hz) of nilearn.signal.clean, above high_pass; left out: off.")
    smoothing_fwhm: float | None = setting(
        None, section="site-local cleaning (nilearn; before anything is released, no privacy cost)",
        constraint=OrNone(Interval(Real, 0, None, closed="neither"), "off"), stages=("load",), agree=True,
        example=("6.0",),
        doc="Spatial smoothing (mm FWHM, nilearn.image.smooth_img) of each run on the analysis grid, before "
            "masking; left out: off.")
    on_bad_subject: str = setting(
        "stop", section="data preparation", constraint=StrOptions(ON_BAD_SUBJECT), stages=("load",),
        doc="A subject whose files are bad (a truncated gzip, NaNs, a missing confounds table): \"stop\" or "
            "\"skip\". \"stop\" (the default) stops the site naming the file; \"skip\" leaves the subject out with "
            "the reason, listed in the site's record and the report. To leave a known subject out, list it in its "
            "site's table: exclude = [\"sub-07\"].")
    cluster: dict[str, Any] = setting(
        section="data preparation", constraint=Table(CLUSTER_KEYS), factory=dict,
        example=('{ worker = "dask", address = "tcp://10.0.0.5:8786", subjects_per_task = 8 }',
                 '{ worker = "slurm", sbatch_args = "--mem=8G --time=01:00:00 --cpus-per-task=4" }'),
        doc="A site's own cluster for its per-subject work (decoding, masking, standardising); empty: threads on "
            f"this machine. Batches of `subjects_per_task` subjects (default {SUBJECTS_PER_TASK}) run by Pydra's "
            "Dask worker (`address` of your scheduler) or SLURM worker (`sbatch_args`, one job per batch). `out` "
            "must be on storage every node shares; the site matrix is the same either way, so this is each site's "
            "own choice. Needs `pip install 'dpneuro[cluster]'` for Dask.")
    seed: int | None = setting(
        None, section="privacy", constraint=OrNone(Interval(Integral, 0, None), "noise from OS entropy"),
        stages=("reduce", "unmix", "fnc", "states", "glm", "maps"), agree=True, estimator="random_state",
        example=("0",),
        doc="Noise seed: left out (the default), every party draws from OS entropy, as a deployment must. An "
            "integer makes a `dpneuro run` simulation reproducible; the report then says so. `dpneuro site` / "
            "`dpneuro aggregator` refuse a seed (anyone who reads the configuration could regenerate a site's "
            "noise) unless `simulation = true` says the run is a test.")
    simulation: bool = setting(
        False, section="privacy", constraint=Boolean(), agree=True,
        doc="True only for tests and simulations of a deployment: lets the deployed parties keep a fixed `seed`. "
            "Never set it in a real run.")
    backend: str = setting(
        "inprocess", section="run and outputs", constraint=StrOptions(BACKENDS),
        doc="Exchange backend of the run: \"inprocess\" (all parties as threads of one process) or \"directory\" "
            "(messages through exchange_dir, which it then requires). `dpneuro run` simulates in-process; "
            "`dpneuro site` and `dpneuro aggregator` always use the directory exchange at exchange_dir.")
    exchange_dir: str = setting(
        "", section="run and outputs", constraint=Text("a folder, or empty"), template='"shared"',
        doc="Shared folder of a deployed run (`dpneuro site` / `dpneuro aggregator`); every party must see the "
            "same folder (NFS, SMB, ...). Unused by `dpneuro run`.")
    run_id: str = setting(
        DEFAULT_RUN_ID, section="run and outputs", constraint=Text("a run id", rule=_run_id_problem),
        doc="The run's name: its outputs' folder inside out, and a deployed run's folder inside exchange_dir. A "
            "run with another id (here or `--run-id` on the command line) keeps its own outputs beside this one's; "
            "the same id again overwrites them (a deployed party resumes it).")
    truth: str = setting(
        "", section="run and outputs", constraint=Text("a folder, or empty"), stages=("maps",),
        doc="Optional ground truth: a synthetic consortium's folder with manifest.json. It adds "
            "agreement-with-truth metrics to the report; empty for real data.")
    interactive_maps: bool = setting(
        False, section="run and outputs", constraint=Boolean(),
        doc="Embed an interactive viewer (nilearn's view_img, works offline) for every component in report.html, "
            "about 0.6 MB each.")
    timeout: float = setting(
        600.0, section="run and outputs", constraint=Interval(Real, 0, None, closed="neither"),
        doc="Seconds any party waits for one message (or for the run manifest) before it gives up with an error "
            "naming who is missing.")

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
        return "moment" if self.reduction == "pdsvd" else "subspace"

    @property
    def pca_variances(self) -> bool:
        """Whether the PCA also releases variances in its subspace: subspace contributions whose eigenvalues a
        later stage whitens with (temporal ICA)."""
        return self.contribution == "subspace" and self.ica == "temporal"

    @property
    def cumulant_unmixing(self) -> bool:
        """Whether temporal ICA unmixes by the cumulant ICA (``ica_unmixing``; spatial ICA has no unmixing stage)."""
        return self.ica == "temporal" and self.ica_unmixing == "cumulant"

    def cleaning(self) -> Cleaning:
        """The site-local cleaning every party applies (:class:`dpneuro.data.cleaning.Cleaning`)."""
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
        root = Path.cwd() if base is None else Path(base)

        def ab(p: str) -> str:
            return str((root / p).resolve()) if p and not Path(p).is_absolute() else p

        sites = [replace(s, path=ab(s.path), files=[ab(f) for f in s.files], subjects_tsv=ab(s.subjects_tsv),
                         participants=ab(s.participants)) for s in self.sites]
        paths = {f: ab(getattr(self, f)) for f in self.PATH_FIELDS}
        if is_atlas_name(self.atlas):
            paths["atlas"] = self.atlas  # a name nilearn resolves, not a file
        return replace(self, sites=sites, **paths)

    def grid(self):
        """The run's mask (boolean) and affine: the mask file, or the template named by ``space``."""
        if self.mask:
            return load_mask(self.mask)
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
        return self

    # -- validation ----------------------------------------------------------------------
    def check_fields(self) -> RunConfig:
        """Check each field against its own constraint (type and range), in declaration order."""
        for f in fields(self):
            f.metadata["constraint"].check(f.name, getattr(self, f.name))
        return self

    def validate(self, *, data_sites: Collection[str] | None = None) -> RunConfig:
        """Check every field; raise :class:`ConfigError` naming the first bad one.

        Each field's own constraint first (:meth:`check_fields`), then the rules
        that tie fields together, the inputs' existence and the sites.
        ``data_sites``: names of the sites whose data must be readable here
        (default: all). One party of a distributed run (``dpneuro site`` /
        ``dpneuro aggregator``) holds at most its own site's data and passes
        ``[its name]`` or ``()``.
        """
        def bad(fieldname: str, why: str):
            raise ConfigError(f"config field {fieldname!r}: {why}")

        self.check_fields()
        names = [s.name for s in self.sites]
        if len(set(names)) != len(names):
            bad("sites", f"site names must be unique, got {names}")
        for i, s in enumerate(self.sites):
            if not s.name:
                bad(f"sites[{i}].name", "empty")
            if not isinstance(s.exclude, list) or not all(isinstance(x, str) and x for x in s.exclude):
                bad(f"sites[{i}].exclude ({s.name})", f"a list of subject ids (e.g. [\"sub-07\"]), got {s.exclude!r}")
            if data_sites is not None and s.name not in data_sites:
                continue  # another party's data: not on this machine
            if not s.files and not s.path:
                bad(f"sites[{i}]", "give 'path' (a folder of NIfTI files) or 'files'")
            for f in s.files or [s.path]:
                if not Path(f).exists():
                    bad(f"sites[{i}] ({s.name})", f"{f} does not exist")
            if s.subjects_tsv and not Path(s.subjects_tsv).is_file():
                bad(f"sites[{i}].subjects_tsv ({s.name})", f"{s.subjects_tsv} does not exist")
            if s.participants and not Path(s.participants).is_file():
                bad(f"sites[{i}].participants ({s.name})", f"{s.participants} does not exist")
        if self.mask and not Path(self.mask).exists():
            bad("mask", f"{self.mask} does not exist")
        if self.truth and not (Path(self.truth) / "manifest.json").exists():
            bad("truth", f"{self.truth} has no manifest.json")
        if problem := check_atlas(self.atlas):
            bad("atlas", problem)
        if not self.mask and self.space not in SPACES:
            bad("space", f"unknown template {self.space!r} ({', '.join(SPACES)}) and no mask given")
        for name, why in check_cleaning(self.cleaning()):
            bad(name, why)
        if self.cleaning().strategy == "ica_aroma" and str(self.bids.get("desc", AROMA_DESC)) != AROMA_DESC:
            bad("bids.desc", f"confounds = 'ica_aroma' reads the ICA-AROMA denoised runs (desc-{AROMA_DESC}), "
                f"not desc-{self.bids['desc']}; leave desc out or use another strategy")
        if self.cluster and (self.cleaning().temporal or self.smoothing_fwhm):
            bad("cluster", "a site's cluster decodes runs without cleaning; confounds, detrend, filters and "
                "smoothing run in the site's own process (leave cluster out)")
        self._check_cluster(bad, check_here=data_sites is None or bool(data_sites))
        if self.parcels and not self.atlas and self.n_components > self.parcels:
            bad("n_components", f"{self.n_components} components need at least as many features D; the "
                f"features are the {self.parcels} parcels (field parcels)")
        if self.brain_states and self.brain_states > self.n_components * (self.n_components - 1) // 2:
            bad("brain_states", f"{self.brain_states} states need more connectivity features: {self.n_components} "
                f"components give {self.n_components * (self.n_components - 1) // 2} pairs")
        if self.question == "group differences" and not self.design:
            bad("question", "\"group differences\" needs a design (e.g. design = \"group + age\") and its covariates")
        if self.question == "fnc" and not self.fnc:
            bad("question", "\"fnc\" needs fnc = true")
        if self.design:
            try:
                parse_design(self.design, self.covariates)
            except ValueError as exc:
                bad("design", str(exc))
            measures = [self.glm_measures] if isinstance(self.glm_measures, str) else list(self.glm_measures)
            if not measures or set(measures) - set(GLM_MEASURES) or len(set(measures)) != len(measures):
                bad("glm_measures", f"{measures!r}: give one or more of {list(GLM_MEASURES)}, each once")
            elif "fnc" in measures and self.n_components < 2:
                bad("glm_measures", "\"fnc\" needs two or more components")
            elif "states" in measures and not self.brain_states:
                bad("glm_measures", "\"states\" compares the subjects' brain-state dynamics: set brain_states")
            hypotheses = [self.glm_hypotheses] if isinstance(self.glm_hypotheses, str) else list(self.glm_hypotheses)
            try:
                normal = [normal_hypothesis(h, self.n_components) for h in hypotheses]
            except ValueError as exc:
                bad("glm_hypotheses", str(exc))
            else:
                if len(set(normal)) != len(normal):
                    bad("glm_hypotheses", f"{hypotheses!r} names a measure twice")
                if any(kind(h) == "states" for h in normal) and not self.brain_states:
                    bad("glm_hypotheses", "a brain-state measure needs brain_states")
        if self.pca_contribution == "subspace" and self.reduction == "pdsvd":
            bad("pca_contribution", "PD-SVD sums the data's second moment; 'subspace' is capePCA's (use 'auto')")
        if self.plan == "cape" and len(self.sites) < 3:
            bad("plan", f"CAPE needs at least 3 sites, got {len(self.sites)}; use 'conv'")
        check_colluding(self.plan, self.n_colluding, len(self.sites))
        if self.backend == "directory" and not self.exchange_dir:
            bad("exchange_dir", "the directory backend needs a shared folder")
        if self.epsilon is not None and (self.plan == "none" or self.reduction in ("none", "pdsvd")):
            bad("epsilon", f"plan {self.plan!r} / reduction {self.reduction!r}: the reduction adds no noise, so "
                "the run has no differential-privacy budget to plan")
        if self.plan != "none":
            if self.calibration == "classic" and self.ica_epsilon_i >= 1:
                bad("ica_epsilon_i", "the classic Gaussian formula needs eps < 1; use calibration = 'analytic'")
            try:
                noise_multiplier(self.ica_epsilon_i, self.ica_delta_i, method=self.calibration)
            except ValueError as exc:
                bad("calibration", str(exc))
        return self

    def _check_cluster(self, bad, *, check_here: bool) -> None:
        c = self.cluster  # a table with known keys (its constraint)
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
        for key, value in d.items():  # each field's type and range, before anything is built from it
            if key != "sites":  # a list of tables here, of SiteEntry once built (checked by validate)
                cls.__dataclass_fields__[key].metadata["constraint"].check(key, value)

        def rel(p: str) -> str:
            return str((base / p).resolve()) if base is not None and p and not Path(p).is_absolute() else p

        if not isinstance(d["sites"], list):
            raise ConfigError(f"config field 'sites': {Sites().describe()}, got {d['sites']!r}")
        sites = []
        for i, s in enumerate(d.pop("sites")):
            if not isinstance(s, dict):
                raise ConfigError(f"config field 'sites[{i}]': must be a table with name and path")
            extra = set(s) - {"name", "path", "files", "subjects_tsv", "exclude", "participants"}
            if extra:
                raise ConfigError(f"config field 'sites[{i}]': unknown keys {sorted(extra)}")
            sites.append(SiteEntry(name=str(s.get("name", "")), path=rel(str(s.get("path", ""))),
                                   files=[rel(str(f)) for f in s.get("files", [])],
                                   subjects_tsv=rel(str(s.get("subjects_tsv", ""))),
                                   exclude=s.get("exclude", []), participants=rel(str(s.get("participants", "")))))
        for key in cls.PATH_FIELDS:
            if d.get(key) and not (key == "atlas" and is_atlas_name(d[key])):  # a name is not a file
                d[key] = rel(str(d[key]))
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


# -- the fields' descriptions, as every consumer reads them ---------------------------------------

def consortium_fields() -> tuple[str, ...]:
    """The fields every party of a run must share (the run manifest compares them)."""
    return tuple(f.name for f in fields(RunConfig) if f.metadata["agree"])


def stage_fields(stage: str) -> tuple[str, ...]:
    """The fields the pipeline stage ``stage`` depends on (a change re-runs it and what follows)."""
    return tuple(f.name for f in fields(RunConfig) if stage in f.metadata["stages"])


def estimator_name(name: str) -> str:
    """The estimators' parameter for the field ``name`` (the field's own name but for ``seed``)."""
    return RunConfig.__dataclass_fields__[name].metadata.get("estimator", name)


def constraint(name: str) -> Constraint:
    """What the field ``name`` accepts."""
    return RunConfig.__dataclass_fields__[name].metadata["constraint"]


def summary(name: str) -> str:
    """The first sentence of the field's documentation (``--help``)."""
    doc = RunConfig.__dataclass_fields__[name].metadata["doc"]
    head, dot, _ = doc.partition(". ")
    return head + "." if dot else doc


