"""Synthetic multi-site resting-state fMRI with known ground truth.

Two generative models. The default, ``model="blobs"``, is the one of the
temporal-ICA papers: R spatial maps (columns of a D x R mixing matrix ``A``
over the mask voxels), R source time courses per subject drawn from a
GARCH(1,1) process (heavy-tailed, standardised), and per subject

    X = A S + noise * N(0, 1)        (D x T, float32)

written as one real 4-D NIfTI file per subject per site, with the mask, the
maps, ``A`` and every ``S`` alongside and a ``manifest.json`` describing it
all. Everything is fully determined by the seed. The realistic
``model="networks"`` (distributed resting-state networks with slow,
correlated BOLD time courses, global signal and structured noise; usable in
memory through :func:`network_model`) is described below.

Brain states (optional, ``states=K >= 2``; off by default)
---------------------------------------------------------
For the dynamic functional network connectivity (dFNC) analysis the sources
can switch between K planted connectivity states
(:class:`dpneuro.datasets.states.StateProcess`): state k is an R x R correlation
matrix between the sources (:func:`dpneuro.datasets.states.state_correlations`:
sources grouped in modules whose coupling and sign differ between states),
every subject has its own hidden state sequence (a Markov chain with mean
dwell time ``state_dwell[k]`` seconds in state k, by default evenly from 30
to 90 s, so occupancies are unequal), and its sources are Gaussian
innovations correlated by the current state's matrix, low-passed at 0.15 Hz
as BOLD, each row standardised, plus white noise of std 0.3. They replace
the GARCH sources (the maps, the voxel noise and every other draw are
unchanged). The states come from their own stream (2,), each subject's
sources and labels from (3, site, subject).

The "networks" model (``model="networks"``; default ``"blobs"`` is the above)
---------------------------------------------------------------------------
The blobs/GARCH data flatter temporal ICA: compact maps and independent,
heavy-tailed sources. Real resting-state data look different, and the
"networks" model imitates them: the network maps are spatially distributed,
overlapping and sparse (super-Gaussian, what spatial ICA - CanICA, MELODIC,
GIFT - relies on), while their time courses are slow, near-Gaussian and
correlated between networks (why temporal ICA struggles on real data). Per
subject, over the mask voxels (``np.argwhere(mask)`` order),

    X = A S + global_amplitude * w g^T + physio_amplitude * M P + noise * N(0, 1)

Use it in memory with :func:`network_model` (group part: ``A``, the group
correlation, the global-signal weight) and :meth:`NetworkModel.subject`
(``(X, S)`` of one subject, float32), without writing any NIfTI;
``make_consortium(model="networks")`` writes exactly ``subject(s, m, T, tr)``
for site index s and subject-in-site index m. Brain states are not available
with this model. Every number, and why:

Maps ``A`` (D x R, each column scaled to max |value| 1, as for blobs):

- each network has 2-4 regions (uniform): real networks (default mode,
  fronto-parietal, salience...) join several distant regions;
- a region is a 3-D Gaussian of sd 5-9 mm (uniform; computed in world mm
  through the affine, so 3, 4 and 6 mm grids get the same anatomy), cut at
  2.5 sd (the profile is 4% of its peak there: sparse maps, exactly zero away
  from their regions), amplitude 0.5-1 (uniform), like the blobs';
- with probability 0.7 a region is bilateral: its centre is mirrored across
  the mid-sagittal plane (world x = 0; grid30: its middle column) and
  snapped to the nearest in-mask voxel, and the mirror region gets the same
  sd and amplitude (most real networks are bilateral-symmetric; a region
  near the midline merges with its mirror into one medial region, like the
  posterior cingulate, taking the maximum of the two, not their sum);
- with probability 0.3 one region other than the first has a negative sign
  (anticorrelated parts of a network map, as in real ICA maps);
- centres are random in-mask voxels, so different networks overlap partly;
  within a network, regions (and mirrors) are placed with their supports more
  than 2 voxels apart (never touching, even diagonally), redrawing the
  centre from batches of 64 random voxels: every network has at least 2
  separate pieces (a third or fourth region finding no room in one batch is
  dropped). grid30 (1 "mm" = 1 voxel of a 30 x 30 grid) uses sd 1.2-2
  voxels so that the regions fit.

Time courses ``S`` (R x T) of subject m:

- latent neural signals with a 1/f spectrum (power ~ f^-1, the scale-free
  spectrum of resting brain activity; ``spectral_exponent`` = 1), made by
  filtering white noise in the frequency domain over a circular window of at
  least 2T samples plus the HRF's length (no edge or wrap-around effects in
  the T kept);
- correlated across networks: the white noise is mixed by the Cholesky
  factor of the subject's correlation ``C_m = (1 - 0.3) C + 0.3 W_m``, with
  the group correlation ``C = corr(F F^T + I)``, F an R x 4 matrix of
  N(0, 0.6^2) loadings (4 shared factors: clusters of co-fluctuating
  networks; the mean |corr| of C and of a subject's sample correlation over
  150 volumes are both ~0.25, within the 0.1-0.4 typical of real networks),
  and ``W_m`` the correlation matrix of R x (R + 10) Gaussian
  draws (subject-specific connectivity); both are positive definite, hence
  ``C_m`` too;
- convolved with the canonical double-gamma HRF (:func:`canonical_hrf`:
  SPM's gamma(6) - gamma(16)/6, peak 5 s, undershoot 15 s, 32 s, averaged
  within each TR), so BOLD is slow: at TR 2 s ~98.6% of the power lies
  below 0.1 Hz; the marginals stay Gaussian (linear filters of Gaussian
  noise: excess kurtosis ~0, as in real BOLD, no heavy tails);
- each row standardised, then scaled by the network's group strength
  (lognormal(0, 0.7), fixed per model: some networks dominate in every
  subject, which gives the group eigenvalue spectrum its real-data decay)
  times the subject's amplitude (lognormal(0, 0.3) per subject and network:
  between-subject variability). S is the truth: ``X = A S + noise terms``.

Noise of subject m (levels relative to a network of median strength at its
map's peak, where it has unit std, as the blobs' ``noise``):

- global signal: one time course ``g`` (1/f x HRF like the networks,
  standardised) with a smooth spatial weight ``w`` in [0.5, 1] (white noise
  smoothed with sd 25 mm, fixed per model; grid30: 6 voxels), amplitude
  ``global_amplitude = 0.25``;
- structured noise: ``n_physio = 5`` components, each a spatially smooth map
  (white noise smoothed with sd log-uniform in 2-8 mm, i.e. FWHM ~5-19 mm,
  the smoothness of real fMRI noise; zero mean, unit rms; new for every
  subject, like motion and physiological artefacts; grid30: 0.5-2 voxels)
  with a 1/f time course (no HRF), amplitude ``physio_amplitude = 0.3``;
- white Gaussian noise of std ``noise = 0.8`` (``make_consortium``'s default
  for this model; blobs keep 0.5). White noise averages out within parcels,
  so it mostly sets the voxel-level statistics: 0.8 keeps the parcel-level
  spectrum's tail at the real data's level (0.6 would raise ``||P_m||_F``
  at the voxels to ~0.22 but thin that tail).

These default levels were set so that the data match real region-level fMRI
after the consortium's preprocessing (each voxel z-scored within subject,
averaged into the 100 ``coordinate_parcels`` parcels, every time point scaled
to unit norm, so the subject's normalised second moment ``P_m = X_m X_m^T /
T`` has trace 1). Measured on 64 subjects x 150 volumes (mni6mm, R = 20, TR
2 s, seed 0): ``||P_m||_F`` ~0.39 at the parcels (~0.18 at the voxels); the
eigenvalues of the mean P over subjects are 0.25, 0.11, 0.05, 0.03, 0.014,
0.009, 0.004, 0.0014 (k = 1, 2, 3, 5, 10, 20, 50, 100). Real data, for
comparison (OpenNeuro ds000140, 33 participants, task runs 3 and 7 in the 122
MIST regions as shipped by the ``connattractor`` package, band-passed
0.008-0.08 Hz by its authors; two 150-volume windows each, regions z-scored,
unit time points): ``||P_m||_F`` ~0.34 (10-90%: 0.29-0.39) and eigenvalues
0.24, 0.085, 0.065, 0.036, 0.019, 0.008, 0.004, 0.0014.

Seeds: the maps come from the stream (4, 0), the group correlation from
(4, 1), the global weight from (4, 2), the strengths from (4, 3), and every
subject from its own stream (5, site, subject) - keys disjoint from the
blobs' (0, 1) and the states' (2, 3). The maps depend only on the mask, R and
the seed; changing a subject-level parameter (noise levels, mixing,
amplitudes, spectrum) changes no map. ``manifest["model"]`` is "networks"
(absent for blobs) and ``manifest["truth"]["networks"]`` records every
parameter, the group correlation, the strengths and the regions.

Folder layout written by :func:`make_consortium`::

    out_dir/
      manifest.json
      mask.nii.gz
      site-01/sub-0001_bold.nii.gz ...   (.nii with compress=False)
      site-02/sub-0004_bold.nii.gz ...   (subject numbers unique consortium-wide)
      site-01/participants.tsv           group, age, sex per subject (effects only)
      truth/maps.nii.gz                  4-D, one volume per component
      truth/A.npy                        D x R float32, maps as columns
      truth/S_site-01_sub-0001.npy       R x T float32, one file per subject
      truth/states.npy                   K x R x R float32 planted connectivity states (states >= 2 only)
      truth/labels_site-01_sub-0001.npy  T int8 state label h_t per subject       (states >= 2 only)

With ``effects`` every site folder also holds ``participants.tsv`` (BIDS,
tab-separated: ``participant_id  group  age  sex``, one row per subject, ids
as ``load_site`` reports them, e.g. ``sub-0004``).

With states on, ``manifest["truth"]`` also holds ``n_states`` (K),
``states`` (path), ``state_labels`` (``{site: {subject id: path}}``) and
``state_model`` (``dwell`` in seconds per state, ``lowpass``, ``noise``, a
description).
With states off none of these keys exist (the manifest is byte-identical to
the one written before states existed): read ``truth.get("n_states", 0)``.

Planted group effects (optional, ``effects={...}``; off by default)
-------------------------------------------------------------------
``make_consortium(effects=...)`` makes every subject a "patient" or a
"control" with an age and a sex, plants connectivity (FNC) and amplitude
differences in the ground-truth sources (see the argument), writes each
site's ``participants.tsv`` and records in ``manifest["effects"]``:

- ``settings``: the arguments, defaults filled in (``patients`` one fraction
  per site, ``age`` [lo, hi], ``sex`` P(F), ``fnc_shift``,
  ``amplitude_age``, ``amplitude_group``);
- ``n_patients`` per site, ``participants`` (``{site: participants.tsv}``) and
  ``subjects`` (``[{site, id, group, age, sex}]`` in manifest order);
- ``fnc_shift``: per pair ``components`` [j, k], ``correlation_difference``
  (delta: patients' population correlation minus the controls'),
  ``fisher_z_difference`` (the mean over all subjects of
  ``atanh(r0 + delta) - atanh(r0)``, r0 the subject's correlation without
  the shift: blobs r0 = 0, so ``atanh(delta)``; networks r0 = C_m[j, k]),
  ``control_correlation`` (mean r0) and ``patient_correlation``. These are
  population values; a subject's sample correlation scatters around them
  (and the mean sample Fisher z has a small bias ~ r / (2 (T - 1)));
- ``amplitude_age``: per component ``log_amplitude_per_half_range`` (slope),
  ``log_amplitude_per_year`` (slope / half) and ``age_centre``; i.e. log std
  of S_k = base + log_amplitude_per_year * (age - age_centre), base 0 for
  blobs (unit-variance sources), the subject's log amplitude for networks;
- ``amplitude_group``: per component ``log_amplitude_difference`` (patients
  minus controls) and ``amplitude_ratio`` (its exp);
- ``description``.

Without effects (``effects=None``) neither the key nor the tables exist and
every file is byte for byte as before the option existed.

Paths inside ``manifest.json`` are relative to ``out_dir`` so the folder can
be moved; :func:`make_consortium` and :func:`load_manifest` return them
resolved to absolute paths.

Subjects are generated and written in parallel (``workers`` threads); each
one comes from its own random streams and is encoded on its own, so every
file is byte for byte the same for any number of workers.
"""

