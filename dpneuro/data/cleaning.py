"""Site-local cleaning of fMRIPrep runs, done by nilearn (no privacy cost: nothing is released yet).

What a consortium agrees on (:class:`Cleaning`, from the ``RunConfig`` fields
``confounds``, ``confounds_options``, ``detrend``, ``standardize``,
``high_pass``, ``low_pass``, ``smoothing_fwhm``) and the two nilearn calls that
carry it out per run:

- confounds (and scrubbing's sample mask) from
  ``nilearn.interfaces.fmriprep.load_confounds_strategy`` (a preset strategy) or
  an explicit list of columns of the run's ``_desc-confounds_timeseries.tsv``;
  a preset's model of motion or white matter / CSF (nilearn's "full",
  "derivatives", "power2", "basic") whose columns a run's table lacks
  (some fMRIPrep versions write no ``*_power2`` columns) becomes the richest
  of those models the table has (:func:`adapt_to_columns`: chosen from the
  column names alone, recorded in the site's record and described);
- ``nilearn.signal.clean`` on the run's masked D x T block (transposed to the
  T x D nilearn expects) with the run's own TR: detrend, filters, confound
  regression, standardisation, censoring.

Spatial smoothing (``nilearn.image.smooth_img``) and resampling happen on the
4-D image before masking, in :mod:`dpneuro.data.load`.

Without confounds, filters or detrending the site keeps the fast path of
:func:`dpneuro.data.load.preprocess` (z-scored voxels), so the synthetic demo data give
the same matrix as before.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from dpneuro._utils.errors import DpneuroError
from dpneuro.data.bids import bids_entities, confounds_name

#: nilearn's preset denoising strategies (``load_confounds_strategy``)
STRATEGIES = ("simple", "scrubbing", "compcor", "ica_aroma")

#: the ``desc`` an fMRIPrep run must have for a strategy: "ica_aroma" reads the AROMA-denoised copy
#: (nilearn's preset always uses ICA-AROMA's non-aggressive "full" variant); everything else ``desc-preproc``
DEFAULT_DESC = "preproc"
AROMA_DESC = "smoothAROMAnonaggr"

#: nilearn's models of a confound: the columns each adds to its base column (``<base>_<suffix>``, nilearn's
#: add_suffix), richest first: the order in which a preset's model falls back to one a table has the columns of
MODEL_SUFFIXES = {"full": ("derivative1", "power2", "derivative1_power2"), "derivatives": ("derivative1",),
                  "power2": ("power2",), "basic": ()}
#: the strategy options that choose a model, and the fMRIPrep columns each expands
MODEL_BASES = {"motion": ("trans_x", "trans_y", "trans_z", "rot_x", "rot_y", "rot_z"),
               "wm_csf": ("csf", "white_matter"), "global_signal": ("global_signal",)}


class CleaningError(DpneuroError, ValueError):  # the loader turns it into a DataValidationError naming the run
    """A run cannot be cleaned as the consortium asked (the message names the run)."""


@dataclass(frozen=True)
class Cleaning:
    """How every site cleans each run before masking and concatenation (a consortium setting).

    confounds : "" (off), one of :data:`STRATEGIES`, or a tuple of confound column names
    confounds_options : extra keyword arguments for ``load_confounds_strategy`` (e.g. ``fd_threshold``)
    detrend, standardize : per run, through ``nilearn.signal.clean`` when cleaning is active
    high_pass, low_pass : Hz, or None (off); each run's own TR is used
    smoothing_fwhm : mm, or None / 0 (off); ``nilearn.image.smooth_img`` on the 4-D image
    adapted : filled as runs are read (:func:`run_confounds`): run -> the strategy's models its confounds table
        made differ from the preset's (:func:`adapt_to_columns`; empty: as configured); in :meth:`to_json` and
        :meth:`describe` once any run differs
    """

    confounds: str | tuple[str, ...] = ""
    confounds_options: dict = field(default_factory=dict)
    detrend: bool = False
    standardize: bool = True
    high_pass: float | None = None
    low_pass: float | None = None
    smoothing_fwhm: float | None = None
    adapted: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_config(cls, cfg) -> Cleaning:
        conf = cfg.confounds
        return cls(confounds=tuple(conf) if isinstance(conf, (list, tuple)) else str(conf or ""),
                   confounds_options=cfg.confounds_options, detrend=cfg.detrend, standardize=cfg.standardize,
                   high_pass=cfg.high_pass or None, low_pass=cfg.low_pass or None,
                   smoothing_fwhm=cfg.smoothing_fwhm or None)

    @property
    def temporal(self) -> bool:
        """Whether a run's time courses go through ``nilearn.signal.clean`` (otherwise the fast z-scoring)."""
        return bool(self.confounds) or self.detrend or self.high_pass is not None or self.low_pass is not None

    @property
    def strategy(self) -> str | None:
        return self.confounds if isinstance(self.confounds, str) and self.confounds else None

    @property
    def desc(self) -> str:
        """The fMRIPrep ``desc`` the runs are read from when the site gives no ``desc`` filter."""
        return AROMA_DESC if self.strategy == "ica_aroma" else DEFAULT_DESC

    def to_json(self) -> dict:
        d = asdict(self)
        d["confounds"] = list(self.confounds) if isinstance(self.confounds, tuple) else self.confounds
        del d["adapted"]
        if changed := self.adaptations():  # what the runs' tables made of the strategy (absent: as configured)
            d["adapted"] = changed
        return d

    def adaptations(self) -> list[dict]:
        """Each model the runs read so far used instead of the preset's: ``option``, ``preset``, ``used`` and in
        how many ``runs`` ``of`` the runs read with the strategy."""
        presets = {option: model for option, (model, _) in _models(self).items()}
        counts = Counter((option, used) for run in self.adapted.values() for option, used in run.items())
        return [{"option": option, "preset": presets.get(option), "used": used, "runs": n, "of": len(self.adapted)}
                for (option, used), n in sorted(counts.items())]

    def describe(self) -> str:
        """One sentence for the report: how the data were cleaned."""
        parts = []
        if self.strategy:
            opts = "".join(f", {k}={v!r}" for k, v in sorted(self.confounds_options.items()))
            said = f"confounds: nilearn load_confounds_strategy(denoise_strategy={self.strategy!r}{opts})"
            if changed := self.adaptations():
                said += ", with " + ", ".join(
                    f"{a['option']}={a['used']!r} instead of the preset's {a['preset']!r} for {a['runs']} of "
                    f"{a['of']} runs" for a in changed) + " (their confounds tables lack the preset's columns)"
            parts.append(said)
        elif self.confounds:
            parts.append(f"confounds: columns {', '.join(self.confounds)} of each run's fMRIPrep confounds table")
        else:
            parts.append("no confound removal")
        if self.temporal:
            parts.append(f"nilearn.signal.clean per run with its own TR (detrend={self.detrend}, "
                         f"standardize={'zscore_sample' if self.standardize else False}, high_pass={self.high_pass}, "
                         f"low_pass={self.low_pass})")
        else:
            parts.append("each voxel z-scored per run" if self.standardize else "no standardisation")
        if self.smoothing_fwhm:
            parts.append(f"smoothed with nilearn.image.smooth_img (FWHM {self.smoothing_fwhm:g} mm)")
        return "; ".join(parts)


