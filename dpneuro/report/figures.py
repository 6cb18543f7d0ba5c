"""Spatial maps: from the reduced-space model back to voxels, to NIfTI and to pictures."""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy.cluster.hierarchy import leaves_list, linkage
from scipy.spatial.distance import squareform

from dpneuro.data.io import bids_entities, load_mask, mask_to_image, resolve_workers


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


#: the index columns of a time-course table, before one column per component (IC01, IC02, ...)
TIMECOURSE_INDEX = ("subject", "session", "task", "run", "volume", "onset")


def timecourse_rows(site: dict) -> list[tuple]:
    """The index of every column of a site's matrix: (subject, session, task, run, volume, onset).

    ``site``: a site record (the load stage's ``site.json``: ``subject_ids``,
    ``boundaries``, ``run_records``, ``tr``). session, task and run are the
    BIDS labels of the run's file name ("n/a" where it has none); volume is
    the index within the run (scrubbing keeps the indices of the volumes it
    keeps); onset is volume x the run's TR in seconds ("n/a" without a TR).
    Without run records (a matrix given in memory) each subject is one run.
    """
    runs = site.get("run_records") or []
    tr_site = site.get("tr")
    rows: list[tuple] = []
    if not runs:
        for sid, (a, b) in zip(site["subject_ids"], site["boundaries"]):
            rows += [(sid, "n/a", "n/a", "n/a", v, _onset(v, tr_site)) for v in range(b - a)]
        return rows
    for r in runs:
        ent = bids_entities(r["path"])
        kept = r.get("kept_volumes")
        vols = range(int(r["columns"])) if kept is None else [int(v) for v in kept]
        tr = r.get("tr") or tr_site
        ses, task, run = (ent.get(k, "n/a") for k in ("ses", "task", "run"))
        rows += [(r["subject"], ses, task, run, v, _onset(v, tr)) for v in vols]
    return rows


def _onset(volume: int, tr) -> float | str:
    return round(volume * float(tr), 6) if tr else "n/a"


def write_timecourses(S: np.ndarray, path, site: dict | None = None) -> Path:
    """Write R x T time courses as a BIDS-style TSV and its JSON sidecar (``.json`` beside it).

    Columns :data:`TIMECOURSE_INDEX` (from ``site``, see :func:`timecourse_rows`; without it one subject
    "all"), then IC01, IC02, ... The sidecar describes the columns and, when every run shares it, gives
    ``RepetitionTime``.
    """
    S = np.asarray(S)
    path = Path(path)
    T = S.shape[1]
    site = site if site is not None else {"subject_ids": ["all"], "boundaries": [(0, T)]}
    rows = timecourse_rows(site)
    if len(rows) != T:
        raise ValueError(f"{T} time points but the site's runs index {len(rows)}")
    names = [f"IC{i + 1:02d}" for i in range(S.shape[0])]
    with open(path, "w") as f:
        f.write("\t".join([*TIMECOURSE_INDEX, *names]) + "\n")
        for t, row in enumerate(rows):
            f.write("\t".join(str(x) for x in row) + "\t" + "\t".join(f"{x:.6g}" for x in S[:, t]) + "\n")
    trs = {float(r["tr"]) for r in site.get("run_records") or [] if r.get("tr")}
    if not site.get("run_records") and site.get("tr"):
        trs = {float(site["tr"])}
    side = {
        "subject": {"Description": "subject (person) of the site"},
        "session": {"Description": "BIDS session label of the run (n/a: none)"},
        "task": {"Description": "BIDS task label of the run (n/a: none)"},
        "run": {"Description": "BIDS run index of the run (n/a: none)"},
        "volume": {"Description": "index of the volume within its run (0-based; volumes scrubbing removed "
                                  "are absent)"},
        "onset": {"Description": "start of the volume from the start of its run", "Units": "s"},
        **{n: {"Description": f"time course of group component {i + 1} (z-scored map {i + 1} of "
                              "components.nii.gz)"} for i, n in enumerate(names)},
    }
    if len(trs) == 1:
        side["RepetitionTime"] = trs.pop()
    path.with_suffix(".json").write_text(json.dumps(side, indent=1))
    return path