from __future__ import annotations

import io
import json
import struct
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import nibabel as nib
import numpy as np
from nibabel.arraywriters import get_slope_inter, make_array_writer
from scipy.fft import next_fast_len
from scipy.ndimage import gaussian_filter
from scipy.spatial import cKDTree

from dpneuro._utils.parallel import resolve_workers
from dpneuro._utils.progressbar import progress_bar
from dpneuro.algorithms.djica import whiten
from dpneuro.data.images import SPACES, load_space  # noqa: F401 - the generator's grids are the analysis spaces
from dpneuro.datasets.states import StateProcess, default_dwell, state_correlations
from dpneuro.privacy import default_rng, resolve_random_state

__all__ = [
    "make_consortium", "load_manifest", "garch_sources",
    "MODELS", "NETWORK_DEFAULTS", "NetworkModel", "network_model", "canonical_hrf",
]


#: Gaussian blob width (standard deviation) range, in voxels
_BLOB_SIGMA = {
    "grid30": (1.5, 3.0),
    "mni3mm": (8.0 / 3, 14.0 / 3),  # 8-14 mm
    "mni4mm": (8.0 / 4, 14.0 / 4),  # 8-14 mm
    "mni6mm": (8.0 / 6, 14.0 / 6),
}

_GARCH_OMEGA = 0.1
_GARCH_BURN_IN = 100
# keep alpha + beta below 1 so the process is stationary with finite variance
_GARCH_MAX_PERSISTENCE = 0.97

_MANIFEST_FORMAT = "dpneuro-synth-1"

#: the blobs model's white-noise std (make_consortium's noise=None)
_BLOBS_NOISE = 0.5

#: spawn keys of the state streams (maps/GARCH use (0,), subjects (1, site, subject))
_STATE_MATRIX_KEY = 2
_STATE_SEQUENCE_KEY = 3


# ---------------------------------------------------------------------------
# space / mask
# ---------------------------------------------------------------------------

# ---------------------------------------------------------------------------
# ground truth
# ---------------------------------------------------------------------------

def _spatial_maps(
    mask: np.ndarray, n_components: int, sigma_range: tuple[float, float],
    rng: np.random.Generator,
) -> np.ndarray:
    """D x R maps: 1-3 truncated Gaussian blobs per component, unit max.

    Blob centres are random in-mask voxels, so maps overlap partly; each
    blob is cut at 3 sigma so maps are sparse (zero far from their blobs).
    """
    coords = np.argwhere(mask).astype(np.float64)  # D x 3, C order = mask[mask]
    D = coords.shape[0]
    A = np.zeros((D, n_components))
    for r in range(n_components):
        n_blobs = int(rng.integers(1, 4))
        centres = coords[rng.choice(D, size=n_blobs, replace=False)]
        sigmas = rng.uniform(*sigma_range, size=n_blobs)
        amps = rng.uniform(0.5, 1.0, size=n_blobs)
        for c, s, a in zip(centres, sigmas, amps):
            d2 = ((coords - c) ** 2).sum(axis=1)
            blob = a * np.exp(-d2 / (2 * s * s))
            blob[d2 > (3 * s) ** 2] = 0.0
            A[:, r] += blob
        A[:, r] /= A[:, r].max()
    return A


def _garch_params(n_components: int, rng: np.random.Generator) -> dict:
    # alpha in [0.2, 0.3] and persistence alpha + beta in [0.8, 0.9] keep the fourth moment finite
    # ((alpha + beta)^2 + 2 alpha^2 < 1) with kurtosis >= ~3.9: every source is clearly non-Gaussian,
    # as ICA needs (near-Gaussian sources cannot be separated from a few thousand samples)
    alpha = rng.uniform(0.2, 0.3, n_components)
    beta = rng.uniform(0.8, 0.9, n_components) - alpha
    beta = np.minimum(beta, _GARCH_MAX_PERSISTENCE - alpha)
    return {"omega": _GARCH_OMEGA, "alpha": alpha, "beta": beta}


def garch_sources(
    n_timepoints: int,
    alpha: np.ndarray,
    beta: np.ndarray,
    random_state=None,
    *,
    omega: float = _GARCH_OMEGA,
    burn_in: int = _GARCH_BURN_IN,
) -> np.ndarray:
    """GARCH(1,1) source time courses, standardised per row.

    ``e_t = sqrt(h_t) z_t``, ``h_t = omega + alpha e_{t-1}^2 + beta h_{t-1}``
    with Gaussian ``z_t``, one independent process per component.

    Parameters
    ----------
    n_timepoints : int
        Samples to return (after discarding `burn_in`).
    alpha, beta : ndarray, shape (R,)
        Per-component GARCH coefficients, ``alpha + beta < 1``.
    random_state : None, int or numpy.random.Generator
        Source of the innovations (a Generator is used as it is).
    omega : float
    burn_in : int
        Initial samples discarded so the start value does not matter.

    Returns
    -------
    ndarray, shape (R, n_timepoints), float64
        Each row has zero mean and unit variance (population, ddof=0).
    """
    alpha = np.asarray(alpha, dtype=np.float64)
    beta = np.asarray(beta, dtype=np.float64)
    if np.any(alpha + beta >= 1):
        raise ValueError("GARCH needs alpha + beta < 1 for a stationary process")
    n_total = n_timepoints + burn_in
    z = default_rng(random_state).standard_normal((alpha.size, n_total))
    h = np.full(alpha.size, omega / (1.0 - alpha - beta))  # unconditional variance
    e_prev2 = h.copy()
    out = np.empty((alpha.size, n_total))
    for t in range(n_total):
        h = omega + alpha * e_prev2 + beta * h
        out[:, t] = np.sqrt(h) * z[:, t]
        e_prev2 = out[:, t] ** 2
    return _standardise_rows(out[:, burn_in:])


# ---------------------------------------------------------------------------
# the "networks" model: distributed resting-state networks, BOLD time courses
# ---------------------------------------------------------------------------

#: the generative models :func:`make_consortium` knows (see the module docstring)
MODELS = ("blobs", "networks")

#: spawn keys of the network model's streams (blobs: 0 maps/GARCH, 1 subjects; states: 2, 3):
#: (4, 0) maps, (4, 1) group correlation, (4, 2) global-signal weight, (5, site, subject) one per subject
_NETWORK_KEY = 4
_NETWORK_SUBJECT_KEY = 5

#: region width (Gaussian sd) in mm; grid30's identity affine makes one "mm" one voxel of a 30 x 30 grid,
#: where 5-9 would cover the whole grid: 1.2-2 voxels keeps 2-4 regions and their mirrors apart there
_NET_SIGMA = {"mni3mm": (5.0, 9.0), "mni4mm": (5.0, 9.0), "mni6mm": (5.0, 9.0), "grid30": (1.2, 2.0)}
#: smoothing sd (mm) of the structured-noise maps and of the global signal's spatial weight
_NET_PHYSIO_SMOOTH = {"mni3mm": (2.0, 8.0), "mni4mm": (2.0, 8.0), "mni6mm": (2.0, 8.0), "grid30": (0.5, 2.0)}
_NET_GLOBAL_SMOOTH = {"mni3mm": 25.0, "mni4mm": 25.0, "mni6mm": 25.0, "grid30": 6.0}
#: a region is cut at this many sd: the profile is down to exp(-3.125) = 4% of its peak there, so the
#: cut is barely visible, and the maps are exactly zero (sparse) away from their regions
_NET_TRUNCATE = 2.5
_NET_REGIONS = (2, 4)
_NET_AMPLITUDE = (0.5, 1.0)
_NET_P_BILATERAL = 0.7
_NET_P_NEGATIVE = 0.3
#: candidate centres drawn at once when placing a region, and how many batches the first regions may use
_NET_CANDIDATES = 64
_NET_PLACEMENT_BATCHES = 50
#: global-signal spatial weight range (smooth field rescaled into it)
_NET_GLOBAL_WEIGHT = (0.5, 1.0)
#: the per-subject random correlation W_m is the correlation of R x (R + this) Gaussian draws
_NET_WISHART_EXTRA = 10
#: canonical HRF length (s) and the time grid it is averaged on within one TR
_HRF_LENGTH = 32.0
_HRF_MICROTIME = 16

#: defaults of the parameters :func:`network_model` accepts (see the module docstring for the reasons)
NETWORK_DEFAULTS = {
    "noise": 0.8,
    "global_amplitude": 0.25,
    "n_physio": 5,
    "physio_amplitude": 0.3,
    "n_factors": 4,
    "factor_loading": 0.6,
    "subject_mix": 0.3,
    "amplitude_sigma": 0.3,
    "strength_sigma": 0.7,
    "spectral_exponent": 1.0,
}


