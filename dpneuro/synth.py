"""Synthetic multi-site resting-state fMRI with known ground truth.

The generative model is the one of the temporal-ICA papers: R spatial maps
(columns of a D x R mixing matrix ``A`` over the mask voxels), R source time
courses per subject drawn from a GARCH(1,1) process (heavy-tailed,
standardised), and per subject

    X = A S + noise * N(0, 1)        (D x T, float32)

written as one real 4-D NIfTI file per subject per site, with the mask, the
maps, ``A`` and every ``S`` alongside and a ``manifest.json`` describing it
all. Everything is fully determined by the seed.

Brain states (optional, ``states=K >= 2``; off by default)
---------------------------------------------------------
For the co-activation-pattern ("brain states") analysis the sources can also
switch between K recurring states. Each state k has a centroid ``mu_k`` in
source space (an R-vector, :func:`state_centroids`): state k activates its own
block of ``m = max(1, min(3, R // K))`` components (disjoint blocks, random
signs, the first positive), the K patterns are centred over the states
(``sum_k mu_k = 0``, so the sources keep zero mean) and scaled so that, for
every component taking part, the states carry the fraction ``state_strength``
of its variance: ``(1/K) sum_k mu_k[r]^2 = state_strength`` (components in no
block: 0). Every subject has its own hidden state sequence ``h_t``
(:func:`state_sequence`): a Markov chain with uniform initial state that at
each step leaves its state with probability ``1 / state_dwell`` for one of
the K - 1 others (uniformly), so dwell times are geometric with mean
``state_dwell`` and the stationary occupancy is uniform. The sources are

    S[r, t] = mu_{h_t}[r] + c_r * G[r, t],   c_r = sqrt(1 - (1/K) sum_k mu_k[r]^2)

with ``G`` the standardised GARCH sources (the very same draws as with states
off). Under the uniform occupancy every row of S has expected mean 0 and
expected variance exactly 1 (``c_r = sqrt(1 - state_strength)`` for the
components in a state, 1 for the others); a single finite subject deviates
by its occupancy fluctuations. The voxel-space state patterns the analysis
should recover are ``A mu_k``. Centroids come from their own random stream
and each subject's state sequence from its own stream, so enabling states
changes no other random draw (maps, GARCH, noise): X differs from the
states-off data only by ``A (S_states - G)``.

Folder layout written by :func:`make_consortium`::

    out_dir/
      manifest.json
      mask.nii.gz
      site-01/sub-0001_bold.nii.gz ...
      site-02/sub-0004_bold.nii.gz ...   (subject numbers unique consortium-wide)
      truth/maps.nii.gz                  4-D, one volume per component
      truth/A.npy                        D x R float32, maps as columns
      truth/S_site-01_sub-0001.npy       R x T float32, one file per subject
      truth/states.npy                   K x R float32 state centroids mu_k   (states >= 2 only)
      truth/state_patterns.npy           K x D float32 voxel patterns A mu_k  (states >= 2 only)
      truth/labels_site-01_sub-0001.npy  T int8 state label h_t per subject   (states >= 2 only)

With states on, ``manifest["truth"]`` also holds ``n_states`` (K),
``states`` and ``state_patterns`` (paths), ``state_labels`` (``{site:
{subject id: path}}``) and ``state_model`` (``dwell``, ``strength``,
``components_per_state``, ``noise_scale`` = the c_r above, a description).
With states off none of these keys exist (the manifest is byte-identical to
the one written before states existed): read ``truth.get("n_states", 0)``.

Paths inside ``manifest.json`` are relative to ``out_dir`` so the folder can
be moved; :func:`make_consortium` and :func:`load_manifest` return them
resolved to absolute paths.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Sequence

import nibabel as nib
import numpy as np

from .io import SPACES, load_space  # noqa: F401 - the generator's grids are the analysis spaces

__all__ = ["make_consortium", "load_manifest", "garch_sources", "state_centroids", "state_sequence"]


#: Gaussian blob width (standard deviation) range, in voxels
_BLOB_SIGMA = {
    "grid30": (1.5, 3.0),
    "mni4mm": (8.0 / 4, 14.0 / 4),  # 8-14 mm
    "mni6mm": (8.0 / 6, 14.0 / 6),
}

_GARCH_OMEGA = 0.1
_GARCH_BURN_IN = 100
# keep alpha + beta below 1 so the process is stationary with finite variance
_GARCH_MAX_PERSISTENCE = 0.97

_MANIFEST_FORMAT = "dpneuro-synth-1"

#: brain-state defaults: mean dwell time (time points) and the fraction of a participating source's variance
#: carried by the state means (see the module docstring)
_STATE_DWELL = 8.0
_STATE_STRENGTH = 0.4
#: at most this many components take part in one state
_STATE_MAX_BLOCK = 3
#: spawn keys of the state streams (maps/GARCH use (0,), subjects (1, site, subject))
_STATE_CENTROID_KEY = 2
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
    rng: np.random.Generator,
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
    rng : numpy.random.Generator
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
    z = rng.standard_normal((alpha.size, n_total))
    h = np.full(alpha.size, omega / (1.0 - alpha - beta))  # unconditional variance
    e_prev2 = h.copy()
    out = np.empty((alpha.size, n_total))
    for t in range(n_total):
        h = omega + alpha * e_prev2 + beta * h
        out[:, t] = np.sqrt(h) * z[:, t]
        e_prev2 = out[:, t] ** 2
    s = out[:, burn_in:]
    s = s - s.mean(axis=1, keepdims=True)
    std = s.std(axis=1, keepdims=True)
    std[std == 0] = 1.0
    return s / std


# ---------------------------------------------------------------------------
# brain states
# ---------------------------------------------------------------------------

def state_centroids(
    n_components: int, n_states: int, strength: float, rng: np.random.Generator,
) -> np.ndarray:
    """K x R state centroids in source space: sparse, centred, distinct.

    State k activates its own block of ``m = max(1, min(3, R // K))``
    components (disjoint blocks of a random permutation, signs random with
    the block's first component positive). The patterns are centred over the
    states (every column sums to 0) and scaled so that
    ``(1/K) sum_k mu[k, r]^2 = strength`` for every component in a block
    (0 for the others). Any two centroids differ by ``a`` on ``2 m``
    components, ``a = sqrt(strength K^2 / (K - 1))``; their cosine is
    ``-1 / (K - 1)``.

    Parameters
    ----------
    n_components : int
        R, the number of sources (>= n_states).
    n_states : int
        K >= 2.
    strength : float
        In (0, 1): the fraction of a participating source's variance that
        the state means carry.
    rng : numpy.random.Generator

    Returns
    -------
    ndarray, shape (K, R), float64
    """
    R = _check_int(n_components, "n_components", 1)
    K = _check_int(n_states, "n_states", 2)
    if K > R:
        raise ValueError(f"n_states ({K}) exceeds n_components ({R}): every state needs its own component")
    strength = _check_unit_open(strength, "state_strength")
    m = max(1, min(_STATE_MAX_BLOCK, R // K))
    perm = rng.permutation(R)
    signs = rng.choice(np.array([-1.0, 1.0]), size=(K, m))
    signs[:, 0] = 1.0
    P = np.zeros((K, R))
    for k in range(K):
        P[k, perm[k * m:(k + 1) * m]] = signs[k]
    mu = P - P.mean(axis=0, keepdims=True)
    return mu * np.sqrt(strength * K * K / (K - 1))


def state_sequence(
    n_timepoints: int, n_states: int, dwell: float, rng: np.random.Generator,
) -> np.ndarray:
    """Hidden state labels of one subject: a Markov chain with geometric dwell times.

    The initial state is uniform; at every later time point the chain leaves
    its state with probability ``1 / dwell`` for one of the other
    ``n_states - 1`` states chosen uniformly (so the run lengths are
    geometric with mean `dwell` and the stationary occupancy is uniform).

    Parameters
    ----------
    n_timepoints : int
        T >= 1.
    n_states : int
        K >= 2.
    dwell : float
        Mean dwell time in time points, >= 1 (1: a switch at every step).
    rng : numpy.random.Generator

    Returns
    -------
    ndarray, shape (T,), int64
        Labels in ``0 .. K-1``.
    """
    T = _check_int(n_timepoints, "n_timepoints", 1)
    K = _check_int(n_states, "n_states", 2)
    dwell = _check_dwell(dwell)
    start = rng.integers(K)
    leave = rng.random(T - 1) < 1.0 / dwell
    step = rng.integers(1, K, size=T - 1)  # to one of the K - 1 other states
    moves = np.concatenate([[0], np.cumsum(np.where(leave, step, 0))])
    return ((start + moves) % K).astype(np.int64)


def _state_noise_scale(centroids: np.ndarray) -> np.ndarray:
    """c_r = sqrt(1 - (1/K) sum_k mu[k, r]^2): keeps every source at unit variance under uniform occupancy."""
    return np.sqrt(1.0 - (centroids ** 2).mean(axis=0))


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


def _check_unit_open(value, name: str) -> float:
    out = _check_float(value, name)
    if not 0.0 < out < 1.0:
        raise ValueError(f"{name} must be strictly between 0 and 1, got {value!r}")
    return out


def _check_dwell(value) -> float:
    out = _check_float(value, "state_dwell")
    if out < 1.0:
        raise ValueError(f"state_dwell (mean dwell time in time points) must be >= 1, got {value!r}")
    return out


def _subjects_list(subjects_per_site, n_sites: int) -> list[int]:
    if isinstance(subjects_per_site, (list, tuple, np.ndarray)):
        counts = list(subjects_per_site)
        if len(counts) != n_sites:
            raise ValueError(
                f"subjects_per_site lists {len(counts)} sites but n_sites is {n_sites}"
            )
    else:
        counts = [subjects_per_site] * n_sites
    return [_check_int(c, "subjects per site", 1) for c in counts]


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
    return out


def _map_state_paths(truth: dict, fn) -> None:
    """Apply `fn` in place to the brain-state paths of a manifest's truth (if states are on)."""
    for key in ("states", "state_patterns"):
        if key in truth:
            truth[key] = fn(truth[key])
    for subjects in truth.get("state_labels", {}).values():
        for sub_id in subjects:
            subjects[sub_id] = fn(subjects[sub_id])


def _state_files(truth: dict) -> list[str]:
    files = [truth[key] for key in ("states", "state_patterns") if key in truth]
    return files + [p for subjects in truth.get("state_labels", {}).values() for p in subjects.values()]


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
    for site in old["sites"]:
        for sub in site["subjects"]:
            files.update({Path(sub["path"]), Path(sub["sources"])})
    # only ever delete inside out_dir
    root = out_dir.resolve()
    return {f for f in files if f.resolve().is_relative_to(root)}


def make_consortium(
    out_dir,
    n_sites: int,
    subjects_per_site: int | Sequence[int],
    n_components: int = 20,
    n_timepoints: int = 150,
    space: str = "mni4mm",
    seed: int = 0,
    noise: float = 0.5,
    tr: float = 2.0,
    progress: bool = False,
    dtype: str = "float32",
    *,
    states: int = 0,
    state_dwell: float = _STATE_DWELL,
    state_strength: float = _STATE_STRENGTH,
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
    n_timepoints : int, default 150
        Volumes per subject.
    space : {"mni4mm", "mni6mm", "grid30"}, default "mni4mm"
        Voxel grid and mask, see :func:`load_space`.
    seed : int, default 0
        Master seed. Maps and GARCH parameters come from one child stream,
        each subject from its own stream keyed by (site, subject-in-site), so
        adding sites or subjects does not change the existing ones.
    noise : float, default 0.5
        Std of the white Gaussian noise added to every in-mask voxel, relative
        to the signal: a component at its map's peak (unit max) has unit std,
        so the peak signal-to-noise ratio of one component is 1 / noise.
    tr : float, default 2.0
        Repetition time in seconds (stored in the NIfTI headers).
    progress : bool, default False
        Show a tqdm progress bar over subjects.
    dtype : {"float32", "int16"}, default "float32"
        How the BOLD images are stored. "int16" stores scaled integers (NIfTI
        scl_slope, as scanners do): half the disk, quantisation ~1e-4 of the
        data's range, far below the noise.
    states : int, default 0
        Number K of recurring brain states planted in the sources (keyword
        only). 0 = none: every output is exactly what it was before states
        existed. K >= 2 (and <= n_components): see the module docstring.
    state_dwell : float, default 8.0
        Mean dwell time of a state, in time points (>= 1; geometric).
    state_strength : float, default 0.4
        In (0, 1): the fraction of the variance of each component taking part
        in a state that the state means carry (the rest is the GARCH source).

    Returns
    -------
    dict
        The manifest with absolute paths: ``manifest_path``, ``root``,
        ``sites`` (list of ``{"site", "path", "subjects": [{"id", "path",
        "sources"}]}``), ``mask``, ``space``, ``shape``, ``affine``,
        ``n_voxels``, ``n_components``, ``n_timepoints``, ``tr``, ``seed``,
        ``noise`` and ``truth`` (``maps``, ``A``, ``sources`` description,
        ``garch`` parameters; with states on also ``n_states``, ``states``,
        ``state_patterns``, ``state_labels`` and ``state_model``).

    Raises
    ------
    ValueError
        On invalid arguments (unknown space, n_sites < 1, ...).
    """
    # ---- validate everything before touching the disk
    n_sites = _check_int(n_sites, "n_sites", 1)
    counts = _subjects_list(subjects_per_site, n_sites)
    n_components = _check_int(n_components, "n_components", 1)
    n_timepoints = _check_int(n_timepoints, "n_timepoints", 3)
    seed = _check_int(seed, "seed", 0)
    if space not in SPACES:
        raise ValueError(f"unknown space {space!r}; choose one of {', '.join(SPACES)}")
    if not np.isfinite(noise) or noise < 0:
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    if dtype not in ("float32", "int16"):
        raise ValueError(f"dtype must be 'float32' or 'int16', got {dtype!r}")
    if not np.isfinite(tr) or tr <= 0:
        raise ValueError(f"tr must be a positive number of seconds, got {tr!r}")
    states = _check_int(states, "states", 0)
    if states == 1:
        raise ValueError("states must be 0 (no brain states) or >= 2")
    if states > n_components:
        raise ValueError(
            f"states ({states}) exceeds n_components ({n_components}): every state needs its own component"
        )
    if states > np.iinfo(np.int8).max:
        raise ValueError(f"states must be <= {np.iinfo(np.int8).max} (labels are stored as int8), got {states}")
    state_dwell = _check_dwell(state_dwell)
    state_strength = _check_unit_open(state_strength, "state_strength")

    mask, affine = load_space(space)
    D = int(mask.sum())
    if n_components > D:
        raise ValueError(f"n_components ({n_components}) exceeds the {D} mask voxels")

    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in _previous_files(out_dir):
        stale.unlink(missing_ok=True)
    truth_dir = out_dir / "truth"
    truth_dir.mkdir(exist_ok=True)

    # ---- ground truth shared by all subjects
    truth_rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
    A = _spatial_maps(mask, n_components, _BLOB_SIGMA[space], truth_rng).astype(np.float32)
    garch = _garch_params(n_components, truth_rng)

    mask_path = out_dir / "mask.nii.gz"
    nib.save(_nifti(mask.astype(np.uint8), affine, space, None), mask_path)
    maps_path = truth_dir / "maps.nii.gz"
    nib.save(_nifti(_to_volume(A, mask), affine, space, None), maps_path)
    A_path = truth_dir / "A.npy"
    np.save(A_path, A)

    # ---- brain states (own streams: nothing above or below draws differently)
    if states:
        centroid_rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_STATE_CENTROID_KEY,)))
        mu = state_centroids(n_components, states, state_strength, centroid_rng)
        state_scale = _state_noise_scale(mu)
        states_path = truth_dir / "states.npy"
        np.save(states_path, mu.astype(np.float32))
        patterns_path = truth_dir / "state_patterns.npy"
        np.save(patterns_path, (mu @ A.T.astype(np.float64)).astype(np.float32))
        state_labels: dict[str, dict[str, str]] = {}

    # ---- subjects
    from tqdm.auto import tqdm

    sites = []
    subject_number = 0
    bar = tqdm(total=sum(counts), desc="synth", unit="subject", disable=not progress)
    try:
        for s_idx, n_sub in enumerate(counts):
            site_name = f"site-{s_idx + 1:02d}"
            site_dir = out_dir / site_name
            site_dir.mkdir(exist_ok=True)
            subjects = []
            for m_idx in range(n_sub):
                subject_number += 1
                sub_id = f"sub-{subject_number:04d}"
                rng = np.random.default_rng(
                    np.random.SeedSequence(seed, spawn_key=(1, s_idx, m_idx))
                )
                S = garch_sources(
                    n_timepoints, garch["alpha"], garch["beta"], rng, omega=garch["omega"]
                )
                if states:
                    label_rng = np.random.default_rng(
                        np.random.SeedSequence(seed, spawn_key=(_STATE_SEQUENCE_KEY, s_idx, m_idx))
                    )
                    labels = state_sequence(n_timepoints, states, state_dwell, label_rng)
                    S = mu[labels].T + state_scale[:, None] * S
                    labels_path = truth_dir / f"labels_{site_name}_{sub_id}.npy"
                    np.save(labels_path, labels.astype(np.int8))
                    state_labels.setdefault(site_name, {})[sub_id] = str(labels_path)
                S = S.astype(np.float32)
                X = A @ S  # float32, D x T
                if noise > 0:
                    X += np.float32(noise) * rng.standard_normal(X.shape, dtype=np.float32)
                bold_path = site_dir / f"{sub_id}_bold.nii.gz"
                img = _nifti(_to_volume(X, mask), affine, space, tr)
                if dtype == "int16":
                    img.set_data_dtype(np.int16)  # nibabel picks slope and intercept to fit the range
                nib.save(img, bold_path)
                src_path = truth_dir / f"S_{site_name}_{sub_id}.npy"
                np.save(src_path, S)
                subjects.append(
                    {"id": sub_id, "path": str(bold_path), "sources": str(src_path)}
                )
                bar.update(1)
            _warn_foreign_files(site_dir, {Path(s["path"]).name for s in subjects})
            sites.append({"site": site_name, "path": str(site_dir), "subjects": subjects})
    finally:
        bar.close()

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
        "n_timepoints": n_timepoints,
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
            "garch": {
                "omega": garch["omega"],
                "alpha": garch["alpha"].tolist(),
                "beta": garch["beta"].tolist(),
                "burn_in": _GARCH_BURN_IN,
            },
        },
    }
    if states:
        manifest["truth"].update({
            "n_states": states,
            "states": str(states_path),
            "state_patterns": str(patterns_path),
            "state_labels": state_labels,
            "state_model": {
                "dwell": state_dwell,
                "strength": state_strength,
                "components_per_state": int(np.count_nonzero(mu.any(axis=0))) // states,
                "noise_scale": state_scale.tolist(),
                "description": (
                    "S[:, t] = states[h_t] + noise_scale * G[:, t] with G the standardised GARCH sources "
                    "and h_t the labels (Markov chain, uniform start, leaves its state with probability "
                    "1/dwell to a uniform other state); state_patterns = states @ A.T"
                ),
            },
        })
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
    return man


# ---------------------------------------------------------------------------
# the [capeDJICA] Sec. V set-up, in memory
# ---------------------------------------------------------------------------

def grid_maps(R: int, rng: np.random.Generator, n: int = 30) -> np.ndarray:
    """D x R maps on an n x n grid: 1-3 truncated Gaussian blobs (sd 1.5-3 voxels) per component, unit max."""
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


def paper_ica_data(M: int, rng: np.random.Generator, *, R: int = 20, T: int = 250, S: int = 4) -> dict:
    """The temporal-ICA set-up of [capeDJICA] Sec. V held in memory: grid maps x GARCH sources, split over sites.

    Returns the raw per-site data ``X``, the truth ``A``, the pooled-PCA whitened
    per-site data ``Z`` (float32, the paper whitens non-privately), the truth in
    that whitened space ``Aw``, ``subjects`` per site and ``T``.
    """
    from .algorithms.djica import whiten

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