def read_timecourses(path) -> tuple[list[str], np.ndarray]:
    """The subject of every volume and the R x T time courses of a file from :func:`write_timecourses`."""
    lines = Path(path).read_text().splitlines()
    header = lines[0].split("\t")
    comp = [i for i, h in enumerate(header) if h.startswith("IC")]
    rows = [ln.split("\t") for ln in lines[1:] if ln.strip()]
    subjects = [r[0] for r in rows]
    S = np.array([[float(r[i]) for i in comp] for r in rows], dtype=np.float64).reshape(len(rows), len(comp)).T
    return subjects, S


def _is_2d(mask_shape) -> bool:
    return len(mask_shape) == 3 and mask_shape[2] == 1


#: maps are z-scored; voxels with |z| above this are coloured
MAP_THRESHOLD = 2.0


def render_component(img3d, out_png, **kw) -> Path:
    """:func:`component_figure` as a PNG at ``out_png``."""
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it

    fig = component_figure(img3d, **kw)
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out_png


#: fewer figures than this are drawn in this process: starting a worker (imports, template) costs ~2 s
PARALLEL_FIGURES = 16


def _render_job(job) -> Path:
    data, affine, out_png, kw = job
    return render_component(nib.Nifti1Image(data, affine), out_png, **kw)


def render_many(jobs: list[tuple], workers: int | None = None) -> list[Path]:
    """:func:`render_component` of every ``(img3d, out_png, kwargs)``, in worker processes when there are many.

    Each figure is ~0.3 s of matplotlib under the GIL and a report with four
    sites' voxel maps draws ~100, more than the analysis takes. loky's
    workers (joblib's) start clean, without re-running the caller's script,
    and are shut down on return: kept alive, they held a Pydra worker for
    their 300 s idle timeout.
    """
    from joblib.externals.loky import ProcessPoolExecutor  # deferred: only the figures' process pool needs it

    packed = [(np.asarray(img.dataobj), img.affine, str(out), kw) for img, out, kw in jobs]
    workers = min(resolve_workers(workers), len(jobs) // (PARALLEL_FIGURES // 2))
    if workers < 2 or len(jobs) < PARALLEL_FIGURES:
        return [_render_job(j) for j in packed]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_render_job, packed, chunksize=4))


def component_figure(img3d, *, threshold: float = MAP_THRESHOLD, title: str = "", bg_img=None,
                     vmax: float | None = None, cut_coords=None, on_template: bool = True, width: float = 9.0):
    """One component's matplotlib figure: ortho cuts on the MNI template (3-D) or an image (2-D grid).

    The cuts are annotated with their coordinates (mm) and L/R; the colour
    bar's ticks are the threshold and the ends (:func:`colorbar_ticks`), and
    its caption sits below the cuts. ``cut_coords`` (mm) default to the
    map's peak; pass the matched truth's peak to show a component and its
    truth through the same slices. ``on_template=False`` (data not in MNI
    space) draws the map on its own grid, without the template. ``width``
    (inches at 100 dpi) of a 3-D figure: a narrower one keeps its labels
    readable where two are shown side by side.
    """
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it

    data = np.asarray(img3d.dataobj, dtype=np.float64)
    if _is_2d(data.shape):
        fig, ax = plt.subplots(figsize=(3.6, 3.6))
        lim = vmax or max(np.abs(data).max(), 1e-12)
        im = ax.imshow(data[:, :, 0].T, origin="lower", cmap="RdBu_r", vmin=-lim, vmax=lim)
        ax.set_title(title, fontsize=10)
        ax.axis("off")
        cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        cb.set_label("z-score", fontsize=8)
    else:
        from nilearn import plotting  # deferred: nilearn is slow to load

        fig = plt.figure(figsize=(width, width * 3.2 / 9.0))
        bg = (bg_img if bg_img is not None else _template()) if on_template else False
        display = plotting.plot_stat_map(img3d, bg_img=bg, threshold=threshold, display_mode="ortho",
                                         cut_coords=cut_coords or peak_mm(img3d), figure=fig, colorbar=True,
                                         annotate=True, draw_cross=False, title=title or None, vmax=vmax)
        cbar = getattr(display, "_cbar", None)  # nilearn keeps its colour bar private
        if cbar is not None:
            lim = float(cbar.norm.vmax)
            ticks = colorbar_ticks(lim, threshold)
            old = cbar.ax.yaxis.get_ticklabels()
            color = old[0].get_color() if old else "w"  # nilearn's colour for the background it drew
            cbar.set_ticks(ticks, labels=[f"{t:.2g}" for t in ticks])
            cbar.ax.tick_params(labelcolor=color)
        # below the cuts (savefig's tight box grows to hold it), never over the colour bar's lowest label
        fig.text(0.995, -0.01, f"colour: z-score, |z| > {threshold:g} shown", ha="right", va="top", fontsize=9,
                 color="0.75")
    return fig


