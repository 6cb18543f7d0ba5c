"""Atlases by name: the run config's ``atlas`` as a file, or a name nilearn knows.

Every reader of the ``atlas`` field calls :func:`atlas_image`, which turns it
into a concrete NIfTI (a file, or an image on the analysis grid), so that the
features, the budget planner and the run manifest's ``atlas_sha256`` all see
the same atlas, and the manifest catches sites whose copies differ.

- Coordinate atlases (``power_2011``, ``dosenbach_2010``, ``seitzman_2018``)
  come from CSVs shipped inside nilearn: never downloaded. Each coordinate
  becomes a sphere of labels on the analysis grid (:func:`sphere_labels`).
- The Schaefer 2018 atlas of 200 parcels in 7 networks ships inside the package
  (``atlas-files/``, MIT licence of its authors beside it): ``schaefer_2018:200``
  needs no download, and :func:`shipped_networks` gives each parcel's network.
- Other atlases (``schaefer_2018:100``, ``difumo:64``, ...) come from nilearn's
  fetchers, which download once into nilearn's data folder (``NILEARN_DATA``,
  else ``~/nilearn_data``) and read that cache afterwards. Without network and
  cache the run is refused with a :class:`ConfigError` saying how to provide it.

A name's parameter follows a colon: ``schaefer_2018:200``; a coordinate
atlas's is the spheres' radius, ``power_2011:8mm``.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from nibabel.affines import apply_affine
from scipy.spatial import cKDTree

from dpneuro._utils.errors import ConfigError

_HO = tuple(f"{part}-{kind}-{res}mm" for part in ("cort", "cortl", "sub")
            for kind in ("maxprob-thr0", "maxprob-thr25", "maxprob-thr50", "prob") for res in (1, 2))


@dataclass(frozen=True)
class Fetched:
    """A nilearn atlas fetcher: ``kwargs(param)`` are its arguments for the name's parameter, ``key`` the bunch
    entry holding the image, ``folder`` nilearn's dataset folder (where the download is cached)."""

    fetcher: str
    kind: str  # "labels" or "maps" (informative: the image's dimension decides)
    params: tuple  # accepted parameters, the first the default
    kwargs: Any
    folder: str
    key: str = "maps"


#: atlases nilearn downloads (once, into its data folder); 2 mm where there is a choice
FETCHED: dict[str, Fetched] = {
    "schaefer_2018": Fetched("fetch_atlas_schaefer_2018", "labels", (200, 100, 300, 400, 500, 600, 700, 800, 900, 1000),
                             lambda p: {"n_rois": p, "yeo_networks": 7, "resolution_mm": 2}, "schaefer_2018"),
    "difumo": Fetched("fetch_atlas_difumo", "maps", (64, 128, 256, 512, 1024),
                      lambda p: {"dimension": p, "resolution_mm": 2}, "difumo_atlases"),
    "basc_multiscale_2015": Fetched("fetch_atlas_basc_multiscale_2015", "labels",
                                    (122, 7, 12, 20, 36, 64, 197, 325, 444),
                                    lambda p: {"resolution": p, "version": "sym"}, "basc_multiscale_2015"),
    "msdl": Fetched("fetch_atlas_msdl", "maps", (None,), lambda p: {}, "msdl_atlas"),
    "harvard_oxford": Fetched("fetch_atlas_harvard_oxford", "labels", ("cort-maxprob-thr25-2mm",) + _HO,
                              lambda p: {"atlas_name": p}, "fsl"),
    "smith_2009": Fetched("fetch_atlas_smith_2009", "maps", ("rsn20", "rsn10", "rsn70", "bm10", "bm20", "bm70"),
                          lambda p: {"dimension": int(p[-2:]), "resting": p.startswith("rsn")}, "smith_2009"),
    # the 28 resting-state networks of the paper (its 75 components are the bunch's "maps")
    "allen_rsn_2011": Fetched("fetch_atlas_allen_2011", "maps", (None,), lambda p: {}, "allen_rsn_2011", "rsn28"),
}

