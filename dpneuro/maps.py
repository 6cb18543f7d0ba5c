"""Spatial maps: from the reduced-space model back to voxels, to NIfTI and to pictures."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .io import mask_to_image


def zscore_columns(A: np.ndarray) -> np.ndarray:
    """Each map z-scored over voxels, signed so its largest |value| is positive."""
    A = np.asarray(A, dtype=np.float64)
    Z = (A - A.mean(axis=0)) / np.maximum(A.std(axis=0), 1e-12)
    peak = Z[np.abs(Z).argmax(axis=0), np.arange(Z.shape[1])]
    return Z * np.where(peak < 0, -1.0, 1.0)


def write_components(maps_vox: np.ndarray, mask, path) -> Path:
    """Write D_voxels x R maps as a 4-D NIfTI (one volume per component) on the mask's grid."""
    img = mask_to_image(np.asarray(maps_vox, np.float32), mask)
    path = Path(path)
    img.to_filename(path)
    return path


def write_timecourses(S: np.ndarray, path, tr: float | None = None) -> Path:
    """Write R x T time courses as TSV: one column per component, one row per volume."""
    S = np.asarray(S)
    path = Path(path)
    header = "\t".join(f"IC{i + 1:02d}" for i in range(S.shape[0]))
    np.savetxt(path, S.T, delimiter="\t", header=header, comments="", fmt="%.6g")
    return path


def _is_2d(mask_shape) -> bool:
    return len(mask_shape) == 3 and mask_shape[2] == 1


def render_component(img3d, out_png, *, threshold: float = 2.0, title: str = "", bg_img=None,
                     vmax: float | None = None, cut_coords=None) -> Path:
    """One component as a PNG: ortho cuts on the MNI template (3-D) or an image (2-D grid).

    ``cut_coords`` (mm) default to the map's peak; pass the matched truth's peak
    to show a component and its truth through the same slices.
    """
    import matplotlib.pyplot as plt

    out_png = Path(out_png)
    data = np.asarray(img3d.dataobj, dtype=np.float64)
    if _is_2d(data.shape):
        fig, ax = plt.subplots(figsize=(2.4, 2.4))
        lim = vmax or max(np.abs(data).max(), 1e-12)
        ax.imshow(data[:, :, 0].T, origin="lower", cmap="RdBu_r", vmin=-lim, vmax=lim)
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    else:
        from nilearn import plotting

        fig = plt.figure(figsize=(6.0, 2.2))
        plotting.plot_stat_map(img3d, bg_img=bg_img if bg_img is not None else _template(), threshold=threshold,
                               display_mode="ortho", cut_coords=cut_coords or peak_mm(img3d), figure=fig,
                               colorbar=True,
                               annotate=False, draw_cross=False, title=title or None, vmax=vmax)
    fig.savefig(out_png, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return out_png


def _template():
    from nilearn import datasets

    return datasets.load_mni152_template(resolution=2)


def peak_mm(img3d) -> tuple[float, float, float]:
    """World coordinates of the voxel with the largest |value| (cuts go through the map's peak)."""
    data = np.asarray(img3d.dataobj)
    ijk = np.unravel_index(np.abs(data).argmax(), data.shape)
    xyz = img3d.affine @ np.r_[np.asarray(ijk, float), 1.0]
    return tuple(float(v) for v in xyz[:3])


def timecourse_figure(S: np.ndarray, tr: float, out_png, *, n_show: int | None = None, title: str = "") -> Path:
    """Each component's time course and power spectrum (one row per component); ``title`` names the data."""
    import matplotlib.pyplot as plt
    from scipy import signal

    S = np.asarray(S)
    R = S.shape[0] if n_show is None else min(n_show, S.shape[0])
    fig, axes = plt.subplots(R, 2, figsize=(8, 0.9 * R + 0.6), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    t = np.arange(S.shape[1]) * tr
    for i in range(R):
        axes[i, 0].plot(t, S[i], lw=0.6, color="0.2")
        axes[i, 0].set_ylabel(f"IC{i + 1:02d}", rotation=0, labelpad=18, fontsize=8)
        f, p = signal.welch(S[i], fs=1.0 / tr, nperseg=min(64, S.shape[1]))
        axes[i, 1].semilogy(f, p, lw=0.8, color="C0")
        for ax in axes[i]:
            ax.tick_params(labelsize=6)
            if i < R - 1:
                ax.set_xticklabels([])
    axes[-1, 0].set_xlabel("time (s)", fontsize=8)
    axes[-1, 1].set_xlabel("frequency (Hz)", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return Path(out_png)


def convergence_figure(history: dict, out_png) -> Path:
    """Unmixing convergence: ||dW||^2 (and qNGI against the truth when known) per round."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.6))
    dw = np.asarray(history.get("dW2", []), float)
    if dw.size:
        ax.semilogy(np.arange(1, dw.size + 1), dw, label="||dW||_F^2", color="C0")
    ax.set_xlabel("round")
    if history.get("qngi"):
        ax2 = ax.twinx()
        q = np.asarray(history["qngi"], float)
        ax2.plot(np.arange(1, q.size + 1), q, color="C3", label="qNGI vs truth")
        ax2.set_ylabel("qNGI", color="C3")
        ax2.set_ylim(0, max(0.5, float(np.nanmax(q)) * 1.05))
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return Path(out_png)


def png_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