def colorbar_ticks(vmax: float, threshold: float, *, min_gap: float = 0.12) -> list[float]:
    """Colour-bar ticks of a thresholded symmetric map: the threshold and the ends, +-.

    The band between -threshold and +threshold is not drawn, so 0 gets no
    tick; an end closer to the threshold than ``min_gap`` of the bar's span
    is dropped, so that no two labels overlap.
    """
    if threshold <= 0 or threshold >= vmax:
        return [-vmax, 0.0, vmax]
    ends = [vmax] if (vmax - threshold) / (2 * vmax) >= min_gap else []
    return [-v for v in ends] + [-threshold, threshold] + ends


def template_problem(mask_img) -> str | None:
    """Why maps on this grid must not be drawn on the MNI152 template (None: they may).

    The mask's voxels are looked up in the MNI152 brain mask through the
    affines: native-space data (another head position, scanner coordinates)
    land largely outside it.
    """
    from nilearn import datasets  # deferred: nilearn is slow to load

    m, affine = load_mask(mask_img)
    if _is_2d(m.shape):
        return None
    ref = datasets.load_mni152_brain_mask(resolution=2)
    ijk = np.argwhere(m)
    xyz = affine @ np.c_[ijk, np.ones(len(ijk))].T
    vox = np.rint(np.linalg.inv(ref.affine) @ xyz)[:3].astype(int).T
    inside = np.all((vox >= 0) & (vox < np.array(ref.shape[:3])), axis=1)
    refd = np.asarray(ref.dataobj) > 0
    frac = float(refd[tuple(vox[inside].T)].mean() * inside.mean()) if inside.any() else 0.0
    if frac < 0.7:
        return (f"the data grid is not in MNI space (only {frac:.0%} of its mask lies inside the MNI152 brain): "
                "maps are drawn on their own grid, not on the template; register the data to MNI space to "
                "compare them with atlases")
    return None


def interactive_view(img3d, *, threshold: float = MAP_THRESHOLD, on_template: bool = True) -> str:
    """nilearn's interactive viewer (view_img) as a self-contained HTML page (no network access)."""
    from nilearn import plotting  # deferred: nilearn is slow to load

    with warnings.catch_warnings():  # numpy's note on nilearn's masked-array percentile
        warnings.filterwarnings("ignore", message=".*partition.*will ignore the 'mask'")
        view = plotting.view_img(img3d, threshold=threshold, bg_img=_template() if on_template else False,
                                 symmetric_cmap=True, colorbar=True, title=None)
    html_doc = view.get_standalone()
    return re.sub(r"<link[^>]*rel=[\"']?(?:shortcut )?icon[^>]*>", "", html_doc)  # the only remote resource


_CHECK = object()