#: atlases of MNI coordinates shipped inside nilearn (no download): fetcher, default sphere radius in mm (None: the
#: atlas's own per-ROI radii)
COORDINATES: dict[str, tuple[str, float | None]] = {
    "power_2011": ("fetch_coords_power_2011", 5.0),  # 10 mm diameter spheres, as in the paper
    "dosenbach_2010": ("fetch_coords_dosenbach_2010", 5.0),
    "seitzman_2018": ("fetch_coords_seitzman_2018", None),  # 5 mm, 4 mm for the subcortex and cerebellum
}

NAMES = tuple(COORDINATES) + tuple(FETCHED)

_FILES = Path(__file__).resolve().parent / "atlas-files"
#: atlases inside the package (name, parameter) -> folder, image and table of parcels (index, name, network,
#: hemisphere); read instead of fetching
SHIPPED: dict[tuple[str, Any], tuple[Path, str, str]] = {
    ("schaefer_2018", 200): (_FILES / "schaefer2018_200_7networks",
                             "Schaefer2018_200Parcels_7Networks_order_FSLMNI152_2mm.nii.gz",
                             "Schaefer2018_200Parcels_7Networks_order.tsv"),
}
#: the shipped functional atlas: the default features on MNI grids and the networks components are named by
FUNCTIONAL = "schaefer_2018:200"


def _split(atlas: str) -> tuple[str, str | None]:
    name, sep, param = atlas.partition(":")
    return name.strip().lower(), (param.strip() if sep else None)


def is_atlas_name(atlas: Any) -> bool:
    """Whether ``atlas`` (the config field) names an atlas rather than giving a file: its part before any colon is
    one of :data:`NAMES`."""
    return isinstance(atlas, str) and _split(atlas)[0] in NAMES


def _natural(p) -> tuple[str, int]:
    return re.sub(r"\d", "", str(p)), int(re.sub(r"\D", "", str(p)) or 0)


def accepted() -> str:
    """The accepted names and their parameters, for messages and docs."""
    out = [f"{n}[:<radius>mm]" for n in COORDINATES]
    for n, f in FETCHED.items():
        shown = "(cort|cortl|sub)-(maxprob-thr0|25|50|prob)-(1|2)mm" if n == "harvard_oxford" else \
            "|".join(str(p) for p in sorted(set(f.params) - {None}, key=_natural))
        out.append(f"{n}:{shown}" if shown else n)
    return ", ".join(out)


def parse(atlas: str) -> tuple[str, Any]:
    """The name and its parameter (the default when none is given); :class:`ConfigError` for a bad one."""
    name, param = _split(atlas)

    def bad(why: str):
        raise ConfigError(f"config field 'atlas': {atlas!r}: {why}")

    if name in COORDINATES:
        if param is None:
            return name, COORDINATES[name][1]
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(mm)?", param)
        if not m or float(m.group(1)) <= 0:
            bad(f"the parameter of a coordinate atlas is the spheres' radius in mm (e.g. {name}:8mm), got {param!r}")
        return name, float(m.group(1))
    if name not in FETCHED:
        bad(f"unknown atlas name; accepted: {accepted()}")
    spec = FETCHED[name]
    if param is None:
        return name, spec.params[0]
    if spec.params == (None,):
        bad(f"{name} takes no parameter")
    value: Any = param.lower()
    if isinstance(spec.params[0], int):
        value = int(param) if param.isdigit() else param
    if value not in spec.params:
        bad(f"{name} takes one of {', '.join(str(p) for p in sorted(spec.params, key=_natural))}, got {param!r}")
    return name, value


def check(atlas: str) -> str | None:
    """What is wrong with the config field ``atlas`` without fetching anything (None: nothing)."""
    if not atlas:
        return None
    if is_atlas_name(atlas):
        try:
            parse(atlas)
        except ConfigError as exc:
            return str(exc).split(": ", 1)[1]
        return None
    if not Path(atlas).is_file():
        return f"{atlas} does not exist (a NIfTI file, or an atlas name: {accepted()})"
    return None