def canonical_hrf(tr: float, length: float = _HRF_LENGTH) -> np.ndarray:
    """The canonical (SPM) double-gamma haemodynamic response sampled at the repetition time.

    ``h(t) = g(t; 6) - g(t; 16) / 6`` with ``g(t; k)`` the gamma density of shape k and unit scale:
    a peak at 5 s, an undershoot peaking at 15 s, one sixth as high. Each sample is the mean of
    ``h`` over its TR (16 points per TR), the response to a neural signal held constant within a
    TR; the samples sum to 1.

    Parameters
    ----------
    tr : float
        Repetition time in seconds (> 0).
    length : float, default 32.0
        Seconds covered.

    Returns
    -------
    ndarray, shape (ceil(length / tr),), float64
    """
    from scipy.stats import gamma  # deferred: scipy.stats takes about 0.3 s to load

    tr = _check_tr(tr)
    n = max(1, int(np.ceil(length / tr)))
    t = (np.arange(n * _HRF_MICROTIME) + 0.5) * (tr / _HRF_MICROTIME)
    h = gamma.pdf(t, 6.0) - gamma.pdf(t, 16.0) / 6.0
    h = h.reshape(n, _HRF_MICROTIME).mean(axis=1)
    return h / h.sum()


def _cov2corr(C: np.ndarray) -> np.ndarray:
    d = np.sqrt(np.diag(C))
    out = C / np.outer(d, d)
    np.fill_diagonal(out, 1.0)
    return out


def _standardise_rows(Y: np.ndarray) -> np.ndarray:
    Y = Y - Y.mean(axis=1, keepdims=True)
    std = Y.std(axis=1, keepdims=True)
    std[std == 0] = 1.0
    return Y / std


def _mirror_index(coords_mm: np.ndarray, midline_x: float) -> np.ndarray:
    """For every in-mask voxel the in-mask voxel nearest to its mirror image across x = midline_x."""
    mirrored = coords_mm.copy()
    mirrored[:, 0] = 2.0 * midline_x - mirrored[:, 0]
    return cKDTree(coords_mm).query(mirrored)[1].astype(np.int64)


def _separated(cands: np.ndarray, radius: float, centres: np.ndarray, radii: np.ndarray, gap: float) -> np.ndarray:
    """Which candidate centres keep a ball of `radius` more than `gap` away from every placed ball."""
    if len(centres) == 0:
        return np.ones(len(cands), dtype=bool)
    d = np.sqrt(((cands[:, None, :] - centres[None, :, :]) ** 2).sum(axis=2))
    return (d > radius + radii[None, :] + gap).all(axis=1)


def _network_maps(
    coords_mm: np.ndarray, mirror: np.ndarray, n_components: int, sigma_range: tuple[float, float],
    gap: float, rng: np.random.Generator,
) -> tuple[np.ndarray, list[list[dict]]]:
    """D x R network maps (unit max |value|) and, per network, its regions (see the module docstring).

    Regions of one network (a region and its mirror count together) are placed so that their supports
    stay more than `gap` mm apart: every network has as many separate pieces as regions placed. The
    first two regions get up to 50 batches of 64 candidate centres (in practice the first batch
    suffices); a later region that finds no room in one batch is dropped.
    """
    D = coords_mm.shape[0]
    A = np.zeros((D, n_components))
    networks = []
    for r in range(n_components):
        n_regions = int(rng.integers(_NET_REGIONS[0], _NET_REGIONS[1] + 1))
        centres = np.empty((0, 3))
        radii = np.empty(0)
        blobs, regions = [], []
        for j in range(n_regions):
            sigma = float(rng.uniform(*sigma_range))
            amp = float(rng.uniform(*_NET_AMPLITUDE))
            bilateral = bool(rng.random() < _NET_P_BILATERAL)
            radius = _NET_TRUNCATE * sigma
            chosen = None
            for _ in range(_NET_PLACEMENT_BATCHES if j < _NET_REGIONS[0] else 1):
                cand = rng.integers(D, size=_NET_CANDIDATES)
                ok = _separated(coords_mm[cand], radius, centres, radii, gap)
                if bilateral:
                    ok &= _separated(coords_mm[mirror[cand]], radius, centres, radii, gap)
                if ok.any():
                    chosen = int(cand[np.argmax(ok)])
                    break
            if chosen is None:
                continue
            where = [chosen, int(mirror[chosen])] if bilateral else [chosen]
            blob = np.zeros(D)
            for c in where:
                d2 = ((coords_mm - coords_mm[c]) ** 2).sum(axis=1)
                # a region and its mirror may meet at the midline: their union, not their sum
                blob = np.maximum(blob, np.where(d2 <= radius * radius, amp * np.exp(-d2 / (2 * sigma * sigma)), 0.0))
            centres = np.vstack([centres, coords_mm[where]])
            radii = np.r_[radii, [radius] * len(where)]
            blobs.append(blob)
            regions.append({"centre_mm": coords_mm[chosen].tolist(), "sigma_mm": sigma, "amplitude": amp,
                            "bilateral": bilateral, "sign": 1})
            if bilateral:
                regions[-1]["mirror_mm"] = coords_mm[where[1]].tolist()
        if rng.random() < _NET_P_NEGATIVE and len(regions) >= 2:
            j = int(rng.integers(1, len(regions)))
            regions[j]["sign"] = -1
        col = sum(reg["sign"] * b for reg, b in zip(regions, blobs))
        peak = float(np.abs(col).max())
        A[:, r] = col / peak
        for reg in regions:
            reg["amplitude"] /= peak
        networks.append(regions)
    return A, networks


def _smooth_fields(rng: np.random.Generator, mask: np.ndarray, sigma_vox: np.ndarray) -> np.ndarray:
    """D x n Gaussian-smoothed white-noise fields over the mask voxels, zero mean and unit rms each.

    `sigma_vox` is n x 3: the smoothing sd of each field along each axis, in voxels.
    """
    n = len(sigma_vox)
    vol = rng.standard_normal((n,) + mask.shape, dtype=np.float32)
    out = np.empty((int(mask.sum()), n), dtype=np.float32)
    for k in range(n):
        f = gaussian_filter(vol[k], sigma_vox[k], mode="nearest", truncate=3.0)[mask]
        f -= f.mean()
        rms = np.sqrt(np.mean(f * f))
        out[:, k] = f / rms if rms > 0 else f
    return out


