"""Synthetic multi-site resting-state fMRI with known ground truth.

The generative model is the one of the temporal-ICA papers: R spatial maps
(columns of a D x R mixing matrix ``A`` over the mask voxels), R source time
courses per subject drawn from a GARCH(1,1) process (heavy-tailed,
standardised), and per subject

    X = A S + noise * N(0, 1)        (D x T, float32)

written as one real 4-D NIfTI file per subject per site, with the mask, the
maps, ``A`` and every ``S`` alongside and a ``manifest.json`` describing it
all. Everything is fully determined by the seed.

Folder layout written by :func:`make_consortium`::

    out_dir/
      manifest.json
      mask.nii.gz
      site-01/sub-0001_bold.nii.gz ...
      site-02/sub-0004_bold.nii.gz ...   (subject numbers unique consortium-wide)
      truth/maps.nii.gz                  4-D, one volume per component
      truth/A.npy                        D x R float32, maps as columns
      truth/S_site-01_sub-0001.npy       R x T float32, one file per subject

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

__all__ = ["make_consortium", "load_manifest", "garch_sources"]


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
    return out


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

    Returns
    -------
    dict
        The manifest with absolute paths: ``manifest_path``, ``root``,
        ``sites`` (list of ``{"site", "path", "subjects": [{"id", "path",
        "sources"}]}``), ``mask``, ``space``, ``shape``, ``affine``,
        ``n_voxels``, ``n_components``, ``n_timepoints``, ``tr``, ``seed``,
        ``noise`` and ``truth`` (``maps``, ``A``, ``sources`` description,
        ``garch`` parameters).

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
                ).astype(np.float32)
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
