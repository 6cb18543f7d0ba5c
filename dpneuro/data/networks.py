"""Every component named: its network, its peak, its hemisphere, how much of it looks like noise.

The consortium's maps are public results, so naming them costs no privacy.
A component's weight at a voxel is the square of its z-scored map's positive
part, after the sign that makes its heavier tail positive (ICA leaves the sign
free). Its **overlap** with a network is the share of that weight inside the
network's parcels of the shipped Schaefer 2018 atlas (7 networks, cortex
only); mask voxels outside the atlas count as "Cerebellum" or "Subcortical"
by MNI coordinate boxes (below), the rest as "Other". The component's network
is the largest overlap.

The **noise fraction** is the share of weight in voxels outside nilearn's
MNI152 grey-matter mask or on the brain mask's edge (a mask voxel with a
6-neighbour outside it), where motion, CSF and vessels show, as GIFT's
autolabeller scores components against grey matter. Above
:data:`NOISE_FLAG` the component is flagged.

Names are only given on an MNI grid: when the atlas covers less than
:data:`MIN_COVERAGE` of the mask (another space, a toy grid) every component
is "unnamed" and only its peak, spectrum share and noise fraction are given.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import numpy as np
from nibabel.affines import apply_affine
from scipy import ndimage

from dpneuro.data.atlases import FUNCTIONAL, fetch, shipped_networks
from dpneuro.data.parcellation import atlas_labels

#: the Yeo 2011 networks in the atlas's order, then what lies outside the cortex
NETWORKS = ("Vis", "SomMot", "DorsAttn", "SalVentAttn", "Limbic", "Cont", "Default")
REGIONS = NETWORKS + ("Subcortical", "Cerebellum", "Other")
#: readable names of the atlas's network abbreviations (Yeo et al. 2011)
LONG_NAMES = {"Vis": "visual", "SomMot": "somatomotor", "DorsAttn": "dorsal attention",
              "SalVentAttn": "salience / ventral attention", "Limbic": "limbic", "Cont": "frontoparietal control",
              "Default": "default mode", "Subcortical": "subcortical", "Cerebellum": "cerebellum",
              "Other": "white matter / edge", "unnamed": "unnamed"}
#: share of a component's weight outside grey matter or on the mask's edge above which it is flagged as noise
NOISE_FLAG = 0.6
#: the atlas's share of the mask below which the grid is not taken for MNI space
MIN_COVERAGE = 0.25


@dataclass(frozen=True)
class ComponentLabel:
    """What :func:`name_components` says of one component (``overlap``: one share per :data:`REGIONS`)."""

    network: str
    overlap: dict[str, float]
    peak_mm: tuple[float, float, float]
    hemisphere: str
    noise_fraction: float
    noise: bool
    variance_share: float
    sign: int

    def to_row(self) -> dict:
        row = asdict(self)
        overlap = row.pop("overlap")
        x, y, z = row.pop("peak_mm")
        return {**row, "network_name": LONG_NAMES[self.network], "peak_x": x, "peak_y": y, "peak_z": z,
                **{f"overlap_{k}": v for k, v in overlap.items()}}


def _boxes(xyz: np.ndarray) -> np.ndarray:
    """Region index (in :data:`REGIONS`) of voxels outside the atlas, by MNI position: the cerebellum lies
    below and behind the brainstem, the deep nuclei and the brainstem near the midline."""
    x, y, z = xyz.T
    out = np.full(len(xyz), REGIONS.index("Other"))
    deep = (np.abs(x) < 35) & (y > -45) & (y < 30) & (z > -50) & (z < 25)
    out[deep] = REGIONS.index("Subcortical")
    out[(y < -40) & (z < -12)] = REGIONS.index("Cerebellum")
    return out


@functools.lru_cache(maxsize=8)
def _regions_cached(mask_bytes: bytes, shape: tuple, affine_bytes: bytes) -> tuple[np.ndarray, float, np.ndarray]:
    mask = np.frombuffer(mask_bytes, bool).reshape(shape)
    affine = np.frombuffer(affine_bytes, np.float64).reshape(4, 4)
    try:
        labels, values = atlas_labels(fetch(FUNCTIONAL), mask, affine)
    except ValueError:  # no parcel on this grid: not MNI
        return np.full(int(mask.sum()), -1), 0.0, np.zeros(int(mask.sum()), bool)
    nets = shipped_networks()
    network_of_value = np.array([NETWORKS.index(nets[v][1]) for v in values])
    region = np.where(labels >= 0, network_of_value[np.maximum(labels, 0)], -1)
    xyz = apply_affine(affine, np.argwhere(mask))
    outside = region < 0
    region[outside] = _boxes(xyz[outside])
    coverage = float(np.mean(~outside))
    return region, coverage, _noise_voxels(mask, affine)


def _noise_voxels(mask: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """Mask voxels outside grey matter or on the mask's edge (mask order)."""
    from nilearn.datasets import load_mni152_gm_mask  # deferred: nilearn is slow to load; the mask ships with it
    from nilearn.image import resample_img

    gm = resample_img(load_mni152_gm_mask(), target_affine=affine, target_shape=mask.shape,
                      interpolation="nearest", force_resample=True, copy_header=True)
    grey = np.asarray(gm.dataobj) > 0
    edge = mask & ~ndimage.binary_erosion(mask, border_value=0)
    return (~grey | edge)[mask]