@dataclass(eq=False)
class NetworkModel:
    """The realistic "networks" generative model, group part fixed; :meth:`subject` draws subjects.

    Built by :func:`network_model`; ``make_consortium(model="networks")`` writes exactly
    ``subject(site, subject, T, tr)`` for every subject.

    Attributes
    ----------
    mask : ndarray of bool, 3-D
    affine : ndarray, shape (4, 4)
    A : ndarray, shape (D, R), float32
        The network maps over the mask voxels (``np.argwhere(mask)`` order), unit max |value|.
    correlation : ndarray, shape (R, R), float64
        The group correlation C of the network time courses (before the subject's perturbation).
    strength : ndarray, shape (R,), float64
        The networks' group strengths (lognormal), multiplying every subject's time courses.
    global_weight : ndarray, shape (D,), float32
        Smooth spatial weight of the global signal, in [0.5, 1].
    regions : list of list of dict
        Per network its regions: ``centre_mm``, ``sigma_mm``, ``amplitude`` (after the map's scaling to
        unit max), ``bilateral`` (then also ``mirror_mm``, the snapped mirror centre) and ``sign``.
    params : dict
        Every parameter (JSON-serialisable): :data:`NETWORK_DEFAULTS` overridden by the caller, plus the
        fixed map parameters.
    random_state : int
        The master seed.
    space : str or None
        The space name, None for a custom mask.
    """

    mask: np.ndarray
    affine: np.ndarray
    A: np.ndarray
    correlation: np.ndarray
    strength: np.ndarray
    global_weight: np.ndarray
    regions: list
    params: dict
    random_state: int
    space: str | None = None
    _per_mm: np.ndarray = field(default=None, repr=False)
    _filters: dict = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return (f"NetworkModel(space={self.space!r}, n_voxels={self.n_voxels}, n_components={self.n_components}, "
                f"random_state={self.random_state}, noise={self.noise})")

    @property
    def n_voxels(self) -> int:
        return int(self.A.shape[0])

    @property
    def n_components(self) -> int:
        return int(self.A.shape[1])

    @property
    def noise(self) -> float:
        return float(self.params["noise"])

    def _spectra(self, T: int, tr: float) -> tuple[int, np.ndarray, np.ndarray]:
        """FFT length, the BOLD filter (1/f^(beta/2) x HRF) and the 1/f^(beta/2) filter, cached per (T, tr)."""
        key = (T, tr)
        if key not in self._filters:
            hrf = canonical_hrf(tr)
            n = next_fast_len(2 * T + hrf.size)
            f = np.fft.rfftfreq(n, d=tr)
            pink = np.zeros_like(f)
            pink[1:] = f[1:] ** (-self.params["spectral_exponent"] / 2.0)
            self._filters[key] = (n, pink * np.fft.rfft(hrf, n), pink)
        return self._filters[key]

    def subject_correlation(self, site_index: int, subject_index: int) -> np.ndarray:
        """The population correlation ``C_m`` of one subject's network time courses (R x R, float64).

        ``(1 - subject_mix) C + subject_mix W_m`` with ``W_m`` from the first draws of the subject's
        stream: what :meth:`subject` mixes its white noise with (the HRF and the 1/f filter, the same for
        every network, keep it).
        """
        s = _check_int(site_index, "site_index", 0)
        m = _check_int(subject_index, "subject_index", 0)
        return self._correlation(self._stream(s, m))

    def _stream(self, s: int, m: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(self.random_state, spawn_key=(_NETWORK_SUBJECT_KEY, s, m)))

    def _correlation(self, rng: np.random.Generator) -> np.ndarray:
        """The subject's correlation C_m: the group C mixed with a random correlation matrix (both PD)."""
        R = self.n_components
        G = rng.standard_normal((R, R + _NET_WISHART_EXTRA))
        mix = self.params["subject_mix"]
        return (1.0 - mix) * self.correlation + mix * _cov2corr(G @ G.T)

    def subject(self, site_index: int, subject_index: int, n_timepoints: int = 150,
                tr: float = 2.0, *, correlation_shift: np.ndarray | None = None,
                log_amplitude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One subject's data and network time courses (its own seed stream, see the module docstring).

        Parameters
        ----------
        site_index, subject_index : int
            0-based site and subject-within-site (``make_consortium``'s ``site-01/sub-0001`` is (0, 0)).
        n_timepoints : int, default 150
        tr : float, default 2.0
            Repetition time (s): sets the HRF sampling and the frequencies of the 1/f spectra.
        correlation_shift : ndarray, shape (R, R), optional
            Symmetric, zero diagonal: added to the subject's correlation ``C_m`` before its Cholesky
            factor mixes the white noise, so the network time courses' population correlation is exactly
            ``C_m + correlation_shift`` (a planted connectivity difference; must stay positive definite).
        log_amplitude : ndarray, shape (R,), optional
            Added to the log of every network's amplitude (planted amplitude effects). Neither changes
            a random draw: with both None (the default) the subject is exactly as before they existed.

        Returns
        -------
        X : ndarray, shape (D, T), float32
            ``A S + global + structured noise + noise * N(0, 1)`` over the mask voxels.
        S : ndarray, shape (R, T), float32
            The network time courses, each row standardised then scaled by the subject's amplitude.
        """
        s = _check_int(site_index, "site_index", 0)
        m = _check_int(subject_index, "subject_index", 0)
        T = _check_int(n_timepoints, "n_timepoints", 3)
        tr = _check_tr(tr)
        p = self.params
        R, D, K = self.n_components, self.n_voxels, int(p["n_physio"])
        rng = self._stream(s, m)
        n, bold, pink = self._spectra(T, tr)
        C_m = self._correlation(rng)
        if correlation_shift is not None:
            C_m = C_m + correlation_shift
        try:
            L = np.linalg.cholesky(C_m)
        except np.linalg.LinAlgError:
            raise ValueError(f"subject ({s}, {m}): its correlation plus correlation_shift is not positive "
                             "definite (a smaller shift is needed)") from None
        amp = self.strength * rng.lognormal(0.0, p["amplitude_sigma"], R)
        if log_amplitude is not None:
            amp = amp * np.exp(log_amplitude)
        # white noise -> correlated across networks -> 1/f spectrum (x HRF for the BOLD signals)
        white = rng.standard_normal((R + 1 + K, n))
        white[:R] = L @ white[:R]
        spec = np.fft.rfft(white, axis=1)
        spec[:R + 1] *= bold
        spec[R + 1:] *= pink
        tc = _standardise_rows(np.fft.irfft(spec, n=n, axis=1)[:, :T])
        S = (amp[:, None] * tc[:R]).astype(np.float32)
        X = self.A @ S
        if p["global_amplitude"] > 0:
            X += np.outer(self.global_weight, (p["global_amplitude"] * tc[R]).astype(np.float32))
        if K and p["physio_amplitude"] > 0:
            # each structured-noise map smoothed at its own scale, log-uniform over the range
            lo, hi = np.log(p["physio_smoothing_mm"])
            scales = np.exp(rng.uniform(lo, hi, K))
            maps = _smooth_fields(rng, self.mask, scales[:, None] * self._per_mm[None, :])
            X += maps @ (p["physio_amplitude"] * tc[R + 1:]).astype(np.float32)
        if p["noise"] > 0:
            X += np.float32(p["noise"]) * rng.standard_normal((D, T), dtype=np.float32)
        return X, S


def network_model(space_or_mask, n_components: int = 20, random_state=0, **params) -> NetworkModel:
    """The "networks" model's group part: maps, group correlation, global-signal weight.

    Parameters
    ----------
    space_or_mask : str or (mask, affine)
        A space name (``"mni3mm"``, ``"mni4mm"``, ``"mni6mm"``, ``"grid30"``, see :func:`load_space`) or a boolean
        3-D mask with its affine (regions 5-9 mm, mirrored through world x = 0).
    n_components : int, default 20
        Number R of networks.
    random_state : None, int or numpy Generator, default 0
        Master seed (a Generator gives it by one draw, None by OS entropy); the same seed as
        :func:`make_consortium` gives the same maps and subjects.
    **params
        Overrides of :data:`NETWORK_DEFAULTS`: ``noise`` (white noise sd), ``global_amplitude``,
        ``n_physio``, ``physio_amplitude``, ``n_factors``, ``factor_loading``, ``subject_mix``,
        ``amplitude_sigma``, ``spectral_exponent``. The maps depend only on the mask, R and the
        seed; the group correlation also on ``n_factors`` and ``factor_loading``.

    Returns
    -------
    NetworkModel
    """
    if isinstance(space_or_mask, str):
        if space_or_mask not in SPACES:
            raise ValueError(f"unknown space {space_or_mask!r}; choose one of {', '.join(SPACES)}")
        space = space_or_mask
        mask, affine = load_space(space)
    else:
        try:
            mask, affine = space_or_mask
        except (TypeError, ValueError):
            raise ValueError("space_or_mask must be a space name or a (mask, affine) pair") from None
        space = None
        mask = np.asarray(mask).astype(bool)
        affine = np.asarray(affine, dtype=np.float64)
        if mask.ndim != 3 or affine.shape != (4, 4):
            raise ValueError(f"need a 3-D mask and a 4 x 4 affine, got shapes {mask.shape} and {affine.shape}")
    R = _check_int(n_components, "n_components", 1)
    seed = resolve_random_state(random_state, fresh=True)
    p = _network_params(params)
    D = int(mask.sum())
    if R > D:
        raise ValueError(f"n_components ({R}) exceeds the {D} mask voxels")

    vox = np.sqrt((affine[:3, :3] ** 2).sum(axis=0))
    coords_mm = np.argwhere(mask) @ affine[:3, :3].T + affine[:3, 3]
    if space == "grid30":  # a 2-D grid: its own middle
        midline = float(coords_mm[:, 0].min() + coords_mm[:, 0].max()) / 2.0
    else:  # MNI: the mid-sagittal plane
        midline = 0.0
    sigma_range = _NET_SIGMA.get(space, _NET_SIGMA["mni4mm"])
    gap = 2.0 * float(vox.max())  # > sqrt(3) voxels: separate regions never touch (26-connectivity)

    def stream(k: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_NETWORK_KEY, k)))

    mirror = _mirror_index(coords_mm, midline)
    A, regions = _network_maps(coords_mm, mirror, R, sigma_range, gap, stream(0))

    # group correlation from a few shared factors: C = corr(F F^T + I), positive definite
    F = stream(1).normal(0.0, p["factor_loading"], (R, p["n_factors"]))
    C = _cov2corr(F @ F.T + np.eye(R))

    # group strength of every network (some networks are stronger than others in every subject)
    strength = stream(3).lognormal(0.0, p["strength_sigma"], R)

    per_mm = np.where(np.array(mask.shape) > 1, 1.0 / vox, 0.0)  # smoothing sd in voxels per mm (0: flat axis)
    smooth = _NET_GLOBAL_SMOOTH.get(space, _NET_GLOBAL_SMOOTH["mni4mm"])
    g = _smooth_fields(stream(2), mask, smooth * per_mm[None, :])[:, 0]
    lo, hi = _NET_GLOBAL_WEIGHT
    g = (lo + hi) / 2 + (hi - lo) / 2 * g / max(float(np.abs(g).max()), 1e-12)

    physio_smooth = _NET_PHYSIO_SMOOTH.get(space, _NET_PHYSIO_SMOOTH["mni4mm"])
    p.update({
        "regions_per_network": list(_NET_REGIONS),
        "region_sigma_mm": list(sigma_range),
        "region_truncate_sd": _NET_TRUNCATE,
        "region_amplitude": list(_NET_AMPLITUDE),
        "p_bilateral": _NET_P_BILATERAL,
        "p_negative": _NET_P_NEGATIVE,
        "midline_x_mm": midline,
        "region_gap_mm": gap,
        "global_weight": list(_NET_GLOBAL_WEIGHT),
        "global_smoothing_mm": smooth,
        "physio_smoothing_mm": list(physio_smooth),
        "hrf": "SPM double gamma: gamma(6) - gamma(16)/6 (peak 5 s, undershoot 15 s), 32 s, averaged per TR",
    })
    return NetworkModel(mask=mask, affine=affine, A=A.astype(np.float32), correlation=C, strength=strength,
                        global_weight=g.astype(np.float32), regions=regions, params=p, random_state=seed,
                        space=space, _per_mm=per_mm)


def _network_params(params: dict) -> dict:
    unknown = sorted(set(params) - set(NETWORK_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown network-model parameter(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(NETWORK_DEFAULTS)}")
    p = dict(NETWORK_DEFAULTS)
    for key, value in params.items():
        if value is None:
            continue
        if key in ("n_physio", "n_factors"):
            p[key] = _check_int(value, key, 0)
            continue
        v = _check_float(value, key)
        if key == "subject_mix" and not 0.0 <= v < 1.0:
            raise ValueError(f"subject_mix must be in [0, 1), got {value!r}")
        if v < 0:
            raise ValueError(f"{key} must be >= 0, got {value!r}")
        p[key] = v
    return p


# ---------------------------------------------------------------------------
# NIfTI helpers
# ---------------------------------------------------------------------------

def _nifti(data: np.ndarray, affine: np.ndarray, space: str, tr: float | None) -> nib.Nifti1Image:
    img = nib.Nifti1Image(data, affine)
    code = "mni" if space.startswith("mni") else "aligned"
    img.header.set_sform(affine, code=code)
    img.header.set_qform(affine, code=code)
    img.header.set_xyzt_units("mm", "sec")
    if tr is not None and data.ndim == 4:
        zooms = tuple(float(z) for z in img.header.get_zooms()[:3])
        img.header.set_zooms(zooms + (float(tr),))
    return img


def _to_volume(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Paint D x T values into a float32 volume of shape mask.shape + (T,)."""
    # Fortran order is NIfTI's on-disk order: saves a transposed copy when writing
    vol = np.zeros(mask.shape + values.shape[1:], dtype=np.float32, order="F")
    vol[mask] = values
    return vol


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------

def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_float(value, name: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not np.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def _check_tr(value) -> float:
    out = _check_float(value, "tr")
    if out <= 0:
        raise ValueError(f"tr must be a positive number of seconds, got {value!r}")
    return out


def _per_site(value, n_sites: int, name: str, minimum: int) -> list[int]:
    """One integer per site: ``value`` for every site, or its list of one per site."""
    if isinstance(value, (list, tuple, np.ndarray)):
        values = list(value)
        if len(values) != n_sites:
            raise ValueError(f"{name} lists {len(values)} sites but n_sites is {n_sites}")
    else:
        values = [value] * n_sites
    return [_check_int(v, name, minimum) for v in values]


# ---------------------------------------------------------------------------
# main entry point
# ---------------------------------------------------------------------------

def _relative(manifest: dict, root: Path) -> dict:
    """Copy of a resolved manifest with paths relative to `root` (for JSON)."""
    def rel(p: str) -> str:
        return Path(p).relative_to(root).as_posix()

    out = json.loads(json.dumps(manifest))
    out.pop("manifest_path", None)
    out.pop("root", None)
    out["mask"] = rel(out["mask"])
    for site in out["sites"]:
        site["path"] = rel(site["path"])
        for sub in site["subjects"]:
            sub["path"] = rel(sub["path"])
            sub["sources"] = rel(sub["sources"])
    for key in ("maps", "A"):
        out["truth"][key] = rel(out["truth"][key])
    _map_state_paths(out["truth"], rel)
    _map_participants(out, rel)
    return out


def _map_state_paths(truth: dict, fn) -> None:
    """Apply `fn` in place to the brain-state paths of a manifest's truth (if states are on)."""
    if "states" in truth:
        truth["states"] = fn(truth["states"])
    for subjects in truth.get("state_labels", {}).values():
        for sub_id in subjects:
            subjects[sub_id] = fn(subjects[sub_id])


def _map_participants(manifest: dict, fn) -> None:
    """Apply `fn` in place to the participants.tsv paths of a manifest (if effects are planted)."""
    tables = manifest.get("effects", {}).get("participants", {})
    for site in tables:
        tables[site] = fn(tables[site])


def _state_files(truth: dict) -> list[str]:
    labels = [p for subjects in truth.get("state_labels", {}).values() for p in subjects.values()]
    return ([truth["states"]] if "states" in truth else []) + labels


def _previous_files(out_dir: Path) -> set[Path]:
    """Files written by an earlier run into `out_dir`, from its manifest."""
    path = out_dir / "manifest.json"
    if not path.is_file():
        return set()
    try:
        old = load_manifest(path)
    except (ValueError, KeyError, OSError):
        return set()
    files = {Path(old["mask"]), Path(old["truth"]["maps"]), Path(old["truth"]["A"])}
    files.update(Path(p) for p in _state_files(old["truth"]))
    files.update(Path(p) for p in old.get("effects", {}).get("participants", {}).values())
    for site in old["sites"]:
        for sub in site["subjects"]:
            files.update({Path(sub["path"]), Path(sub["sources"])})
    # only ever delete inside out_dir
    root = out_dir.resolve()
    return {f for f in files if f.resolve().is_relative_to(root)}


@dataclass(eq=False)
class _BlobsModel:
    """The blobs model's group part (maps, GARCH parameters, optional planted dFNC states), for
    :func:`_subject_data`."""

    A: np.ndarray
    garch: dict
    noise: float
    seed: int
    states: StateProcess | None = None


def _subject_data(
    model: _BlobsModel | NetworkModel, s_idx: int, m_idx: int, n_timepoints: int, tr: float,
    effect: _SubjectEffect | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One subject of either model: X (D x T float32), S (R x T float32) and its state labels (or None).

    Blobs: GARCH sources from the subject's stream (1, site, subject), or with states the planted states'
    sources and labels from their own stream (3, site, subject); white noise from the subject's stream
    (1, site, subject) after the GARCH draws either way. Networks:
    :meth:`NetworkModel.subject` (stream (5, site, subject)). A planted `effect` (make_consortium's
    ``effects``, not with states) changes the sources before they are mixed into voxels, and no draw.
    """
    if isinstance(model, NetworkModel):
        if effect is None:
            X, S = model.subject(s_idx, m_idx, n_timepoints, tr)
        else:
            X, S = model.subject(s_idx, m_idx, n_timepoints, tr, correlation_shift=effect.shift,
                                 log_amplitude=effect.log_amplitude)
        return X, S, None
    garch, labels = model.garch, None
    rng = np.random.default_rng(np.random.SeedSequence(model.seed, spawn_key=(1, s_idx, m_idx)))
    S = garch_sources(n_timepoints, garch["alpha"], garch["beta"], rng, omega=garch["omega"])
    if model.states is not None:
        label_rng = np.random.default_rng(
            np.random.SeedSequence(model.seed, spawn_key=(_STATE_SEQUENCE_KEY, s_idx, m_idx))
        )
        S, labels = model.states.subject(n_timepoints, label_rng)
    if effect is not None:
        S = _apply_blobs_effect(S, effect)
    S = S.astype(np.float32)
    X = model.A @ S  # float32, D x T
    if model.noise > 0:
        X += np.float32(model.noise) * rng.standard_normal(X.shape, dtype=np.float32)
    return X, S, labels


#: gzip level of the BOLD images (nibabel's default too). Measured on one mni4mm int16 subject of 150
#: volumes (42 MB raw): levels 1-3 give 9.4-9.3 MB in the same time, 6 gives 9.0 MB in 40% more time;
#: the in-brain noise barely compresses at any level
_GZIP_LEVEL = 1
#: the gzip header Python's gzip module (so nib.save) writes: no name, mtime 0, "fastest" at level 1, OS
#: unknown; with the same deflate stream the .nii.gz files are byte for byte those nib.save wrote
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00" + (b"\x04" if _GZIP_LEVEL == 1 else b"\x00") + b"\xff"


@dataclass
class _SubjectJob:
    """Where one subject goes: (site, subject-in-site) indices and its output files."""

    site: int
    subject: int
    bold: Path
    sources: Path
    timepoints: int
    labels: Path | None = None
    effect: _SubjectEffect | None = None


@dataclass(eq=False)
class _SubjectWriter:
    """Generates and writes one subject (:meth:`__call__`); shared read-only by the worker threads.

    The image is encoded without building a float volume: nibabel scales the D x T mask values (the
    file's slope and intercept come from the same minimum and maximum as for the whole volume, whose
    other voxels are 0) and they are scattered into the on-disk layout. The bytes are exactly those
    ``nib.save`` writes for the full volume.
    """

    model: _BlobsModel | NetworkModel
    mask: np.ndarray
    affine: np.ndarray
    space: str
    tr: float
    dtype: str
    compress: bool

    def __post_init__(self):
        # NIfTI stores x fastest: a volume is C-ordered (z, y, x), its in-mask voxels in the order of
        # mask.T; this permutation takes the rows of X (np.argwhere order) to that order
        self._mask_zyx = np.ascontiguousarray(self.mask.T)
        self._order = np.argsort(np.ravel_multi_index(np.nonzero(self.mask), self.mask.shape, order="F"))
        self._outside = not self.mask.all()

    def __call__(self, job: _SubjectJob) -> None:
        X, S, labels = _subject_data(self.model, job.site, job.subject, job.timepoints, self.tr, job.effect)
        header, data = self._encode(X)
        del X
        with open(job.bold, "wb") as f:
            if self.compress:
                z = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)  # raw deflate
                f.write(_GZIP_HEADER)
                f.write(z.compress(header))
                f.write(z.compress(data))
                f.write(z.flush())
                crc = zlib.crc32(data, zlib.crc32(header))
                f.write(struct.pack("<II", crc, (len(header) + data.nbytes) & 0xFFFFFFFF))
            else:
                f.write(header)
                f.write(data)
        np.save(job.sources, S)
        if labels is not None:
            np.save(job.labels, labels.astype(np.int8))

    def _encode(self, X: np.ndarray) -> tuple[bytes, np.ndarray]:
        """The NIfTI header (padded to the data offset) and the data, a C-ordered (T, z, y, x) array."""
        out = np.dtype(self.dtype)
        if out == X.dtype:  # float32 kept as is: no scaling
            writer = make_array_writer(X.reshape(-1), out, True, True)
            coded, fill = X, 0
        else:
            values = X.reshape(-1)
            if self._outside:  # the zeros outside the mask count for the range
                values = np.append(values, np.float32(0))
            writer = make_array_writer(values, out, True, True)  # what nib.save uses, same min and max
            buf = io.BytesIO()
            writer.to_fileobj(buf)
            coded = np.frombuffer(buf.getvalue(), dtype=out)
            fill = coded[-1] if self._outside else 0
            coded = coded[:X.size].reshape(X.shape)
        T = X.shape[1]
        data = np.full((T,) + self._mask_zyx.shape, fill, dtype=out)
        data[:, self._mask_zyx] = coded[self._order].T
        # header as nibabel's to_file_map makes it; np.empty allocates no memory until touched
        img = _nifti(np.empty(self.mask.shape + (T,), dtype=np.float32), self.affine, self.space, self.tr)
        img.update_header()
        hdr = img.header
        hdr.set_data_dtype(out)
        hdr.set_slope_inter(*get_slope_inter(writer))
        buf = io.BytesIO()
        hdr.write_to(buf)
        head = buf.getvalue()
        return head + bytes(int(hdr.get_data_offset()) - len(head)), data


def _write_subjects(writer: _SubjectWriter, jobs: list[_SubjectJob], workers: int, progress: bool) -> None:
    """Run `writer` on every job, `workers` at a time, with a progress bar over subjects.

    Threads, not processes: numpy's random generators, BLAS, nibabel's scaling and zlib release the GIL,
    so two threads ran as fast as two processes (measured), without copying the model to each process.
    """

    workers = min(workers, len(jobs))
    if isinstance(writer.model, NetworkModel):
        for T in sorted({job.timepoints for job in jobs}):  # fill the filter cache before threads share it
            writer.model._spectra(T, writer.tr)
    with progress_bar(total=len(jobs), desc="synth", unit="subject", enabled=progress) as bar:
        if workers <= 1:
            for job in jobs:
                writer(job)
                bar.update(1)
            return
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dpneuro-synth")
        try:
            futures = [pool.submit(writer, job) for job in jobs]
            for done in as_completed(futures):
                done.result()  # a worker's error is raised here
                bar.update(1)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)


def _network_manifest(model: NetworkModel) -> dict:
    """The network model's parameters and group truth for ``manifest["truth"]["networks"]``."""
    return {
        **model.params,
        "strength": model.strength.tolist(),
        "correlation": model.correlation.tolist(),
        "regions": model.regions,
    }


# ---------------------------------------------------------------------------
# planted group effects (make_consortium's ``effects``)
# ---------------------------------------------------------------------------

#: spawn keys of the subjects' covariates: (6, site) chooses the site's patients, (6, site, subject)
#: draws the subject's age and sex (disjoint from every other stream: no other draw changes)
_EFFECTS_KEY = 6

#: the ``effects`` settings and their defaults ("sex" is the probability of "F")
_EFFECT_DEFAULTS = {"patients": 0.5, "age": [20.0, 70.0], "sex": 0.5,
                    "fnc_shift": [], "amplitude_age": [], "amplitude_group": []}


@dataclass(frozen=True)
class _SubjectEffect:
    """One subject's planted effects: the correlation shift (patients with an FNC shift only, else None)
    and the log-amplitude change of every source (None: none)."""

    shift: np.ndarray | None = None
    log_amplitude: np.ndarray | None = None


def _component(value, n_components: int, name: str) -> int:
    k = _check_int(value, name, 0)
    if k >= n_components:
        raise ValueError(f"{name} must be a component index < n_components ({n_components}), got {k}")
    return k


def _check_effects(effects, n_sites: int, n_components: int) -> dict:
    """The ``effects`` settings validated, defaults filled in (JSON-ready: plain lists and numbers)."""
    if not isinstance(effects, dict):
        raise ValueError(f"effects must be a dict, got {type(effects).__name__}")
    unknown = sorted(set(effects) - set(_EFFECT_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown effects key(s) {unknown}; use {list(_EFFECT_DEFAULTS)}")
    e = {**_EFFECT_DEFAULTS, **effects}

    frac = e["patients"]
    frac = list(frac) if isinstance(frac, (list, tuple, np.ndarray)) else [frac] * n_sites
    if len(frac) != n_sites:
        raise ValueError(f"effects['patients'] lists {len(frac)} sites but n_sites is {n_sites}")
    frac = [_check_float(f, "effects['patients']") for f in frac]
    if not all(0.0 <= f <= 1.0 for f in frac):
        raise ValueError(f"effects['patients'] must be fractions in [0, 1], got {frac}")

    try:
        lo, hi = (_check_float(a, "effects['age']") for a in e["age"])
    except (TypeError, ValueError):
        raise ValueError(f"effects['age'] must be [lo, hi] with lo < hi, got {e['age']!r}") from None
    if not lo < hi:
        raise ValueError(f"effects['age'] must be [lo, hi] with lo < hi, got {e['age']!r}")
    p_female = _check_float(e["sex"], "effects['sex']")
    if not 0.0 <= p_female <= 1.0:
        raise ValueError(f"effects['sex'] is the probability of 'F', in [0, 1], got {e['sex']!r}")

    def entries(key: str, width: int) -> list:
        value = e[key]
        if not isinstance(value, (list, tuple)) or any(
                not isinstance(x, (list, tuple)) or len(x) != width for x in value):
            raise ValueError(f"effects[{key!r}] must be a list of {width}-element lists, got {value!r}")
        return value

    shifts, pairs = [], set()
    for j, k, delta in entries("fnc_shift", 3):
        j = _component(j, n_components, "effects['fnc_shift'] component")
        k = _component(k, n_components, "effects['fnc_shift'] component")
        delta = _check_float(delta, "effects['fnc_shift'] delta")
        if j == k or frozenset((j, k)) in pairs or not -1.0 < delta < 1.0:
            raise ValueError(f"effects['fnc_shift']: [{j}, {k}, {delta}] needs two different components, "
                             "each pair once, and -1 < delta < 1")
        pairs.add(frozenset((j, k)))
        shifts.append([j, k, delta])
    amplitude = {}
    for key in ("amplitude_age", "amplitude_group"):
        amplitude[key], seen = [], set()
        for k, value in entries(key, 2):
            k = _component(k, n_components, f"effects[{key!r}] component")
            if k in seen:
                raise ValueError(f"effects[{key!r}] lists component {k} twice")
            seen.add(k)
            amplitude[key].append([k, _check_float(value, f"effects[{key!r}] value")])
    return {"patients": frac, "age": [lo, hi], "sex": p_female, "fnc_shift": shifts, **amplitude}


def _shift_matrix(settings: dict, n_components: int) -> np.ndarray | None:
    """The R x R correlation shift of a patient (symmetric, zero diagonal), None without FNC shifts."""
    if not settings["fnc_shift"]:
        return None
    shift = np.zeros((n_components, n_components))
    for j, k, delta in settings["fnc_shift"]:
        shift[j, k] = shift[k, j] = delta
    return shift


def _covariates(seed: int, counts: list[int], settings: dict) -> list[list[dict]]:
    """Per site, per subject: ``group``, ``age``, ``sex`` from their own streams (see _EFFECTS_KEY)."""
    lo, hi = settings["age"]
    out = []
    for s_idx, (n_sub, frac) in enumerate(zip(counts, settings["patients"])):
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_EFFECTS_KEY, s_idx)))
        patient = np.zeros(n_sub, bool)
        patient[rng.choice(n_sub, size=round(frac * n_sub), replace=False)] = True
        site = []
        for m_idx in range(n_sub):
            sub_rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_EFFECTS_KEY, s_idx, m_idx)))
            age = round(float(sub_rng.uniform(lo, hi)), 1)
            sex = "F" if sub_rng.random() < settings["sex"] else "M"
            site.append({"group": "patient" if patient[m_idx] else "control", "age": age, "sex": sex})
        out.append(site)
    return out


