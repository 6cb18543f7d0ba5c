"""Spatial maps: from the reduced-space model back to voxels, to NIfTI and to pictures."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from PIL import Image, ImageDraw, ImageFont  # 25 ms to load: the maps are drawn with it
from scipy.cluster.hierarchy import leaves_list, linkage
from scipy.spatial.distance import squareform

from dpneuro.data.bids import bids_entities
from dpneuro.data.images import load_mask, mask_to_image


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
    return component_figure(img3d, **kw).save(out_png)


def render_many(jobs: list[tuple]) -> list[Path]:
    """:func:`render_component` of every ``(img3d, out_png, kwargs)``.

    One after another: a map's picture takes ~10 ms (:func:`component_figure`),
    so a report's ~100 take 1 s, where the process pool these once needed
    (0.3 s a figure with nilearn) took 3-4 s to start its two workers on two
    cores, and threads gain nothing (numpy and PIL hold the GIL for most of a
    picture).
    """
    return [render_component(img, out, **kw) for img, out, kw in jobs]


@dataclass
class MapPicture:
    """A figure drawn straight to pixels: ``image`` (PIL, in :func:`_palette`'s colours), every label drawn on it,
    as ``(kind, text, (left, top, right, bottom))`` in pixels (a map's kinds: ``title``, ``cut`` (a cut's
    coordinate), ``side`` (L, R), ``colorbar`` (a colour bar's tick label) and ``caption``), and where each cut
    lies (``panels``: its name, x, y or z, to ``(left, top, width, height)``)."""

    image: Any
    labels: list[tuple[str, str, tuple[int, int, int, int]]] = field(default_factory=list)
    panels: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)

    def save(self, path) -> Path:
        """The picture as a PNG at ``path`` (a palette PNG: about half of RGB's bytes)."""
        self.image.save(path, format="PNG")
        return Path(path)


#: a picture's palette: this many greys (0 to 255: backgrounds, the template, labels), then the maps' colours;
#: 64 show the template without bands, in files a third smaller than 160 gave
_GREYS = 64
#: how many of the maps' colours (RdBu_r, -vmax to vmax) the palette holds
_COLOURS = 96


def _grey(value) -> np.ndarray:
    """The palette index of a grey level (0-255)."""
    return np.rint(np.asarray(value, np.float64) * ((_GREYS - 1) / 255.0)).astype(np.uint8)


def _colour(values: np.ndarray, vmax: float) -> np.ndarray:
    """The palette index of the maps' colour of each value on the scale [-vmax, vmax]."""
    k = np.clip(((values + vmax) / (2 * vmax) * _COLOURS).astype(int), 0, _COLOURS - 1)
    return (_GREYS + k).astype(np.uint8)


@functools.lru_cache(maxsize=1)
def _palette() -> np.ndarray:
    """The colours of the pictures (256 x RGB, uint8): :data:`_GREYS` greys, then :data:`_COLOURS` of RdBu_r, the
    maps' colours as nilearn and the other figures draw them. Composed as indices into it, a picture needs no
    colour quantization, and its greys and white are exact."""
    import matplotlib  # deferred: matplotlib is slow to load; only figures need it

    greys = np.repeat(np.linspace(0.0, 255.0, _GREYS)[:, None], 3, axis=1)
    colours = matplotlib.colormaps["RdBu_r"]((np.arange(_COLOURS) + 0.5) / _COLOURS)[:, :3] * 255
    return np.vstack([greys, colours]).round().astype(np.uint8)


class _Canvas:
    """A picture under construction: palette indices (``idx``, rows x columns) and the labels to draw on it."""

    def __init__(self, height: int, width: int, background: float):
        self.idx = np.full((height, width), _grey(background), np.uint8)
        self.texts: list[tuple[tuple[float, float], str, Any, float, str]] = []
        self.labels: list[tuple[str, str, tuple[int, int, int, int]]] = []

    def text(self, kind: str, xy, text: str, font, grey: float, anchor: str) -> None:
        """``text`` at ``xy`` (PIL's ``anchor``) in a grey level; its box recorded under ``kind``."""
        box = _MEASURE.textbbox(xy, text, font=font, anchor=anchor)
        self.texts.append((xy, text, font, grey, anchor))
        self.labels.append((kind, text, (int(box[0]), int(box[1]), int(box[2]), int(box[3]))))

    def picture(self, panels: dict | None = None) -> MapPicture:
        """The finished picture: each label antialiased over what lies under it (a grey: text sits on the
        background, the template or a grey bar)."""
        h, w = self.idx.shape
        lum = _palette().astype(np.float64) @ [0.299, 0.587, 0.114]
        for grey in sorted({t[3] for t in self.texts}):
            cover = Image.new("L", (w, h), 0)
            draw = ImageDraw.Draw(cover)
            for xy, text, font, g, anchor in self.texts:
                if g == grey:
                    draw.text(xy, text, font=font, fill=255, anchor=anchor)
            a = np.asarray(cover, np.float64) / 255.0
            on = a > 0
            self.idx[on] = _grey(grey * a[on] + lum[self.idx[on]] * (1.0 - a[on]))
        image = Image.fromarray(self.idx)  # "L": a palette makes it "P"
        image.putpalette(_palette().ravel().tolist())
        return MapPicture(image, self.labels, panels or {})


#: measures the labels' boxes
_MEASURE = ImageDraw.Draw(Image.new("L", (1, 1)))


#: the pictures' resolution (pixels per inch): a width of 9 inches is 900 pixels
DPI = 100
#: a map's three cuts: (label, the axis it cuts across, the axes drawn across and up)
_CUTS = (("x", 0, 1, 2), ("y", 1, 0, 2), ("z", 2, 0, 1))


def component_figure(img3d, *, threshold: float = MAP_THRESHOLD, title: str = "", bg_img=None,
                     vmax: float | None = None, cut_coords=None, on_template: bool = True,
                     width: float = 9.0) -> MapPicture:
    """One component's figure: ortho cuts on the MNI template (3-D), or its one slice (2-D grid).

    As nilearn's ``plot_stat_map`` draws them (its colours, RdBu_r; voxels
    with |z| > ``threshold`` coloured over the template), straight to pixels:
    ~10 ms a figure where nilearn and matplotlib took 0.15-0.9 s. The cuts
    are annotated with their coordinates (mm) and L/R; the colour bar's ticks
    are the threshold and the ends (:func:`colorbar_ticks`), and its caption
    sits below the cuts. ``cut_coords`` (mm) default to the map's peak; pass
    the matched truth's peak to show a component and its truth through the
    same slices. ``on_template=False`` (data not in MNI space) draws the map
    on its own grid, its voxels in grey, without the template. ``width``
    (inches at :data:`DPI`): a narrower figure keeps its labels readable
    where two are shown side by side.
    """
    data, affine = _ras(img3d)
    lim = float(vmax or max(np.abs(data).max(), 1e-12))
    if _is_2d(data.shape):  # a toy grid: its one slice, on its own grid
        cuts, on_template, width = _CUTS[2:], False, min(width, 4.0)
    else:
        cuts = _CUTS
    if on_template:
        bg, bg_affine, box, bg_max = _background(bg_img) if bg_img is not None else _template_background()
        bg_max *= 1.4  # the brightest tissue light grey: the colours stand out
    else:  # the map's own grid: its voxels (the mask) in dark grey
        bg, bg_affine, bg_max = (data != 0).astype(np.float64), affine, 3.0
        box = _box(data != 0, affine)
    cut = tuple(cut_coords) if cut_coords is not None else peak_mm(img3d)
    # pixels: a band for the title, the cuts side by side at their true aspect, a column for the colour bar,
    # a band for the caption
    top, bottom, edge, gap, bar_col = (30 if title else 8), 18, 6, 6, 80
    W = int(round(width * DPI))
    ratios = [(box[h][1] - box[h][0]) / (box[v][1] - box[v][0]) for _, _, h, v in cuts]
    ch = int((W - bar_col - 2 * edge - gap * (len(cuts) - 1)) / sum(ratios))
    H = top + ch + bottom
    canvas = _Canvas(H, W, background=0.0)
    placed = []
    x = edge
    for (name, axis, h, v), ratio in zip(cuts, ratios):
        pw = int(round(ratio * ch))
        hs = box[h][0] + (np.arange(pw) + 0.5) * (box[h][1] - box[h][0]) / pw
        vs = box[v][1] - (np.arange(ch) + 0.5) * (box[v][1] - box[v][0]) / ch  # the top row is the highest
        grey = _sample(_slice(bg, bg_affine, axis, cut[axis]), bg_affine, h, v, hs, vs, linear=on_template)
        panel = _grey(np.clip(grey / bg_max, 0.0, 1.0) * 255)
        z = _sample(_slice(data, affine, axis, cut[axis]), affine, h, v, hs, vs, linear=False)
        shown = np.abs(z) > threshold
        panel[shown] = _colour(z[shown], lim)
        canvas.idx[top:top + ch, x:x + pw] = panel
        placed.append((name, axis, x, pw))
        x += pw + gap
    bar_x = x - gap + 8
    bar = _colorbar_pixels(canvas.idx, bar_x, top + 4, H - bottom - 22, lim, threshold)
    small = _points(8)
    for name, axis, x0, pw in placed:
        canvas.text("cut", (x0 + 3, top + ch - 3), f"{name}={cut[axis]:.0f}", small, 255, "ld")
        if name != "x":  # left is left (neurological convention, as nilearn draws them)
            canvas.text("side", (x0 + 3, top + 3), "L", small, 255, "la")
            canvas.text("side", (x0 + pw - 3, top + 3), "R", small, 255, "ra")
    if title:
        canvas.text("title", (8, 6), title, _points(10), 255, "la")
    for t, y in bar:
        canvas.text("colorbar", (bar_x + 18, y), f"{t:.2g}".replace("-", "\u2212"), small, 255, "lm")
    canvas.text("caption", (W - 5, H - 3), f"colour: z-score, |z| > {threshold:g} shown", small, 191, "rd")
    return canvas.picture({name: (x0, top, pw, ch) for name, _, x0, pw in placed})


def _ras(img3d, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """A volume's data (as ``dtype``; None: as stored) and affine with its axes along R, A, S (a diagonal affine
    with positive steps)."""
    affine = np.asarray(img3d.affine, np.float64)
    lin = affine[:3, :3]
    if not (np.allclose(lin, np.diag(np.diag(lin))) and np.all(np.diag(lin) > 0)):
        from nilearn.image import reorder_img  # deferred: nilearn is slow to load

        img3d = reorder_img(img3d, resample="nearest")
        affine = np.asarray(img3d.affine, np.float64)
    data = np.asarray(img3d.dataobj, dtype)
    return (data[..., 0] if data.ndim == 4 and data.shape[3] == 1 else data), affine


def _slice(vol: np.ndarray, affine: np.ndarray, axis: int, mm: float) -> np.ndarray:
    """The 2-D slice of a RAS volume across ``axis`` nearest to ``mm`` (the remaining axes in order)."""
    i = int(np.clip(np.rint((mm - affine[axis, 3]) / affine[axis, axis]), 0, vol.shape[axis] - 1))
    return vol[(slice(None),) * axis + (i,)]  # a view (np.take took 7 ms to copy it from the 1 mm template)


def _sample(sl: np.ndarray, affine: np.ndarray, h: int, v: int, hs: np.ndarray, vs: np.ndarray, *,
            linear: bool) -> np.ndarray:
    """A slice (its axes: ``h``, ``v`` of a RAS volume) at the positions ``vs`` (mm, rows) x ``hs`` (columns):
    bilinear (``linear``) or the nearest voxel's value; 0 outside the grid."""
    out = np.pad(sl.T, 1)  # a border of zeros: positions off the grid read 0
    for axis, (pos, a) in enumerate(((vs, v), (hs, h))):
        pos = np.clip((pos - affine[a, 3]) / affine[a, a] + 1.0, 0.0, out.shape[axis] - 1.0)
        if not linear:
            out = np.take(out, np.rint(pos).astype(int), axis=axis)
            continue
        lo = np.minimum(np.floor(pos).astype(int), out.shape[axis] - 2)
        w = np.expand_dims(pos - lo, 1 - axis)
        out = np.take(out, lo, axis=axis) * (1.0 - w) + np.take(out, lo + 1, axis=axis) * w
    return out


def _box(inside: np.ndarray, affine: np.ndarray, margin: float = 4.0) -> list[tuple[float, float]]:
    """The world box (mm, per axis) around a RAS volume's ``inside`` voxels, with a margin."""
    ijk = np.argwhere(inside)
    if not len(ijk):
        ijk = np.array([[0, 0, 0], np.array(inside.shape) - 1])
    lo, hi = ijk.min(axis=0), ijk.max(axis=0)
    step, origin = np.diag(affine)[:3], affine[:3, 3]
    return [(origin[a] + lo[a] * step[a] - step[a] / 2 - margin, origin[a] + hi[a] * step[a] + step[a] / 2 + margin)
            for a in range(3)]


def _colorbar_pixels(idx: np.ndarray, x: int, y0: int, y1: int, vmax: float, threshold: float
                     ) -> list[tuple[float, int]]:
    """A vertical colour bar (12 pixels wide) drawn into ``idx`` at column ``x`` from row ``y0`` to ``y1``: +vmax at
    the top, grey where |z| is under the threshold, a white outline and tick marks. Returns each tick's value and
    row (:func:`colorbar_ticks`)."""
    n = y1 - y0
    values = vmax - (np.arange(n) + 0.5) / n * 2 * vmax
    col = _colour(values, vmax)
    col[np.abs(values) < threshold] = _grey(128)
    white = _grey(255)
    idx[y0:y1, x:x + 12] = col[:, None]
    idx[[y0 - 1, y1], x - 1:x + 13] = white
    idx[y0 - 1:y1 + 1, [x - 1, x + 12]] = white
    ticks = []
    for t in colorbar_ticks(vmax, threshold):
        y = int(np.clip(round(y0 + (vmax - t) / (2 * vmax) * n), y0, y1 - 1))
        idx[y, x + 12:x + 16] = white
        ticks.append((t, y))
    return ticks


@functools.lru_cache(maxsize=8)
def _points(size: float):
    """matplotlib's font (DejaVu Sans, which it ships) at ``size`` points at :data:`DPI`: the maps' labels look
    like the other figures'."""
    import matplotlib  # deferred: matplotlib is slow to load; only figures need it

    font = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    return ImageFont.truetype(str(font), int(round(size * DPI / 72)))


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
    maps = np.asarray(img.dataobj)  # read once: a gzipped file's slicer decompresses it again for every volume
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
        comp3d = nib.Nifti1Image(maps[..., c], img.affine)
        cut = peak_mm(comp3d) if three_d else None
        if truth_img is not None:
            t3d = nib.Nifti1Image(np.asarray(truth_img.dataobj[..., j]), truth_img.affine)
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
    where = ("on the MNI152 template, through each map's peak (slice coordinates in mm; L = left)"
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
        full = np.asarray(img.dataobj, np.float64)  # read once (see render_components)
        vox = full[mask]
        for e in entries:
            c = e["index"]
            a, g = vox[:, c], e["sign"] * group[:, c]
            r = float(np.corrcoef(a, g)[0, 1]) if a.std() > 0 and g.std() > 0 else 0.0  # a silent map: no r
            sign = -1.0 if r < 0 else 1.0
            img3d = nib.Nifti1Image(sign * full[..., c], img.affine)
            png = figs / f"{site}_{c + 1:02d}.png"
            # narrower than the consortium's figure: shown two to a row at their own size
            jobs.append((img3d, png, dict(title=f"{site} {e['label']}", cut_coords=e.get("cut"),
                                          on_template=problem is None, width=5.4 if len(site_maps) > 1 else 9.0)))
            e.setdefault("sites", []).append({"site": site, "png": str(png), "r": abs(r)})
    render_many(jobs)
    return entries


@functools.lru_cache(maxsize=1)
def _template():
    # loaded once (about 1 s with nilearn.datasets): the interactive view's background, and the pictures' when
    # nilearn's 1 mm file is not where _template_background looks
    from nilearn import datasets  # deferred: nilearn is slow to load

    return datasets.load_mni152_template(resolution=2)


def _background(img3d, dtype=np.float64) -> tuple[np.ndarray, np.ndarray, list[tuple[float, float]], float]:
    """An anatomical image to draw maps on: its RAS data, affine, the box around its brain (mm) and its maximum."""
    data, affine = _ras(img3d, dtype)
    top = float(data.max())
    return data, affine, _box(data > 0.05 * top, affine), top


#: the 1 mm MNI152 template nilearn ships (load_mni152_template's source), relative to nilearn's package
_MNI152_1MM = ("datasets", "data", "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz")


@functools.lru_cache(maxsize=1)
def _template_background() -> tuple[np.ndarray, np.ndarray, list[tuple[float, float]], float]:
    # read directly (0.2 s): load_mni152_template(resolution=2) resamples this file after importing
    # nilearn.datasets (~1 s), and a picture's pixels (~0.7 mm) are finer than its 2 mm
    spec = importlib.util.find_spec("nilearn")
    path = Path(spec.origin).parent.joinpath(*_MNI152_1MM) if spec and spec.origin else None
    if path is None or not path.exists():
        return _background(_template())
    return _background(nib.load(str(path)), dtype=None)


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


#: z between the rows of a time-course figure: a z-scored trace rarely leaves +-3
TRACE_GAP = 6.0


def timecourse_plot(S: np.ndarray, tr: float | None, *, n_show: int | None = None, title: str = ""):
    """Each component's time course and power spectrum, one row per component (IC01 at the top); ``title``
    names the data.

    Each time course is z-scored over the volumes shown (ICA fixes no scale,
    so "z" is the one unit that means something) and drawn :data:`TRACE_GAP`
    z below the one above it, its 0 at its tick (minor ticks at +-2); its
    spectrum is in Hz from ``tr`` (seconds), every spectrum to one scale (the
    highest peak's z²/Hz under it); without a TR the axes count volumes.
    Two axes, not two per component: matplotlib's axes and their ticks were
    0.3 s of a figure.
    """
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it
    from matplotlib.ticker import MaxNLocator  # deferred: matplotlib is slow to load; only figures need it
    from scipy import signal  # deferred: scipy.signal is slow to load

    S = np.asarray(S, np.float64)
    R = S.shape[0] if n_show is None else min(n_show, S.shape[0])
    S = S[:R] - S[:R].mean(axis=1, keepdims=True)
    sd = S.std(axis=1, keepdims=True)
    S = np.divide(S, sd, out=np.zeros_like(S), where=sd > 1e-12)
    step = tr if tr else 1.0
    t = np.arange(S.shape[1]) * step
    f, P = signal.welch(S, fs=1.0 / step, nperseg=min(64, S.shape[1]), axis=1)
    peak = float(P.max()) if P.size and P.max() > 0 else 1.0
    offsets = -TRACE_GAP * np.arange(R)
    height = 0.6 * R + 1.0
    top, bottom = 0.3 + (0.25 if title else 0.0), 0.55  # inches: the titles above, the axes' labels below
    fig, axes = plt.subplots(1, 2, figsize=(8, height), sharey=True,
                             gridspec_kw={"width_ratios": [3, 1], "left": 0.08, "right": 0.985, "wspace": 0.06,
                                          "top": 1 - top / height, "bottom": bottom / height})
    ax, bx = axes
    for i in range(R):
        ax.plot(t, S[i] + offsets[i], lw=0.6, color="0.2")
        # linear: a log axis within one decade gets no labels
        bx.plot(f, offsets[i] - 0.45 * TRACE_GAP + 0.9 * TRACE_GAP * P[i] / peak, lw=0.8, color="C0")
    ax.hlines(offsets, t[0], t[-1], color="0.85", lw=0.5, zorder=0)
    bx.hlines(offsets - 0.45 * TRACE_GAP, f[0], f[-1], color="0.85", lw=0.5, zorder=0)
    ax.set_yticks(offsets, [f"IC{i + 1:02d}" for i in range(R)], fontsize=8)
    ax.set_yticks(np.concatenate([offsets - 2, offsets + 2]), minor=True)
    ax.set_ylim(offsets[-1] - TRACE_GAP / 2, TRACE_GAP / 2)
    ax.set_xlim(t[0], t[-1])
    bx.set_xlim(f[0], f[-1])
    bx.tick_params(axis="y", which="both", left=False)
    for a, n in ((ax, 6), (bx, 4)):
        a.tick_params(axis="x", labelsize=6)
        a.xaxis.set_major_locator(MaxNLocator(n))
    ax.set_title("time course (z-scored over these volumes; ticks at 0 and +-2)", fontsize=8)
    bx.set_title("power spectrum", fontsize=8)
    ax.set_xlabel("time (s)" if tr else "volume (TR unknown)", fontsize=8)
    bx.set_xlabel((f"frequency (Hz; TR {tr:g} s)" if tr else "frequency (cycles per volume)")
                  + f"\none scale: highest peak {peak:.2g}" + (" z²/Hz" if tr else ""), fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9, y=1 - 0.08 / height, va="top")
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


def fnc_figure(Z, networks: list[str] | None, noise_sd: float, out_png, *, hidden=None) -> Path:
    """The consortium's static FNC (R x R, Fisher z) in the components' order, lines between networks; the
    components ``hidden`` marks (below the privacy noise) greyed out."""
    return matrix_figure(Z, networks, out_png, label=f"Fisher z (noise sd {noise_sd:.3f})", title="static FNC",
                         least=max(3 * noise_sd, 0.1), hidden=hidden)


def matrix_figure(Z, networks: list[str] | None, out_png, *, label: str, title: str, least: float = 0.1,
                  marks=None, hidden=None) -> Path:
    """A component x component matrix in the components' order, lines between networks; ``marks`` (a boolean
    matrix) puts a dot on the entries it selects; the colour scale spans at least +-``least``. The rows and
    columns of the components ``hidden`` selects (below the privacy noise: no finding) are grey and labelled
    "noise"."""
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it

    Z = np.asarray(Z, float)
    R = Z.shape[0]
    shown = Z.copy()
    np.fill_diagonal(shown, np.nan)
    off = np.zeros(R, bool) if hidden is None else np.asarray(hidden, bool)
    shown[off, :] = np.nan
    shown[:, off] = np.nan
    lim = max(float(np.nanmax(np.abs(shown))) if np.isfinite(shown).any() else 0.0, least)
    fig, ax = plt.subplots(figsize=(2.2 + 0.22 * R, 1.8 + 0.22 * R))
    ax.set_facecolor("0.85")  # what is not drawn: the diagonal, the noise components
    im = ax.imshow(shown, cmap="RdBu_r", vmin=-lim, vmax=lim)
    if marks is not None:
        rows, cols = np.nonzero(np.asarray(marks, bool))
        ax.scatter(cols, rows, s=6, c="k", marker="o")
    labels = [f"IC{i + 1:02d}" + (" noise" if off[i] else f" {networks[i]}" if networks else "") for i in range(R)]
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
    ``plot_prob_atlas``, but a panel per component so each can be named; drawn straight to pixels (no
    matplotlib), ~10 ms a component."""
    data = _ras(nib.load(str(components_path)), np.float32)[0]  # axes along R, A, S
    mask = _ras(nib.load(str(mask_path)), None)[0] > 0
    if data.ndim == 3:
        data = data[..., None]
    R = data.shape[3]
    rows = -(-R // columns)
    lim = float(np.percentile(np.abs(data[mask]), 99.5)) if np.any(data) else 1.0
    lim = max(lim, threshold * 1.5)
    scale = 110.0 / max(data.shape[1], data.shape[2])  # pixels per voxel: a side view 110 pixels across
    views = []  # from above (x across, y up), from the side (y across, z up)
    for axis, (h, v) in ((2, (0, 1)), (0, (1, 2))):
        size = (max(1, round(data.shape[v] * scale)), max(1, round(data.shape[h] * scale)))
        pick = tuple((np.arange(n) + 0.5) / n for n in size)
        views.append((axis, size, ((data.shape[v] * (1 - pick[0])).astype(int), (data.shape[h] * pick[1]).astype(int))))
    title_h, gap, pad = 16, 4, 14
    panel_h = max(size[0] for _, size, _ in views)
    cell_w = sum(size[1] for _, size, _ in views) + gap + pad
    cell_h = title_h + panel_h + 6
    canvas = _Canvas(rows * cell_h + 4, columns * cell_w + 4, background=255.0)
    for k in range(R):
        x0, y0 = 4 + (k % columns) * cell_w, 4 + (k // columns) * cell_h
        x = x0
        for axis, (ph, pw), (iv, ih) in views:
            # a view's pixel (row, column) shows voxel (ih, iv) of the projection: rows from the top (high v) down
            outline = mask.any(axis=axis)[np.ix_(ih, iv)].T
            proj = _signed_projection(data[..., k], axis)[np.ix_(ih, iv)].T
            panel = np.where(outline, _grey(217), _grey(255))
            shown = np.abs(proj) > threshold
            panel[shown] = _colour(proj[shown], lim)
            top = y0 + title_h + (panel_h - ph)
            canvas.idx[top:top + ph, x:x + pw] = panel
            x += pw + gap
        canvas.text("title", (x0, y0 + 2), titles[k] if k < len(titles) else "", _points(7.5), 0, "la")
    return canvas.picture().save(out_png)


def spectrum_figure(eigenvalues, out_png, *, edge: float | None = None) -> Path:
    """The released eigenvalues against the edge of the noise the plan puts on the released matrix
    (:func:`dpneuro.privacy.rmt.noise_edge`): the eigenvalues above it carry signal, those below are
    indistinguishable from the noise's own (grey)."""
    import matplotlib.pyplot as plt  # deferred: matplotlib is slow to load; only figures need it

    lam = np.asarray(eigenvalues, float)
    fig, ax = plt.subplots(figsize=(5.5, 2.4))
    k = np.arange(1, lam.size + 1)
    above = lam > edge if edge is not None else np.ones(lam.size, bool)
    ax.bar(k[above], lam[above], color="C0", label="released eigenvalues above the noise")
    if not above.all():
        ax.bar(k[~above], lam[~above], color="0.6", label="below the noise's edge")
    if edge is not None:
        ax.axhline(edge, color="C1", ls=":", lw=1, label="noise edge (2 sigma sqrt(D), 99 %)")
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