def voxel_regions(mask: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """Each mask voxel's region (index into :data:`REGIONS`), the atlas's coverage of the mask, and the voxels
    that count as noise (outside grey matter or on the edge)."""
    mask = np.ascontiguousarray(mask, bool)
    return _regions_cached(mask.tobytes(), mask.shape, np.ascontiguousarray(affine, np.float64).tobytes())


def component_variances(eigenvalues, W) -> np.ndarray:
    """Each component's share of the released eigen-spectrum: its map A_k = V Lambda^{1/2} (W^{-1})_k carries
    ||A_k||^2 = sum_j lambda_j (W^{-1})_jk^2 of the released variance (negative eigenvalues, all noise, count as
    0); the shares sum to 1 (to the released total when W is orthogonal)."""
    lam = np.maximum(np.asarray(eigenvalues, np.float64), 0.0)
    var = lam @ np.linalg.inv(np.asarray(W, np.float64)) ** 2
    total = var.sum()
    return var / total if total > 0 else np.zeros(len(var))


def name_components(maps: np.ndarray, mask: np.ndarray, affine: np.ndarray,
                    variance_share: np.ndarray | None = None) -> list[ComponentLabel]:
    """Name the columns of ``maps`` (mask voxels x components, any scale)."""
    maps = np.asarray(maps, np.float64)
    region, coverage, noisy = voxel_regions(mask, affine)
    xyz = apply_affine(affine, np.argwhere(mask))
    shares = np.zeros(maps.shape[1]) if variance_share is None else np.asarray(variance_share, np.float64)
    out = []
    for k in range(maps.shape[1]):
        m = maps[:, k]
        sign = 1 if np.sum(m**3) >= 0 else -1  # the heavier tail positive
        z = sign * (m - m.mean()) / (m.std() or 1.0)
        w = np.maximum(z, 0.0) ** 2
        total = w.sum() or 1.0
        overlap = {name: float(w[region == i].sum() / total) for i, name in enumerate(REGIONS)}
        top = int(np.argmax(z))
        hemi_l, hemi_r = w[xyz[:, 0] < 0].sum(), w[xyz[:, 0] > 0].sum()
        lateral = (hemi_l - hemi_r) / ((hemi_l + hemi_r) or 1.0)
        hemisphere = "bilateral" if abs(lateral) < 0.3 else ("left" if lateral > 0 else "right")
        noise = float(w[noisy].sum() / total)
        network = max(REGIONS, key=overlap.__getitem__) if coverage >= MIN_COVERAGE else "unnamed"
        out.append(ComponentLabel(network=network, overlap=overlap, peak_mm=tuple(float(v) for v in xyz[top]),
                                  hemisphere=hemisphere, noise_fraction=noise, noise=noise > NOISE_FLAG,
                                  variance_share=float(shares[k]), sign=sign))
    return out


def network_order(labels: list[ComponentLabel]) -> np.ndarray:
    """The components in network order (the atlas's networks, then subcortical, cerebellum, other, unnamed; noise
    last), each network's by decreasing share of the spectrum."""
    rank = {name: i for i, name in enumerate(REGIONS + ("unnamed",))}
    return np.array(sorted(range(len(labels)),
                           key=lambda k: (labels[k].noise, rank[labels[k].network], -labels[k].variance_share, k)),
                    dtype=np.int64)