def _subject_effect(cov: dict, settings: dict, shift: np.ndarray | None, n_components: int) -> _SubjectEffect:
    """The effects one subject carries: patients the FNC shift; everyone the age slopes; patients the group
    amplitude differences (log amplitudes add up)."""
    patient = cov["group"] == "patient"
    lo, hi = settings["age"]
    mid, half = (lo + hi) / 2.0, (hi - lo) / 2.0
    log_amp = np.zeros(n_components)
    for k, slope in settings["amplitude_age"]:
        log_amp[k] += slope * (cov["age"] - mid) / half
    for k, delta in settings["amplitude_group"] if patient else ():
        log_amp[k] += delta
    return _SubjectEffect(shift=shift if patient else None,
                          log_amplitude=log_amp if log_amp.any() else None)


def _apply_blobs_effect(S: np.ndarray, effect: _SubjectEffect) -> np.ndarray:
    """A blobs subject's standardised sources S (R x T, float64) with its planted effects.

    The GARCH sources are independent with unit variance, so ``L S`` with ``L`` the Cholesky factor of
    ``I + shift`` has the population correlation ``I + shift`` exactly. For one pair (j < k) only row k
    changes: ``s_k <- delta s_j + sqrt(1 - delta^2) s_k``. The mixed rows are standardised again (the
    sample correlation is kept), then each row is scaled by its amplitude ``exp(log_amplitude)``.
    """
    if effect.shift is not None:
        L = np.linalg.cholesky(np.eye(S.shape[0]) + effect.shift)
        rows = np.flatnonzero((L != np.eye(S.shape[0])).any(axis=1))  # the other rows stay bit for bit
        S = S.copy()
        S[rows] = _standardise_rows(L[rows] @ S)
    if effect.log_amplitude is not None:
        S = S * np.exp(effect.log_amplitude)[:, None]
    return S