def cache_folder(name: str) -> Path:
    """Where nilearn keeps (or would download) a fetched atlas: its first data folder (``NILEARN_SHARED_DATA``,
    ``NILEARN_DATA``, then ``~/nilearn_data``) and the dataset's folder."""
    from nilearn.datasets import get_data_dirs  # deferred: nilearn is slow to load

    return Path(get_data_dirs()[0]) / FETCHED[name].folder


def fetch(atlas: str):
    """The NIfTI (path or image) a fetched atlas's name stands for; downloads on first use, later reads the cache."""
    name, param = parse(atlas)
    if name not in FETCHED:
        raise ValueError(f"{atlas!r} is a coordinate atlas: see atlas_image")
    if (name, param) in SHIPPED:
        folder, image, _ = SHIPPED[name, param]
        return str(folder / image)
    dirs = os.environ.get("NILEARN_SHARED_DATA"), os.environ.get("NILEARN_DATA")
    return _fetch(name, param, dirs)


@functools.lru_cache(maxsize=8)
def _fetch(name: str, param: Any, dirs: tuple) -> Any:  # dirs: so that a changed data folder fetches again
    import nilearn.datasets  # deferred: nilearn is slow to load

    spec = FETCHED[name]
    try:
        # data_dir=None: nilearn's own folders, where an earlier download is found
        bunch = getattr(nilearn.datasets, spec.fetcher)(data_dir=None, verbose=0, **spec.kwargs(param))
        img = bunch[spec.key]
    except Exception as exc:  # offline nilearn raises requests/OS errors, or its own after retries
        label = name if param is None else f"{name}:{param}"
        raise ConfigError(
            f"config field 'atlas': {label!r}: nilearn could not fetch it ({type(exc).__name__}: {exc}). It is "
            f"downloaded once and then read from {cache_folder(name)}. Run `python -m dpneuro.data.atlases {label}` "
            "on a machine that is online (with the same NILEARN_DATA) and copy that folder here, set NILEARN_DATA "
            "to a folder that holds it, or give the path of the atlas's NIfTI file as 'atlas'") from exc
    return str(img) if isinstance(img, (str, Path)) else img


def shipped_networks(atlas: str = FUNCTIONAL) -> dict[int, tuple[str, str, str]]:
    """A shipped atlas's parcels: label value -> (name, network, hemisphere), from the table beside its image."""
    folder, _, table = SHIPPED[parse(atlas)]
    out = {}
    lines = (folder / table).read_text().splitlines()
    for line in lines[1:]:
        index, name, network, hemisphere = line.split("\t")
        out[int(index)] = (name, network, hemisphere)
    return out


def coordinates(name: str) -> tuple[np.ndarray, np.ndarray | None, list[str]]:
    """A coordinate atlas's MNI centres (n x 3, mm), its own per-ROI radii (None: none given) and a name per ROI
    (with its network where nilearn has one), in nilearn's order."""
    import nilearn.datasets  # deferred: nilearn is slow to load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nilearn's notes on its legacy outputs
        b = getattr(nilearn.datasets, COORDINATES[name][0])()
    rois = b["rois"]
    xyz = np.asarray(rois[["x", "y", "z"]], dtype=np.float64)
    radius = np.asarray(b["radius"], dtype=np.float64) if "radius" in b else None
    n = len(xyz)
    labels = [str(v) for v in b["labels"]] if "labels" in b else (
        [f"roi {v}" for v in rois["roi"]] if "roi" in rois else [f"roi {i + 1}" for i in range(n)])
    if "networks" in b:
        extra = [str(v) for v in np.asarray(b["networks"])]
        if "regions" in b:
            extra = [f"{a}, {r}" for a, r in zip(extra, np.asarray(b["regions"]))]
        labels = [f"{lab} ({e})" for lab, e in zip(labels, extra)]
    return xyz, radius, labels


