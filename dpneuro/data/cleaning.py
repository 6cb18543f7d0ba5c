"""Site-local cleaning of fMRIPrep runs, done by nilearn (no privacy cost: nothing is released yet).

What a consortium agrees on (:class:`Cleaning`, from the ``RunConfig`` fields
``confounds``, ``confounds_options``, ``detrend``, ``standardize``,
``high_pass``, ``low_pass``, ``smoothing_fwhm``) and the two nilearn calls that
carry it out per run:

- confounds (and scrubbing's sample mask) from
  ``nilearn.interfaces.fmriprep.load_confounds_strategy`` (a preset strategy) or
  an explicit list of columns of the run's ``_desc-confounds_timeseries.tsv``;
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
from dataclasses import asdict, dataclass, field
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
    """

    confounds: str | tuple[str, ...] = ""
    confounds_options: dict = field(default_factory=dict)
    detrend: bool = False
    standardize: bool = True
    high_pass: float | None = None
    low_pass: float | None = None
    smoothing_fwhm: float | None = None

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
        return d

    def describe(self) -> str:
        """One sentence for the report: how the data were cleaned."""
        parts = []
        if self.strategy:
            opts = "".join(f", {k}={v!r}" for k, v in sorted(self.confounds_options.items()))
            parts.append(f"confounds: nilearn load_confounds_strategy(denoise_strategy={self.strategy!r}{opts})")
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


def run_confounds(bold: Path, cleaning: Cleaning, n_volumes: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The run's confounds (T x K float64, or None) and sample mask (kept volume indices, or None).

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

            conf, sample_mask = load_confounds_strategy(str(bold), denoise_strategy=cleaning.strategy,
                                                        **cleaning.confounds_options)
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
    if X is not None and X.shape[0] != n_volumes:
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