def render_components(components_path, mask_path, figs: Path, *, truth: dict | None = None,
                      interactive: bool = False, problem=_CHECK,
                      kind: str = "component", names: list[str] | None = None) -> tuple[list[dict], str, list[str]]:
    """Every component of a 4-D maps file as report entries: (entries, how they are drawn, warnings).

    ``truth`` (``maps``, ``perm``, ``corr``): components in the order of the
    truth maps they match, each beside its truth, through the same slices and
    with the truth's sign. Data outside MNI space are drawn on their own grid,
    with a warning; ``problem`` is :func:`template_problem` of the mask when
    the caller has it already. ``kind``: ``"component"`` (labels IC01, ...)
    or ``"state"`` (brain-state patterns, labels state 1, ...). ``names``: a caption per component (its network),
    added to its label.
    """
    figs = Path(figs)
    figs.mkdir(parents=True, exist_ok=True)
    img = nib.load(str(components_path))
    if problem is _CHECK:
        problem = template_problem(mask_path)
    on_template = problem is None
    three_d = not _is_2d(img.shape[:3])
    order = list(range(img.shape[3]))
    truth_img = None
    if truth:
        order = list(truth["perm"])
        mask = load_mask(mask_path)[0]
        truth_img = mask_to_image(zscore_columns(np.asarray(nib.load(truth["maps"]).dataobj)[mask]), mask_path)
    entries, jobs = [], []
    for j, c in enumerate(order):
        label = f"IC{c + 1:02d}" if kind == "component" else f"{kind} {c + 1}"
        if names and names[c]:
            label += f" {names[c]}"
        # index, sign and cuts as drawn: a site's voxel map of the component is drawn the same way beside it
        entry: dict = {"label": label, "index": c, "sign": 1.0}
        comp3d = img.slicer[..., c]
        cut = peak_mm(comp3d) if three_d else None
        if truth_img is not None:
            t3d = truth_img.slicer[..., j]
            cut = peak_mm(t3d) if three_d else None
            if truth["corr"][j] < 0:
                comp3d = nib.Nifti1Image(-np.asarray(comp3d.dataobj), comp3d.affine)
                entry["sign"] = -1.0
            entry.update(truth_png=str(figs / f"truth_{j + 1:02d}.png"), corr=abs(truth["corr"][j]))
            jobs.append((t3d, entry["truth_png"], dict(title=f"truth {j + 1}", cut_coords=cut,
                                                       on_template=on_template)))
        entry["png"] = str(figs / f"{kind}_{c + 1:02d}.png")
        jobs.append((comp3d, entry["png"], dict(title=label, cut_coords=cut, on_template=on_template)))
        entry["cut"] = cut
        if interactive and three_d:
            entry["interactive"] = interactive_view(comp3d, on_template=on_template)
        entries.append(entry)
    render_many(jobs)
    where = ("on the MNI152 template (2 mm), through each map's peak (slice coordinates in mm; L = left)"
             if three_d and on_template else "on the data's own grid")
    note = (f"Each map is z-scored over voxels; voxels with |z| > {MAP_THRESHOLD:g} are coloured (colour bar: "
            f"z-score), shown {where}.")
    return entries, note, [f"WARNING: {problem}"] if problem else []


def render_site_maps(entries: list[dict], site_maps: dict[str, str], components_path, mask_path, figs: Path, *,
                     problem=_CHECK) -> list[dict]:
    """Each site's voxel map of every component, drawn beside the consortium's (``entries`` of
    :func:`render_components`): each entry gets ``sites``, a list of ``{site, png, r}``.

    A site's map goes through the same slices as the consortium's map, with
    the sign that agrees with it; ``r`` is their correlation over the mask's
    voxels (how far the site's own voxels moved the map from the painted parcels).
    """
    figs = Path(figs)
    figs.mkdir(parents=True, exist_ok=True)
    if problem is _CHECK:
        problem = template_problem(mask_path)
    mask = load_mask(mask_path)[0]
    group = np.asarray(nib.load(str(components_path)).dataobj, np.float64)[mask]
    jobs = []
    for site, path in site_maps.items():
        img = nib.load(str(path))
        vox = np.asarray(img.dataobj, np.float64)[mask]
        for e in entries:
            c = e["index"]
            a, g = vox[:, c], e["sign"] * group[:, c]
            r = float(np.corrcoef(a, g)[0, 1]) if a.std() > 0 and g.std() > 0 else 0.0  # a silent map: no r
            sign = -1.0 if r < 0 else 1.0
            img3d = nib.Nifti1Image(sign * np.asarray(img.slicer[..., c].dataobj), img.affine)
            png = figs / f"{site}_{c + 1:02d}.png"
            # narrower than the consortium's figure: shown two to a row at their own size
            jobs.append((img3d, png, dict(title=f"{site} {e['label']}", cut_coords=e.get("cut"),
                                          on_template=problem is None, width=5.4 if len(site_maps) > 1 else 9.0)))
            e.setdefault("sites", []).append({"site": site, "png": str(png), "r": abs(r)})
    render_many(jobs)
    return entries


@functools.lru_cache(maxsize=1)
def _template():
    # loaded once: reading it took ~0.6 s of every ~0.9 s map figure
    from nilearn import datasets  # deferred: nilearn is slow to load

    return datasets.load_mni152_template(resolution=2)