def sphere_labels(centres: np.ndarray, radius, mask: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """A label volume on the grid (0: no sphere; ROI k -> k + 1) of spheres around world coordinates.

    A mask voxel within ``radius`` mm (scalar or one per centre) of centres
    goes to the nearest one. A centre whose sphere reaches no mask voxel (a
    coarse grid: 6 mm voxels around a 5 mm sphere) takes the grid voxel
    nearest to it if that voxel is in the mask, from the sphere that had it
    unless it was that sphere's only voxel; a centre outside the mask gets
    nothing and so drops out of the features.
    """
    centres = np.asarray(centres, dtype=np.float64).reshape(-1, 3)
    radii = np.broadcast_to(np.asarray(radius, dtype=np.float64), (len(centres),))
    mask = np.asarray(mask, bool)
    ijk = np.argwhere(mask)
    xyz = apply_affine(affine, ijk)
    tree = cKDTree(xyz)
    owner = np.full(len(ijk), -1, np.int64)
    dist = np.full(len(ijk), np.inf)
    for k, (c, r) in enumerate(zip(centres, radii)):
        idx = np.asarray(tree.query_ball_point(c, r * (1 + 1e-9)), dtype=np.int64)  # on the sphere counts
        if idx.size:
            d = np.linalg.norm(xyz[idx] - c, axis=1)
            closer = d < dist[idx]  # ties stay with the earlier centre
            owner[idx[closer]], dist[idx[closer]] = k, d[closer]
    position = np.full(mask.shape, -1, np.int64)
    position[mask] = np.arange(len(ijk))  # argwhere's order is the mask's C order
    sizes = np.bincount(owner[owner >= 0], minlength=len(centres))
    for k in np.flatnonzero(sizes == 0):
        v = np.round(apply_affine(np.linalg.inv(affine), centres[k])).astype(np.int64)
        if np.any(v < 0) or np.any(v >= mask.shape):
            continue
        i = position[tuple(v)]
        if i < 0 or (owner[i] >= 0 and sizes[owner[i]] == 1):
            continue  # outside the mask, or another centre's only voxel
        if owner[i] >= 0:
            sizes[owner[i]] -= 1
        owner[i], sizes[k] = k, 1
    out = np.zeros(mask.shape, np.int32)
    out[mask] = owner + 1
    return out


def atlas_image(atlas, mask: np.ndarray, affine: np.ndarray):
    """The atlas the config field ``atlas`` stands for, as parcellation's functions take it: a file's path (or an
    image) as given; a fetched atlas's cached file or image; a coordinate atlas's spheres as a label image on the
    grid (``mask``, ``affine``)."""
    if not is_atlas_name(atlas):
        return atlas
    name, param = parse(atlas)
    if name in FETCHED:
        return fetch(atlas)
    centres, own, _ = coordinates(name)
    radius = own if param is None else param
    labels = sphere_labels(centres, radius, mask, affine)
    if not labels.any():
        raise ValueError(f"atlas {atlas}: none of its {len(centres)} MNI coordinates falls in the analysis mask "
                         "(is the grid in MNI space?)")
    return nib.Nifti1Image(labels, np.asarray(affine, np.float64))


def main(argv: list[str] | None = None) -> int:
    """``python -m dpneuro.data.atlases NAME ...``: fetch atlases into nilearn's data folder (on a machine that is
    online)
    and print where they are."""
    names = sys.argv[1:] if argv is None else argv
    if not names:
        print(f"usage: python -m dpneuro.data.atlases NAME ...; names: {accepted()}")
        return 2
    for atlas in names:
        if _split(atlas)[0] in COORDINATES:
            print(f"{atlas}: shipped with nilearn, nothing to fetch")
            continue
        if parse(atlas) in SHIPPED:
            print(f"{atlas}: shipped with dpneuro, nothing to fetch ({fetch(atlas)})")
            continue
        img = fetch(atlas)
        print(f"{atlas}: {img if isinstance(img, str) else cache_folder(parse(atlas)[0])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