def check(cleaning: Cleaning) -> list[tuple[str, str]]:
    """(field, problem) for every invalid setting; empty when all are fine."""
    out = []
    conf = cleaning.confounds
    if isinstance(conf, str):
        if conf and conf not in STRATEGIES:
            out.append(("confounds", f"one of {STRATEGIES}, a list of confound column names, or \"\" (off); "
                        f"got {conf!r}"))
    elif not conf or not all(isinstance(c, str) and c for c in conf):
        out.append(("confounds", f"a list of confound column names must be non-empty text, got {list(conf)!r}"))
    if not isinstance(cleaning.confounds_options, dict):
        out.append(("confounds_options", f"a table, got {cleaning.confounds_options!r}"))
    elif cleaning.confounds_options:
        if not cleaning.strategy:
            out.append(("confounds_options", "only with a nilearn strategy in 'confounds'"))
        else:
            known = strategy_options(cleaning.strategy)
            given = set(cleaning.confounds_options)
            if cleaning.strategy == "ica_aroma" and "ica_aroma" in given:
                out.append(("confounds_options", "nilearn's 'ica_aroma' strategy always uses ICA-AROMA's "
                            "non-aggressive outputs (the desc-smoothAROMAnonaggr runs) and ignores the option "
                            "ica_aroma; leave it out (for the aroma_motion_* columns with desc-preproc runs, list "
                            "them in confounds)"))
            elif given - known:
                out.append(("confounds_options", f"option(s) {sorted(given - known)} are not used by nilearn's "
                            f"{cleaning.strategy!r} strategy (it would ignore them); it takes {sorted(known)}"))
    for name in ("detrend", "standardize"):
        if not isinstance(getattr(cleaning, name), bool):
            out.append((name, "true or false"))
    for name in ("high_pass", "low_pass", "smoothing_fwhm"):
        v = getattr(cleaning, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
            out.append((name, f"a positive number (or left out: off), got {v!r}"))
    if cleaning.high_pass and cleaning.low_pass and not cleaning.high_pass < cleaning.low_pass:
        out.append(("low_pass", f"must be above high_pass ({cleaning.high_pass} Hz), got {cleaning.low_pass} Hz"))
    return out


def strategy_options(strategy: str) -> set[str]:
    """The ``load_confounds_strategy`` keywords a preset strategy takes (nilearn warns about and ignores others)."""
    try:
        # deferred: nilearn is slow to load
        from nilearn.interfaces.fmriprep.load_confounds_strategy import preset_strategies as presets
    except ImportError:  # another layout: every load_confounds keyword
        from nilearn.interfaces.fmriprep import load_confounds  # deferred: nilearn is slow to load

        return set(inspect.signature(load_confounds).parameters) - {"img_files", "strategy"}
    return set(presets[strategy]) - {"strategy", "ica_aroma"}


def _models(cleaning: Cleaning) -> dict[str, tuple[str, bool]]:
    """The strategy's options that choose a model: option -> (its model, whether the configuration set it)."""
    if not cleaning.strategy:
        return {}
    try:
        # deferred: nilearn is slow to load
        from nilearn.interfaces.fmriprep.load_confounds_strategy import preset_strategies as presets
    except ImportError:  # another layout: nilearn's own defaults, nothing adapted
        return {}
    preset, given = presets[cleaning.strategy], cleaning.confounds_options
    out = {}
    for option in MODEL_BASES:
        mine = given.get(option)
        # global_signal joins a strategy only when set (as nilearn's load_confounds_strategy does it)
        if option in preset.get("strategy", ()) or (option == "global_signal" and isinstance(mine, str)):
            model = mine if mine is not None else preset.get(option)
            if model in MODEL_SUFFIXES:
                out[option] = (model, mine is not None)
    return out


def _model_columns(option: str, model: str) -> list[str]:
    bases = MODEL_BASES[option]
    return [*bases, *(f"{b}_{s}" for b in bases for s in MODEL_SUFFIXES[model])]


def adapt_to_columns(cleaning: Cleaning, columns: Iterable[str], where: str = "the confounds table") -> dict[str, str]:
    """The models nilearn's strategy uses on a confounds table with these ``columns``, where they differ from the
    preset's (option -> model; empty: the strategy as configured).

    A model the preset chooses (motion, wm_csf) whose columns the table lacks becomes the richest of nilearn's
    models ("full", "derivatives", "power2", "basic"), among those whose columns are part of the preset's, that the
    table has every column of: "derivatives" for "full" when the ``*_power2`` columns are missing. Only the column
    names decide (public metadata, not data values). A model the configuration sets (``confounds_options``) is
    used as it is.

    Raises
    ------
    CleaningError
        Naming ``where`` and the missing columns, when a model the configuration sets, or even the base columns
        ("basic"), are not in the table.
    """
    have = set(columns)
    out = {}
    for option, (model, set_here) in _models(cleaning).items():
        missing = [c for c in _model_columns(option, model) if c not in have]
        if not missing:
            continue
        fits = [m for m in MODEL_SUFFIXES if set(_model_columns(option, m)) <= have]
        if set_here:
            # the preset picks motion and wm_csf per table when they are left out; global_signal is then off
            rest = f" or leave {option} out to use the richest one each table has" if option != "global_signal" else ""
            instead = (f"set a model its columns allow ({option} = {fits[0]!r}){rest}" if fits
                       else f"leave {option} out of confounds_options")
            raise CleaningError(f"{where}: confounds_options sets {option} = {model!r}, whose column(s) {missing} "
                                f"it does not have; {instead}")
        fits = [m for m in fits if set(MODEL_SUFFIXES[m]) <= set(MODEL_SUFFIXES[model])]
        if not fits:
            base = [c for c in MODEL_BASES[option] if c not in have]
            raise CleaningError(f"{where}: no column(s) {base}, which nilearn's {cleaning.strategy!r} strategy needs "
                                f"for its {option!r} confounds (in any of its models)")
        out[option] = fits[0]
    return out


def table_columns(table) -> list[str]:
    """The column names of a confounds table (its first line): all the choice of models reads."""
    with open(table, encoding="utf-8") as f:
        return f.readline().rstrip("\r\n").split("\t")


def check_confounds_tables(runs: Iterable, cleaning: Cleaning) -> Cleaning:
    """Check, before anything is released, that every run of ``runs`` (a site's, as its loader finds them;
    :func:`dpneuro.run.pipeline.check_site_confounds`) has a confounds table the consortium's ``confounds`` can
    clean, reading each table as the loader reads it with the models its columns allow
    (:func:`adapt_to_columns`); no image data are read. Returns ``cleaning`` with :attr:`Cleaning.adapted`
    filled for every run (its :meth:`~Cleaning.describe` and :meth:`~Cleaning.to_json` say what the runs will
    be cleaned with); raises :class:`CleaningError` naming the run or its table (no table, columns a strategy or
    a column list needs, anything else nilearn refuses)."""
    checked = Cleaning(**{f.name: getattr(cleaning, f.name) for f in fields(Cleaning) if f.name != "adapted"})
    for bold in runs:
        run_confounds(Path(bold), checked, None)
    return checked


# ---------------------------------------------------------------------------
# per run
# ---------------------------------------------------------------------------

def confounds_table(bold: Path) -> Path | None:
    """The run's fMRIPrep confounds table beside it (``..._desc-confounds_timeseries.tsv``), if any."""
    for suffix in ("timeseries", "regressors"):  # fMRIPrep < 20.2 wrote "regressors"
        p = bold.with_name(confounds_name(bold, suffix))
        if p.is_file():
            return p
    return None


def run_confounds(bold: Path, cleaning: Cleaning,
                  n_volumes: int | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The run's confounds (T x K float64, or None) and sample mask (kept volume indices, or None).

    A strategy's models follow the table's columns (:func:`adapt_to_columns`), recorded in
    ``cleaning.adapted``. ``n_volumes``: the run's, which the table's rows must match (None: not checked).
    Raises :class:`CleaningError` naming the run when confounds were asked for and its table is missing or
    lacks what the strategy needs.
    """
    if not cleaning.confounds:
        return None, None
    if cleaning.strategy == "ica_aroma":
        desc = bids_entities(bold).get("desc")
        if desc != AROMA_DESC:
            raise CleaningError(f"{bold}: confounds = 'ica_aroma' cleans the ICA-AROMA denoised copy of each run "
                                f"(desc-{AROMA_DESC}, from fMRIPrep --use-aroma), not a desc-{desc} run; give "
                                "those files, or another strategy")
    table = confounds_table(bold)
    if table is None:
        raise CleaningError(f"{bold}: no fMRIPrep confounds table beside it "
                            f"({confounds_name(bold, 'timeseries')}); confounds = {cleaning.to_json()['confounds']!r} "
                            "was asked for. Leave confounds out (\"\") for data without one")
    try:
        if cleaning.strategy:
            from nilearn.interfaces.fmriprep import load_confounds_strategy  # deferred: nilearn is slow to load

            adapted = adapt_to_columns(cleaning, table_columns(table), f"{table} (confounds of {bold.name})")
            cleaning.adapted[str(bold)] = adapted
            conf, sample_mask = load_confounds_strategy(str(bold), denoise_strategy=cleaning.strategy,
                                                        **{**cleaning.confounds_options, **adapted})
        else:
            import pandas as pd  # deferred: slow to load, only a table of named confounds needs it

            df = pd.read_csv(table, sep="\t")
            missing = [c for c in cleaning.confounds if c not in df.columns]
            if missing:
                raise CleaningError(f"{table}: no column(s) {missing} (confounds of {bold.name})")
            conf = df[list(cleaning.confounds)]
            # derivatives start with NaN: take the second row's value, as nilearn's loader does
            first = conf.iloc[0].isna().to_numpy()
            if first.any():
                conf = conf.copy()
                conf.iloc[0, first] = conf.iloc[1, first]
            sample_mask = None
    except CleaningError:
        raise
    except Exception as exc:  # nilearn raises ValueError / MissingConfoundError / KeyError with its own words
        raise CleaningError(f"{bold}: confounds {cleaning.to_json()['confounds']!r} could not be read from "
                            f"{table.name} ({type(exc).__name__}: {exc})") from exc
    X = None if conf is None or conf.size == 0 else np.asarray(conf, dtype=np.float64)
    if X is not None and not np.isfinite(X).all():
        raise CleaningError(f"{table}: non-finite values in the confounds used for {bold.name}")
    if X is not None and n_volumes is not None and X.shape[0] != n_volumes:
        raise CleaningError(f"{table}: {X.shape[0]} rows, but {bold.name} has {n_volumes} volumes")
    if sample_mask is not None:
        sample_mask = np.asarray(sample_mask, dtype=np.int64)
        if sample_mask.size < 2:
            raise CleaningError(f"{bold}: scrubbing keeps {sample_mask.size} of {n_volumes} volumes")
    return X, sample_mask


def clean_block(block: np.ndarray, *, tr: float | None, cleaning: Cleaning, confounds=None,
                sample_mask=None) -> np.ndarray:
    """A run's masked D x T block cleaned by ``nilearn.signal.clean``: D x T' float32 (T' = kept volumes)."""
    from nilearn import signal  # deferred: nilearn is slow to load

    if (cleaning.high_pass or cleaning.low_pass) and not tr:
        raise CleaningError("temporal filters need the run's TR (header or JSON sidecar RepetitionTime)")
    # nilearn reads time x features; the transpose of a D x T block is a view, nilearn makes its float copy
    out = signal.clean(np.asarray(block).T, detrend=cleaning.detrend,
                       standardize="zscore_sample" if cleaning.standardize else False,
                       confounds=confounds, sample_mask=sample_mask, high_pass=cleaning.high_pass,
                       low_pass=cleaning.low_pass, t_r=tr)
    return np.ascontiguousarray(out.T, dtype=np.float32)