def _effects_truth(settings: dict, baseline: list[np.ndarray]) -> dict:
    """The planted truths for ``manifest["effects"]``: per FNC pair the correlation and Fisher-z change,
    per amplitude effect the log-amplitude slope or difference. `baseline`: every subject's population
    correlation without effects (the identity for blobs)."""
    lo, hi = settings["age"]
    mid, half = (lo + hi) / 2.0, (hi - lo) / 2.0
    fnc = []
    for j, k, delta in settings["fnc_shift"]:
        r0 = np.array([C[j, k] for C in baseline])
        fnc.append({
            "components": [j, k],
            "correlation_difference": delta,
            # mean over every subject of atanh(r0 + delta) - atanh(r0): blobs (r0 = 0) atanh(delta) exactly
            "fisher_z_difference": float(np.mean(np.arctanh(r0 + delta) - np.arctanh(r0))),
            "control_correlation": float(r0.mean()),
            "patient_correlation": float(r0.mean() + delta),
        })
    return {
        "fnc_shift": fnc,
        "amplitude_age": [{"component": k, "log_amplitude_per_half_range": slope,
                           "log_amplitude_per_year": slope / half, "age_centre": mid}
                          for k, slope in settings["amplitude_age"]],
        "amplitude_group": [{"component": k, "log_amplitude_difference": delta, "amplitude_ratio": float(np.exp(delta))}
                            for k, delta in settings["amplitude_group"]],
    }


def _write_participants(path: Path, subjects: list[dict]) -> None:
    """A BIDS ``participants.tsv``: tab-separated, ``participant_id`` first, ages with one decimal."""
    lines = ["participant_id\tgroup\tage\tsex"]
    lines += [f"{sub['id']}\t{sub['group']}\t{sub['age']:.1f}\t{sub['sex']}" for sub in subjects]
    path.write_text("\n".join(lines) + "\n")


_EFFECTS_DESCRIPTION = (
    "Planted group effects on the ground-truth sources S (before mixing into voxels). Each site has exactly "
    "round(patients * M) patients (Python round), chosen at random; ages uniform in 'age', rounded to 0.1 year; "
    "sex 'F' with probability 'sex' (no effect). fnc_shift [j, k, delta]: in patients the population "
    "correlation of sources j and k is the control one plus delta exactly (blobs: independent sources, "
    "the Cholesky factor L of I + shift mixes them, for one pair s_k <- delta s_j + sqrt(1 - delta^2) s_k, "
    "re-standardised; networks: the shift is added to the subject's correlation C_m before its Cholesky "
    "factor mixes the white noise); no other pair changes; fisher_z_difference is the mean over every subject "
    "of atanh(r0 + delta) - atanh(r0) with r0 its correlation without the shift (population values: the "
    "mean sample Fisher z also carries a small-sample bias ~ r / (2 (T - 1)) for white series). "
    "amplitude_age [k, slope]: source k's standard deviation times exp(slope (age - age_centre) / half), half "
    "the half-width of 'age' (log_amplitude_per_year = slope / half); amplitude_group [k, delta]: patients' "
    "source k times exp(delta). Log amplitudes add up; the correlations do not change with them."
)