def peak_mm(img3d) -> tuple[float, float, float]:
    """World coordinates of the voxel with the largest |value| (cuts go through the map's peak)."""
    data = np.asarray(img3d.dataobj)
    ijk = np.unravel_index(np.abs(data).argmax(), data.shape)
    xyz = img3d.affine @ np.r_[np.asarray(ijk, float), 1.0]
    return tuple(float(v) for v in xyz[:3])


def timecourse_figure(S: np.ndarray, tr: float | None, out_png, **kw) -> Path:
    """:func:`timecourse_plot` as a PNG at ``out_png``."""
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it

    fig = timecourse_plot(S, tr, **kw)
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return Path(out_png)


def timecourse_plot(S: np.ndarray, tr: float | None, *, n_show: int | None = None, title: str = ""):
    """Each component's time course and power spectrum (one row per component); ``title`` names the data.

    Each time course is z-scored over the volumes shown (ICA fixes no scale,
    so "z" is the one unit that means something), and its spectrum is in Hz
    from ``tr`` (seconds); without a TR the axes count volumes.
    """
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it
    from matplotlib.ticker import MaxNLocator  # deferred: matplotlib is slow to load; only figures need it
    from scipy import signal  # deferred: scipy.signal is slow to load

    S = np.asarray(S, np.float64)
    R = S.shape[0] if n_show is None else min(n_show, S.shape[0])
    S = S[:R] - S[:R].mean(axis=1, keepdims=True)
    sd = S.std(axis=1, keepdims=True)
    S = np.divide(S, sd, out=np.zeros_like(S), where=sd > 1e-12)
    fig, axes = plt.subplots(R, 2, figsize=(8, 0.9 * R + 0.9), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    step = tr if tr else 1.0
    t = np.arange(S.shape[1]) * step
    for i in range(R):
        axes[i, 0].plot(t, S[i], lw=0.6, color="0.2")
        axes[i, 0].set_ylabel(f"IC{i + 1:02d}", rotation=0, labelpad=18, fontsize=8)
        f, p = signal.welch(S[i], fs=1.0 / step, nperseg=min(64, S.shape[1]))
        axes[i, 1].plot(f, p, lw=0.8, color="C0")  # linear: a log axis within one decade gets no labels
        axes[i, 1].set_ylim(bottom=0)
        for ax in axes[i]:
            ax.tick_params(labelsize=6)
            ax.xaxis.set_major_locator(MaxNLocator(4 if ax is axes[i, 1] else 6))
            if i < R - 1:
                ax.set_xticklabels([])
        axes[i, 0].set_yticks([-2, 0, 2])
        axes[i, 1].yaxis.set_major_locator(MaxNLocator(2))
    axes[0, 0].set_title("time course (z-scored over these volumes)", fontsize=8)
    axes[0, 1].set_title("power spectrum" + (" (z²/Hz)" if tr else ""), fontsize=8)
    axes[-1, 0].set_xlabel("time (s)" if tr else "volume (TR unknown)", fontsize=8)
    axes[-1, 1].set_xlabel(f"frequency (Hz; TR {tr:g} s)" if tr else "frequency (cycles per volume)", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def site_timecourse_figure(tsv, site: str, first_subject: tuple[str, int, int], tr: float | None, out_png) -> Path:
    """A site's own figure: the time courses of its first subject (``(id, start, stop)``), titled so."""
    sid, a, b = first_subject
    return timecourse_figure(read_timecourses(tsv)[1][:, a:b], tr, out_png,
                             title=f"site {site}, subject {sid}: for this site only")


def write_dynamics(dynamics: dict, subject_ids: list[str], path) -> Path:
    """A site's own subjects' dFNC state statistics (TSV): per state the fraction of windows, the mean dwell
    time in seconds, and the number of transitions (:func:`dpneuro.algorithms.dfnc.site_dynamics`)."""
    occ, dwell, trans = (np.asarray(dynamics[k]) for k in ("occupancy", "dwell_seconds", "transitions"))
    K = occ.shape[1]
    path = Path(path)
    with open(path, "w") as f:
        f.write("\t".join(["subject", *[f"state{k + 1}" for k in range(K)],
                           *[f"dwell_s_state{k + 1}" for k in range(K)], "transitions"]) + "\n")
        for sid, o, d, n in zip(subject_ids, occ, dwell, trans):
            f.write("\t".join([sid, *[f"{x:.6g}" for x in o], *[f"{x:.6g}" for x in d], str(int(n))]) + "\n")
    return path


def network_order(matrices) -> np.ndarray:
    """An order of the components that puts coupled ones together: hierarchical clustering (average linkage)
    of the states' mean |connectivity| (public post-processing of the released states)."""
    M = np.abs(np.asarray(matrices, float)).mean(axis=0)
    if M.shape[0] < 3:
        return np.arange(M.shape[0])
    dist = np.clip(1.0 - M, 0.0, None)
    np.fill_diagonal(dist, 0.0)
    return leaves_list(linkage(squareform((dist + dist.T) / 2, checks=False), "average"))


def states_figure(matrices, occupancy, out_png) -> Path:
    """The dFNC states as connectivity heat maps (components ordered by :func:`network_order`) and the
    consortium's fraction of windows in each."""
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it

    C = np.asarray(matrices, float)
    K, R = C.shape[0], C.shape[1]
    order = network_order(C)
    occ = np.asarray(occupancy, float)
    fig, axes = plt.subplots(1, K + 2, figsize=(2.3 * K + 2.8, 2.6),
                             gridspec_kw={"width_ratios": [1] * K + [0.07, 0.9], "wspace": 0.45})
    labels = [f"IC{i + 1:02d}" for i in order]
    for k, ax in enumerate(axes[:K]):
        im = ax.imshow(C[k][np.ix_(order, order)], cmap="RdBu_r", vmin=-1, vmax=1)
        ax.set_title(f"state {k + 1} ({100 * occ[k]:.0f} %)", fontsize=8)
        ticks = range(R) if R <= 20 else []
        ax.set_xticks(ticks, [labels[i] for i in ticks], fontsize=5, rotation=90)
        ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=5)
    cb = fig.colorbar(im, cax=axes[K])
    cb.set_label("correlation", fontsize=7)
    cb.ax.tick_params(labelsize=6)
    bx = axes[K + 1]
    bx.yaxis.tick_right()  # the colour bar's ticks sit on the left
    bx.tick_params(labelsize=7)
    bx.bar(range(K), occ, color="C0")
    bx.set_xticks(range(K), [str(k + 1) for k in range(K)], fontsize=7)
    bx.set_xlabel("state", fontsize=8)
    bx.set_title("fraction of windows", fontsize=8)
    fig.savefig(out_png, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return Path(out_png)


def fnc_figure(Z, networks: list[str] | None, noise_sd: float, out_png) -> Path:
    """The consortium's static FNC (R x R, Fisher z) in the components' order, lines between networks."""
    return matrix_figure(Z, networks, out_png, label=f"Fisher z (noise sd {noise_sd:.3f})", title="static FNC",
                         least=max(3 * noise_sd, 0.1))


def matrix_figure(Z, networks: list[str] | None, out_png, *, label: str, title: str, least: float = 0.1,
                  marks=None) -> Path:
    """A component x component matrix in the components' order, lines between networks; ``marks`` (a boolean
    matrix) puts a dot on the entries it selects; the colour scale spans at least +-``least``."""
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it

    Z = np.asarray(Z, float)
    R = Z.shape[0]
    shown = Z.copy()
    np.fill_diagonal(shown, np.nan)
    lim = max(float(np.nanmax(np.abs(shown))) if R > 1 else 0.0, least)
    fig, ax = plt.subplots(figsize=(2.2 + 0.22 * R, 1.8 + 0.22 * R))
    im = ax.imshow(shown, cmap="RdBu_r", vmin=-lim, vmax=lim)
    if marks is not None:
        rows, cols = np.nonzero(np.asarray(marks, bool))
        ax.scatter(cols, rows, s=6, c="k", marker="o")
    labels = [f"IC{i + 1:02d}" + (f" {networks[i]}" if networks else "") for i in range(R)]
    ticks = range(R) if R <= 40 else []
    ax.set_xticks(ticks, [labels[i] for i in ticks], fontsize=6, rotation=90)
    ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=6)
    if networks:
        for i in range(1, R):
            if networks[i] != networks[i - 1]:
                ax.axhline(i - 0.5, color="k", lw=0.6)
                ax.axvline(i - 0.5, color="k", lw=0.6)
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    cb.set_label(label, fontsize=7)
    cb.ax.tick_params(labelsize=6)
    ax.set_title(title, fontsize=8)
    fig.savefig(out_png, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return Path(out_png)


def _signed_projection(vol: np.ndarray, axis: int) -> np.ndarray:
    """The value of largest magnitude along ``axis`` (a maximum-intensity projection that keeps the sign)."""
    idx = np.expand_dims(np.argmax(np.abs(vol), axis=axis), axis)
    return np.take_along_axis(vol, idx, axis=axis).squeeze(axis)


def overview_figure(components_path, mask_path, titles: list[str], out_png, *, threshold: float = MAP_THRESHOLD,
                    columns: int = 4) -> Path:
    """Every component on one page, in the file's order (network order), each titled (its number and network):
    its projections through the brain from above and from the side (the value of largest |z| along each line of
    sight, |z| > ``threshold``) over the mask's outline. As CanICA users see them together with
    ``plot_prob_atlas``, but a panel per component so each can be named; drawn with matplotlib alone, a
    fraction of a second per component."""
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it
    from nilearn.image import reorder_img  # deferred: nilearn is slow to load

    img = reorder_img(nib.load(str(components_path)), resample="nearest")  # axes along R, A, S
    mask = np.asarray(reorder_img(nib.load(str(mask_path)), resample="nearest").dataobj) > 0
    data = np.asarray(img.dataobj, np.float32)
    R = data.shape[3]
    rows = -(-R // columns)
    fig, axes = plt.subplots(rows, 2 * columns, figsize=(columns * 3.2, rows * 1.75), squeeze=False,
                             gridspec_kw={"width_ratios": [data.shape[0], data.shape[1]] * columns, "wspace": 0.02})
    outline = {2: mask.any(axis=2).T, 0: mask.any(axis=0).T}
    lim = float(np.percentile(np.abs(data[mask]), 99.5)) if np.any(data) else 1.0
    lim = max(lim, threshold * 1.5)
    for k in range(rows * columns):
        for j, axis in enumerate((2, 0)):  # from above (x, y), from the side (y, z)
            ax = axes.flat[2 * k + j]
            ax.axis("off")
            if k >= R:
                continue
            proj = _signed_projection(data[..., k], axis).T
            ax.imshow(outline[axis], cmap="Greys", vmin=0, vmax=4, origin="lower", interpolation="nearest")
            ax.imshow(np.ma.masked_where(np.abs(proj) <= threshold, proj), cmap="RdBu_r", vmin=-lim, vmax=lim,
                      origin="lower", interpolation="nearest")
            if j == 0:
                ax.set_title(titles[k] if k < len(titles) else "", fontsize=8, loc="left")
    fig.savefig(out_png, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return Path(out_png)


def spectrum_figure(eigenvalues, out_png, *, edge: float | None = None, threshold: float | None = None) -> Path:
    """The released eigenvalues against the noise the plan puts on the released matrix: its bulk's edge
    (2 sigma sqrt(D)) and the detection threshold (sigma sqrt(D), BBP) below which an eigenvector is noise."""
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it

    lam = np.asarray(eigenvalues, float)
    fig, ax = plt.subplots(figsize=(5.5, 2.4))
    k = np.arange(1, lam.size + 1)
    ax.bar(k, lam, color="C0", label="released eigenvalues")
    if threshold is not None:
        ax.axhline(threshold, color="C3", ls="--", lw=1, label="detection threshold sigma sqrt(D)")
    if edge is not None:
        ax.axhline(edge, color="C1", ls=":", lw=1, label="noise edge 2 sigma sqrt(D)")
    ax.set_xlabel("component of the PCA", fontsize=8)
    ax.set_ylabel("eigenvalue", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, frameon=False)
    fig.savefig(out_png, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return Path(out_png)


def convergence_figure(history: dict, out_png) -> Path:
    """Unmixing convergence: ||dW||^2 (and qNGI against the truth when known) per round."""
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it

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
    if dw.size:  # the cumulant unmixing has no rounds to plot
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return Path(out_png)