def make_consortium(
    out_dir,
    n_sites: int,
    subjects_per_site: int | Sequence[int],
    n_components: int = 20,
    n_timepoints: int | Sequence[int] = 150,
    space: str = "mni4mm",
    random_state=0,
    noise: float | None = None,
    tr: float = 2.0,
    progress: bool = False,
    dtype: str = "float32",
    *,
    states: int = 0,
    state_dwell: Sequence[float] | None = None,
    model: str = "blobs",
    network_params: dict | None = None,
    workers: int | None = None,
    compress: bool = True,
    effects: dict | None = None,
) -> dict:
    """Write a synthetic multi-site fMRI consortium with known ground truth.

    Parameters
    ----------
    out_dir : str or Path
        Output folder (created if needed). Files of an earlier run recorded
        in an existing ``manifest.json`` there are removed first, so a
        smaller re-run leaves no stale subjects behind.
    n_sites : int
        Number of sites (>= 1); folders ``site-01``, ``site-02``, ...
    subjects_per_site : int or sequence of int
        Subjects at every site, or one count per site (unequal allowed).
    n_components : int, default 20
        Number R of spatial maps / sources.
    n_timepoints : int or sequence of int, default 150
        Volumes per subject, or one length per site (sites whose scans differ).
    space : {"mni3mm", "mni4mm", "mni6mm", "grid30"}, default "mni4mm"
        Voxel grid and mask, see :func:`load_space`.
    random_state : None, int or numpy Generator, default 0
        Master seed (a Generator gives it by one draw, None by OS entropy; the
        manifest records it as ``seed``). Maps and GARCH parameters come from
        one child stream, each subject from its own stream keyed by (site,
        subject-in-site), so adding sites or subjects does not change the
        existing ones.
    noise : float, optional
        Std of the white Gaussian noise added to every in-mask voxel, relative
        to the signal: a component at its map's peak (unit max) has unit std,
        so the peak signal-to-noise ratio of one component is 1 / noise.
        None (the default) means the model's default: 0.5 for "blobs", 0.8
        for "networks" (``NETWORK_DEFAULTS["noise"]``, see the module
        docstring).
    tr : float, default 2.0
        Repetition time in seconds (stored in the NIfTI headers).
    progress : bool, default False
        Show a tqdm progress bar over subjects.
    dtype : {"float32", "int16"}, default "float32"
        How the BOLD images are stored. "int16" stores scaled integers (NIfTI
        scl_slope, as scanners do): half the disk, quantisation ~1e-4 of the
        data's range, far below the noise.
    states : int, default 0
        Number K of dFNC connectivity states planted in the sources (keyword
        only; blobs model). 0 = none: every output is exactly what it was
        before states existed. K >= 2: see the module docstring.
    state_dwell : list of float, optional
        Mean dwell time of each state in seconds (each > tr); default evenly
        from 30 to 90 s.
    model : {"blobs", "networks"}, default "blobs"
        The generative model (keyword only, see the module docstring).
        "blobs": 1-3 Gaussian blobs per map and GARCH sources, exactly as
        before the option existed. "networks": distributed, partly
        bilateral resting-state networks with low-frequency, correlated,
        near-Gaussian BOLD time courses, a global signal and structured
        noise; subject (s, m) is ``network_model(space, n_components,
        random_state, **network_params).subject(s, m, n_timepoints, tr)``. Brain
        states are not available with "networks".
    network_params : dict, optional
        Overrides of :data:`NETWORK_DEFAULTS` for model="networks" (the
        ``noise`` argument, when given, wins over ``network_params["noise"]``).
    workers : int, optional
        Subjects generated and written at once, by a pool of threads
        (keyword only). None (the default): the number of CPU cores this
        process may use; 1: one after the other, in this thread. The output
        is byte for byte the same for any value: every subject is drawn from
        its own seeded stream.
    compress : bool, default True
        Write the subjects' BOLD images gzip-compressed (``.nii.gz``, gzip
        level 1: ~4.5x smaller at int16) or uncompressed (``.nii``: no
        compression time, several times the disk). Keyword only. The mask and
        the truth maps are always ``.nii.gz``; the manifest names the files
        written.
    effects : dict, optional
        Planted group differences between subjects, for testing a group
        GLM against a known truth (keyword only; not with ``states``). None
        (the default): nothing changes, no file and no manifest key is
        added. A dict with any of these keys (defaults in brackets;
        components are 0-based rows of S / columns of A):

        - ``"patients"``: float or one float per site [0.5]: fraction of
          patients; exactly ``round(fraction * M)`` (Python's round) of a
          site's M subjects are "patient", chosen at random, the others
          "control";
        - ``"age"``: ``[lo, hi]`` [[20, 70]]: ages uniform in it, rounded
          to 0.1 year;
        - ``"sex"``: probability of "F" [0.5], else "M" (no effect);
        - ``"fnc_shift"``: list of ``[j, k, delta]`` [[]]: in patients the
          population correlation of sources j and k is raised by exactly
          ``delta`` (-1 < delta < 1), no other pair changes. Blobs: the
          independent unit-variance sources are mixed by the Cholesky
          factor of ``I + shift``, for one pair (j < k)
          ``s_k <- delta s_j + sqrt(1 - delta^2) s_k``, re-standardised,
          so the correlation goes from 0 to delta and Fisher's z by
          ``atanh(delta)``. Networks: the shift is added to the subject's
          correlation before it mixes the noise
          (:meth:`NetworkModel.subject`'s ``correlation_shift``);
        - ``"amplitude_age"``: list of ``[k, slope]`` [[]]: every subject's
          source k amplitude (std) times ``exp(slope * (age - mid) / half)``,
          mid and half the centre and half-width of ``age``: slope is the
          change in log amplitude per half range, ``slope / half`` per year;
        - ``"amplitude_group"``: list of ``[k, delta]`` [[]]: patients'
          source k amplitude times ``exp(delta)`` (log amplitudes add up).

        The effects change the sources S before they are mixed into the
        voxels (the written S are the changed ones) and no random draw:
        groups, ages and sexes come from their own streams (6, site) and
        (6, site, subject), and a control with no age effect is exactly
        what ``effects=None`` writes. Every site folder gets a BIDS
        ``participants.tsv`` (``participant_id``, ``group``, ``age``,
        ``sex``; the ids are :func:`dpneuro.data.load.load_site`'s subject
        ids) and the manifest an ``effects`` entry (see the module
        docstring).

    Returns
    -------
    dict
        The manifest with absolute paths: ``manifest_path``, ``root``,
        ``sites`` (list of ``{"site", "path", "subjects": [{"id", "path",
        "sources"}]}``), ``mask``, ``space``, ``shape``, ``affine``,
        ``n_voxels``, ``n_components``, ``n_timepoints``, ``tr``, ``seed``,
        ``noise`` and ``truth`` (``maps``, ``A``, ``sources`` description,
        ``garch`` parameters; with states on also ``n_states``, ``states``,
        ``state_labels`` and ``state_model``). With
        model="networks" also ``model`` ("networks"), and ``truth`` holds
        ``networks`` (every parameter, the group ``correlation``, the
        networks' ``strength`` and ``regions``) instead of ``garch``. With
        ``effects`` also ``effects`` (see the module docstring).

    Raises
    ------
    ValueError
        On invalid arguments (unknown space, n_sites < 1, ...).
    """
    # ---- validate everything before touching the disk
    n_sites = _check_int(n_sites, "n_sites", 1)
    counts = _per_site(subjects_per_site, n_sites, "subjects_per_site", 1)
    n_components = _check_int(n_components, "n_components", 1)
    lengths = _per_site(n_timepoints, n_sites, "n_timepoints", 3)
    seed = resolve_random_state(random_state, fresh=True)
    if space not in SPACES:
        raise ValueError(f"unknown space {space!r}; choose one of {', '.join(SPACES)}")
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(repr(m) for m in MODELS)}")
    if noise is None:
        noise = _BLOBS_NOISE if model == "blobs" else (network_params or {}).get("noise")
    if noise is not None:
        noise = _check_float(noise, "noise")
        if noise < 0:
            raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    if model == "blobs" and network_params is not None:
        raise ValueError("network_params only apply to model='networks'")
    if network_params is not None and not isinstance(network_params, dict):
        raise ValueError(f"network_params must be a dict, got {type(network_params).__name__}")
    if dtype not in ("float32", "int16"):
        raise ValueError(f"dtype must be 'float32' or 'int16', got {dtype!r}")
    tr = _check_tr(tr)
    states = _check_int(states, "states", 0)
    if states == 1:
        raise ValueError("states must be 0 (no brain states) or >= 2")
    if states and n_components < 2:
        raise ValueError("brain states need n_components >= 2 (a state is a correlation between components)")
    if states > np.iinfo(np.int8).max:
        raise ValueError(f"states must be <= {np.iinfo(np.int8).max} (labels are stored as int8), got {states}")
    if states and model == "networks":
        raise ValueError("brain states (states >= 2) are only available with model='blobs'")
    if states:  # validated before touching the disk; the matrices come from their own stream
        dwell = default_dwell(states) if state_dwell is None else np.asarray(state_dwell, float)
        state_rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_STATE_MATRIX_KEY,)))
        process = StateProcess(state_correlations(n_components, states, random_state=state_rng), dwell, tr)
    workers = resolve_workers() if workers is None else _check_int(workers, "workers", 1)
    if not isinstance(compress, (bool, np.bool_)):
        raise ValueError(f"compress must be True or False, got {compress!r}")
    if effects is not None:
        if states:
            raise ValueError("effects are not available with brain states (states >= 2): their sources "
                             "follow the planted states' correlations")
        effect_settings = _check_effects(effects, n_sites, n_components)

    mask, affine = load_space(space)
    D = int(mask.sum())
    if n_components > D:
        raise ValueError(f"n_components ({n_components}) exceeds the {D} mask voxels")
    if model == "networks":  # validates the parameters before touching the disk
        generator = network_model(space, n_components, seed, **{**(network_params or {}), "noise": noise})
        noise = generator.noise
    if effects is not None:  # the subjects' groups, ages, sexes and effects, checked before touching the disk
        covariates = _covariates(seed, counts, effect_settings)
        shift = _shift_matrix(effect_settings, n_components)
        # every subject's correlation without effects: the GARCH sources are independent
        baseline = ([generator.subject_correlation(s, m) for s, n in enumerate(counts) for m in range(n)]
                    if model == "networks" else [np.eye(n_components)])
        if shift is not None:  # a patient's correlation plus the shift must still be a correlation matrix
            groups = [cov["group"] for site_cov in covariates for cov in site_cov]
            patients_C = [C for C, g in zip(baseline, groups) if g == "patient"] if model == "networks" else baseline
            for C in patients_C:
                try:
                    np.linalg.cholesky(C + shift)
                except np.linalg.LinAlgError:
                    raise ValueError("effects['fnc_shift'] makes a patient's source correlation matrix not "
                                     "positive definite; use smaller or fewer shifts") from None

    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in _previous_files(out_dir):
        stale.unlink(missing_ok=True)
    truth_dir = out_dir / "truth"
    truth_dir.mkdir(exist_ok=True)

    # ---- ground truth shared by all subjects
    if model == "blobs":
        truth_rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
        A = _spatial_maps(mask, n_components, _BLOB_SIGMA[space], truth_rng).astype(np.float32)
        garch = _garch_params(n_components, truth_rng)
        generator = _BlobsModel(A=A, garch=garch, noise=float(noise), seed=seed)
    else:
        A = generator.A

    mask_path = out_dir / "mask.nii.gz"
    nib.save(_nifti(mask.astype(np.uint8), affine, space, None), mask_path)
    maps_path = truth_dir / "maps.nii.gz"
    nib.save(_nifti(_to_volume(A, mask), affine, space, None), maps_path)
    A_path = truth_dir / "A.npy"
    np.save(A_path, A)

    # ---- brain states (own streams: nothing above or below draws differently)
    if states:
        generator.states = process
        states_path = truth_dir / "states.npy"
        np.save(states_path, process.states.astype(np.float32))
        state_labels: dict[str, dict[str, str]] = {}

    # ---- subjects: name every file first (numbers run consortium-wide), then write them in parallel
    sites, jobs, participants = [], [], []
    subject_number = 0
    suffix = ".nii.gz" if compress else ".nii"
    for s_idx, n_sub in enumerate(counts):
        site_name = f"site-{s_idx + 1:02d}"
        site_dir = out_dir / site_name
        site_dir.mkdir(exist_ok=True)
        subjects = []
        for m_idx in range(n_sub):
            subject_number += 1
            sub_id = f"sub-{subject_number:04d}"
            job = _SubjectJob(s_idx, m_idx, site_dir / f"{sub_id}_bold{suffix}",
                              truth_dir / f"S_{site_name}_{sub_id}.npy", lengths[s_idx])
            if states:
                job.labels = truth_dir / f"labels_{site_name}_{sub_id}.npy"
                state_labels.setdefault(site_name, {})[sub_id] = str(job.labels)
            if effects is not None:
                cov = covariates[s_idx][m_idx]
                job.effect = _subject_effect(cov, effect_settings, shift, n_components)
                participants.append({"site": site_name, "id": sub_id, **cov})
            jobs.append(job)
            subjects.append({"id": sub_id, "path": str(job.bold), "sources": str(job.sources)})
        sites.append({"site": site_name, "path": str(site_dir), "subjects": subjects})
    writer = _SubjectWriter(generator, mask, affine, space, tr, dtype, compress)
    _write_subjects(writer, jobs, workers, progress)
    for site in sites:
        _warn_foreign_files(Path(site["path"]), {Path(sub["path"]).name for sub in site["subjects"]})
    if effects is not None:  # BIDS participants.tsv per site: the ids are the loader's (sub-0001_bold -> sub-0001)
        tables = {site["site"]: str(Path(site["path"]) / "participants.tsv") for site in sites}
        for site_name, path in tables.items():
            _write_participants(Path(path), [sub for sub in participants if sub["site"] == site_name])

    manifest = {
        "format": _MANIFEST_FORMAT,
        "manifest_path": str(out_dir / "manifest.json"),
        "root": str(out_dir),
        "space": space,
        "shape": list(mask.shape),
        "affine": affine.tolist(),
        "n_voxels": D,
        "n_sites": n_sites,
        "n_subjects": subject_number,
        "n_components": n_components,
        "n_timepoints": lengths[0] if len(set(lengths)) == 1 else lengths,
        "tr": float(tr),
        "seed": seed,
        "noise": float(noise),
        "mask": str(mask_path),
        "sites": sites,
        "truth": {
            "maps": str(maps_path),
            "A": str(A_path),
            "sources": (
                "one file per subject, listed as 'sources' in each subject entry: "
                "R x T float32 array S with X = A S + noise"
            ),
            "model": "X = A @ S + noise * N(0,1) over mask voxels (mask[mask] order)",
        },
    }
    if model == "blobs":
        manifest["truth"]["garch"] = {
            "omega": garch["omega"],
            "alpha": garch["alpha"].tolist(),
            "beta": garch["beta"].tolist(),
            "burn_in": _GARCH_BURN_IN,
        }
    else:
        # "model" right after "noise" (the blobs manifest has no such key, as before models existed)
        items = list(manifest.items())
        items.insert([k for k, _ in items].index("noise") + 1, ("model", model))
        manifest = dict(items)
        manifest["truth"].update({
            "sources": (
                "one file per subject, listed as 'sources' in each subject entry: R x T float32 array S "
                "(network time courses: each row standardised, times the network's strength and the "
                "subject's amplitude) with X = A S + global signal + structured noise + noise * N(0,1)"
            ),
            "model": (
                "networks: X = A @ S + global_amplitude * w g^T + physio_amplitude * M P + noise * N(0,1) over "
                "mask voxels (mask[mask] order); subject (s, m) = dpneuro.datasets.synth.network_model(space, "
                "n_components, seed, **params).subject(s, m, n_timepoints, tr)"
            ),
            "networks": _network_manifest(generator),
        })
    if states:
        manifest["truth"].update({
            "n_states": states,
            "states": str(states_path),
            "state_labels": state_labels,
            "state_model": {
                "dwell": [float(x) for x in process.dwell],
                "lowpass": process.lowpass,
                "noise": process.noise,
                "description": (
                    "S (each subject's sources) switches between the K correlation matrices of 'states' by the "
                    "labels h_t (a Markov chain with mean dwell 'dwell' seconds per state): Gaussian innovations "
                    "correlated by states[h_t], low-passed at 'lowpass' Hz, rows standardised, plus white noise "
                    "of std 'noise' (dpneuro.datasets.states.StateProcess)"
                ),
            },
        })
    if effects is not None:
        manifest["effects"] = {
            "settings": effect_settings,
            "n_patients": [sum(cov["group"] == "patient" for cov in site_cov) for site_cov in covariates],
            "participants": tables,
            "subjects": participants,
            **_effects_truth(effect_settings, baseline),
            "description": _EFFECTS_DESCRIPTION,
        }
    with open(manifest["manifest_path"], "w") as f:
        json.dump(_relative(manifest, out_dir), f, indent=1)
    return manifest


def _warn_foreign_files(site_dir: Path, ours: set[str]) -> None:
    """Warn about NIfTI files in a site folder that this run did not write.

    A loader globbing the folder would otherwise silently pick them up.
    """
    foreign = sorted(
        p.name for p in site_dir.iterdir()
        if p.name.endswith((".nii", ".nii.gz")) and p.name not in ours
    )
    if foreign:
        warnings.warn(
            f"{site_dir} also contains NIfTI files not written by this run: "
            f"{', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}",
            RuntimeWarning,
            stacklevel=3,
        )


def load_manifest(path) -> dict:
    """Read a ``manifest.json`` written by :func:`make_consortium`.

    Parameters
    ----------
    path : str or Path
        The manifest file, or the consortium folder containing it.

    Returns
    -------
    dict
        The manifest with every path resolved to an absolute path, plus
        ``manifest_path`` and ``root``.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "manifest.json"
    if not path.is_file():
        raise ValueError(f"{path}: manifest not found")
    with open(path) as f:
        man = json.load(f)
    if man.get("format") != _MANIFEST_FORMAT:
        raise ValueError(f"{path}: not a dpneuro synthetic-consortium manifest")
    root = path.parent.absolute()

    def res(p: str) -> str:
        return str(root / p)

    man["manifest_path"] = str(path.absolute())
    man["root"] = str(root)
    man["mask"] = res(man["mask"])
    for site in man["sites"]:
        site["path"] = res(site["path"])
        for sub in site["subjects"]:
            sub["path"] = res(sub["path"])
            sub["sources"] = res(sub["sources"])
    for key in ("maps", "A"):
        man["truth"][key] = res(man["truth"][key])
    _map_state_paths(man["truth"], res)
    _map_participants(man, res)
    return man


# ---------------------------------------------------------------------------
# the [capeDJICA] Sec. V set-up, in memory
# ---------------------------------------------------------------------------

def grid_maps(R: int, random_state=None, n: int = 30) -> np.ndarray:
    """D x R maps on an n x n grid: 1-3 truncated Gaussian blobs (sd 1.5-3 voxels) per component, unit max."""
    rng = default_rng(random_state)
    yy, xx = np.mgrid[0:n, 0:n]
    coords = np.c_[yy.ravel(), xx.ravel()].astype(float)
    A = np.zeros((n * n, R))
    for r in range(R):
        for _ in range(int(rng.integers(1, 4))):
            c, s = coords[rng.integers(n * n)], rng.uniform(1.5, 3.0)
            d2 = ((coords - c) ** 2).sum(axis=1)
            A[:, r] += np.where(d2 <= 9 * s * s, rng.uniform(0.5, 1.0) * np.exp(-d2 / (2 * s * s)), 0.0)
        A[:, r] /= A[:, r].max()
    return A


def paper_ica_data(M: int, random_state=None, *, R: int = 20, T: int = 250, S: int = 4) -> dict:
    """The temporal-ICA set-up of [capeDJICA] Sec. V held in memory: grid maps x GARCH sources, split over sites.

    Returns the raw per-site data ``X``, the truth ``A``, the pooled-PCA whitened
    per-site data ``Z`` (float32, the paper whitens non-privately), the truth in
    that whitened space ``Aw``, ``subjects`` per site and ``T``. ``random_state``: None, an int or a
    Generator (used as it is).
    """
    rng = default_rng(random_state)
    A = grid_maps(R, rng)
    alpha = rng.uniform(0.1, 0.2, R)
    beta = np.minimum(rng.uniform(0.7, 0.8, R), 0.97 - alpha)
    # one GARCH process per (subject, component), generated together
    src = garch_sources(T, np.tile(alpha, M), np.tile(beta, M), rng)
    src = src.reshape(M, R, T).transpose(1, 0, 2).reshape(R, M * T)
    X = A @ src
    lam, V = np.linalg.eigh(X @ X.T / X.shape[1])
    lam, V = lam[::-1][:R], V[:, ::-1][:, :R]
    Z = whiten(X, V, lam).astype(np.float32)
    per = M // S
    cols = per * T
    return {"Z": [Z[:, s * cols:(s + 1) * cols] for s in range(S)], "subjects": [per] * S,
            "Aw": whiten(A, V, lam), "A": A, "X": [X[:, s * cols:(s + 1) * cols] for s in range(S)], "T": T}
