"""What a member publishes from: every stage timed under its own name, the settings the run used, each site's
voxel maps beside the consortium's, and figures whose labels can be read."""

from __future__ import annotations

import base64
import html
import io
import json
import re
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpneuro.config import RunConfig, SiteEntry
from dpneuro.data.images import load_space
from dpneuro.datasets.synth import make_consortium
from dpneuro.report.figures import colorbar_ticks, component_figure, peak_mm, timecourse_plot
from dpneuro.report.html import run_settings
from dpneuro.report.timings import label
from dpneuro.run.pipeline import prepare, run_stages

R = 3
SITES = ("site-01", "site-02", "site-03")
#: the capeDJICA and cumulant settings a spatial run does not use
ROUND_SETTINGS = ("ica_epsilon_i", "ica_delta_i", "ica_rounds", "clip_G", "clip_h", "optimizer", "ica_bias",
                  "ica_clip_unit")


def _cfg(**kw) -> RunConfig:
    return RunConfig(sites=[SiteEntry(s, "") for s in SITES], out="", **kw)


@pytest.mark.parametrize("kw, reduce, unmix", [
    (dict(ica="spatial"), "reduce (capePCA)", "unmix (spatial ICA)"),
    (dict(ica="temporal"), "reduce (capePCA)", "unmix (capeDJICA)"),
    (dict(ica="temporal", ica_unmixing="cumulant"), "reduce (capePCA)", "unmix (cumulant ICA)"),
    (dict(ica="temporal", reduction="pdsvd"), "reduce (PD-SVD)", "unmix (capeDJICA)"),
    (dict(reduction="none"), "reduce (PCA without noise)", "unmix (spatial ICA)"),
    (dict(reduction="capepca-power"), "reduce (capePCA, power iterations)", "unmix (spatial ICA)"),
    (dict(plan="none"), "reduce (capePCA, plan none: no noise)", "unmix (spatial ICA)"),
])
def test_stage_labels_name_the_algorithm_that_ran(kw, reduce, unmix):
    cfg = _cfg(**kw)
    assert label(cfg, "reduce") == reduce and label(cfg, "unmix") == unmix
    assert label(cfg, "site_maps", "site-02") == "site voxel maps site-02"


def test_the_run_block_lists_only_the_settings_the_run_used():
    spatial = run_settings(_cfg(ica="spatial").to_json())
    assert not set(ROUND_SETTINGS + ("cumulant_epsilon", "ica_unmixing")) & set(spatial)
    assert not {"pdsvd_iterations", "brain_states", "states_epsilon", "atlas", "exchange_dir"} & set(spatial)
    assert {"pca_epsilon", "parcels", "site_maps_method"} <= set(spatial)
    djica = run_settings(_cfg(ica="temporal").to_json())
    assert set(ROUND_SETTINGS) <= set(djica) and "cumulant_epsilon" not in djica
    cumulant = run_settings(_cfg(ica="temporal", ica_unmixing="cumulant").to_json())
    assert "cumulant_epsilon" in cumulant and not set(ROUND_SETTINGS) & set(cumulant)
    pdsvd = run_settings(_cfg(reduction="pdsvd", brain_states=2, n_components=4).to_json())
    assert {"pdsvd_iterations", "brain_states", "states_epsilon"} <= set(pdsvd) and "pca_epsilon" not in pdsvd
    voxels = run_settings(_cfg(parcels=0).to_json())
    assert "site_voxel_maps" not in voxels and "site_maps_method" not in voxels


# -- whole runs on a small 2-D consortium -------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("timings")
    man = make_consortium(root / "data", n_sites=3, subjects_per_site=4, n_components=R, n_timepoints=60,
                          space="grid30", random_state=5)
    return root, man


def _run(data, name: str, **kw) -> tuple[RunConfig, dict, str]:
    root, man = data
    cfg = RunConfig.from_dict({**dict(
        sites=[{"name": s["site"], "path": s["path"]} for s in man["sites"]], out=str(root / name),
        mask=man["mask"], n_components=R, seed=1, truth=str(root / "data"), parcels=36, pca_epsilon=50.0,
        ica_epsilon_i=5.0, ica_rounds=5, cumulant_epsilon=50.0), **kw})
    cfg = prepare(cfg)[0]
    out = run_stages(cfg)
    return cfg, json.loads((cfg.run_dir / "run.json").read_text()), Path(out["report"]).read_text()


def _expected(cfg: RunConfig, *, site_maps: bool, states: bool) -> list[str]:
    names = [label(cfg, "space"), *(label(cfg, "load", s) for s in SITES), label(cfg, "reduce"), label(cfg, "unmix")]
    names += [label(cfg, "fnc")] if cfg.fnc else []
    names += [label(cfg, "states")] if states else []
    names += [label(cfg, "maps"), *(label(cfg, "timecourses", s) for s in SITES)]
    names += [label(cfg, "site_maps", s) for s in SITES] if site_maps else []
    names += [label(cfg, "occupancy", s) for s in SITES] if states else []
    return names + [label(cfg, "report")]


def embedded_maps(page: str) -> dict[str, dict[str, tuple[int, int]]]:
    """Every component's cell of a report's map grid, by its label: each picture the cell embeds, by its alt text,
    as its (width, height) in pixels (each decoded: a PNG that is there, not a broken link)."""
    from PIL import Image

    cells = {}
    grid = page.split('<div class="grid">', 1)[1].split("\n</div>\n", 1)[0]  # the grid's own closing tag: a line
    for cell in grid.split('<div class="comp')[1:]:
        label = html.unescape(re.search(r"<p><b>(.*?)</b>", cell).group(1))
        cells[label] = {html.unescape(alt): Image.open(io.BytesIO(base64.b64decode(data))).size for alt, data in
                        re.findall(r'<img alt="([^"]*)"(?: width="\d+")? src="data:image/png;base64,([^"]+)"/>', cell)}
    return cells


def assert_every_map_shown(page: str, n_components: int, sites=(), *, truth: bool = False) -> None:
    """The report shows every component's map (IC01 to ICnn, once each), its matched truth's, and every site's
    voxel map of it, each an embedded picture of a readable size."""
    cells = embedded_maps(page)
    assert sorted(name.split()[0] for name in cells) == [f"IC{i + 1:02d}" for i in range(n_components)]
    for name, pictures in cells.items():
        expected = {name, *(["truth " + name] if truth else []), *(f"{s} {name}" for s in sites)}
        assert set(pictures) == expected, (name, sorted(pictures))
        assert all(w >= 300 and h >= 150 for w, h in pictures.values()), (name, pictures)


def test_a_spatial_run_times_every_stage_and_shows_each_sites_voxel_maps(data):
    cfg, run, page = _run(data, "spatial", ica="spatial")
    timings = run["timings_s"]
    assert list(timings) == _expected(cfg, site_maps=True, states=False)
    assert "reduce (capePCA)" in timings and "unmix (spatial ICA)" in timings
    assert all(v >= 0 for v in timings.values()) and timings[label(cfg, "site_maps", "site-01")] > 0
    for name in timings:  # the report shows what run.json recorded, with a total
        assert f"<td>{name}</td>" in page
    assert "<td>total</td>" in page
    # every component's map, its truth's and every site's voxel map of it, in its cell of the grid
    assert_every_map_shown(page, R, SITES, truth=True)
    assert page.count("voxel map &mdash; r = ") == R * len(SITES)
    assert "Voxel maps of each site" in page
    # the features and the settings the run used
    assert run["features"] == "36 coordinate parcels" and "<b>36 coordinate parcels</b>" in page
    block = page.split("<h2>Run</h2>")[1]
    for name in ROUND_SETTINGS + ("cumulant_epsilon", "pdsvd_iterations", "states_epsilon"):
        assert f"&quot;{name}&quot;" not in block, name
    assert "&quot;pca_epsilon&quot;" in block


@pytest.mark.parametrize("kw, states", [
    (dict(ica="temporal", brain_states=2), True),
    (dict(ica="temporal", ica_unmixing="cumulant"), False),
    (dict(ica="temporal", reduction="pdsvd", site_voxel_maps=False), False),
    (dict(ica="spatial", reduction="none", site_voxel_maps=False), False),
])
def test_every_stage_is_timed_under_the_algorithm_that_ran(data, kw, states):
    name = "-".join(f"{v}" for v in kw.values())
    cfg, run, page = _run(data, name, **kw)
    site_maps = cfg.site_voxel_maps
    assert list(run["timings_s"]) == _expected(cfg, site_maps=site_maps, states=states)
    block = page.split("<h2>Run</h2>")[1]
    if cfg.cumulant_unmixing:
        assert "unmix (cumulant ICA)" in run["timings_s"] and "&quot;ica_rounds&quot;" not in block
    elif cfg.ica == "temporal":  # capeDJICA: its rounds' settings are the run's
        assert "unmix (capeDJICA)" in run["timings_s"] and "&quot;ica_rounds&quot;" in block
    if cfg.reduction == "pdsvd":
        assert "reduce (PD-SVD)" in run["timings_s"] and "&quot;pdsvd_iterations&quot;" in block
    if cfg.reduction == "none":
        assert "reduce (PCA without noise)" in run["timings_s"]
    assert ("&quot;brain_states&quot;" in block) == states
    assert page.count("voxel map &mdash;") == (R * len(SITES) if site_maps else 0)
    assert_every_map_shown(page, R, SITES if site_maps else (), truth=True)


# -- figures ----------------------------------------------------------------------------------------------

def _overlap(a, b) -> bool:
    """Two pixel boxes (left, top, right, bottom) share pixels."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _blobs(vmax: float = 6.0):
    """A volume on the 6 mm MNI grid: a positive blob peaking at ``vmax`` in the left hemisphere and a negative one
    (-vmax / 2) in the right."""
    mask, affine = load_space("mni6mm")
    ijk = np.argwhere(mask)
    xyz = nib.affines.apply_affine(affine, ijk)
    data = np.zeros(mask.shape)
    data[mask] = (vmax * np.exp(-np.sum((xyz - [-40, -20, 20]) ** 2, axis=1) / 300.0)
                  - vmax / 2 * np.exp(-np.sum((xyz - [40, -20, 20]) ** 2, axis=1) / 300.0))
    return nib.Nifti1Image(data, affine)


@pytest.mark.parametrize("vmax", [2.2, 2.6, 3.8, 6.0, 25.0])
@pytest.mark.parametrize("width", [9.0, 5.4])
def test_colour_bar_labels_neither_overlap_nor_hide_under_the_caption(vmax, width):
    pic = component_figure(_blobs(vmax), title="site-02 IC01 dorsal attention, left (noise?)", width=width)
    bar = [(text, box) for kind, text, box in pic.labels if kind == "colorbar"]
    assert len(bar) >= 2
    shown = {float(text.replace("\u2212", "-")) for text, _ in bar}
    assert {2.0, -2.0} <= shown  # the threshold is marked
    assert max(shown) == pytest.approx(vmax, rel=0.05) or vmax - 2.0 < 0.12 * 2 * vmax  # an end, unless too close
    # no label on another (the colour bar's, the caption, the title, the cuts' coordinates, L and R), all inside
    boxes = [box for _, _, box in pic.labels]
    assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if _overlap(a, b)], pic.labels
    W, H = pic.image.size
    assert all(0 <= b[0] and b[2] <= W and 0 <= b[1] and b[3] <= H for b in boxes), (pic.image.size, pic.labels)
    assert [t for k, t, _ in pic.labels if k == "caption"] == ["colour: z-score, |z| > 2 shown"]
    # the caption lies below the cuts, clear of the colour bar's lowest label
    caption = next(b for k, _, b in pic.labels if k == "caption")
    assert all(caption[1] >= top + h for _, top, _, h in pic.panels.values())
    assert W == round(100 * width)


def test_a_maps_picture_shows_the_voxels_above_the_threshold_where_they_are():
    """The cuts go through the peak; left is left; the positive blob is red, the negative blue, and nothing under
    the threshold is coloured."""
    img = _blobs(6.0)
    pic = component_figure(img)
    peak = peak_mm(img)  # the 6 mm voxel nearest the blob's centre
    assert np.allclose(peak, (-40, -20, 20), atol=3)
    assert [t for k, t, _ in pic.labels if k == "cut"] == [f"{n}={v:.0f}" for n, v in zip("xyz", peak)]
    rgb = np.asarray(pic.image.convert("RGB")).astype(int)
    red = (rgb[..., 0] > rgb[..., 2] + 40)
    blue = (rgb[..., 2] > rgb[..., 0] + 40)
    for name in ("y", "z"):  # the cuts across x: left of the midline on the left
        left, top, w, h = pic.panels[name]
        cols = np.arange(w)
        r, b = red[top:top + h, left:left + w], blue[top:top + h, left:left + w]
        assert r.sum() > 50 and b.sum() > 10, name
        assert cols[r.any(axis=0)].max() < w / 2 < cols[b.any(axis=0)].min(), name
    left, top, w, h = pic.panels["x"]  # the sagittal cut at x = -40 meets only the positive blob
    assert red[top:top + h, left:left + w].sum() > 50 and not blue[top:top + h, left:left + w].any()
    # nothing coloured when no voxel passes the threshold
    quiet = component_figure(nib.Nifti1Image(np.asarray(img.dataobj) / 6.0, img.affine))
    rgb = np.asarray(quiet.image.convert("RGB")).astype(int)
    for left, top, w, h in quiet.panels.values():
        panel = rgb[top:top + h, left:left + w]
        assert np.abs(panel[..., 0] - panel[..., 2]).max() <= 2  # greys only: the template


def test_colorbar_ticks_drop_an_end_too_close_to_the_threshold():
    assert colorbar_ticks(6.0, 2.0) == [-6.0, -2.0, 2.0, 6.0]
    assert colorbar_ticks(2.3, 2.0) == [-2.0, 2.0]
    assert colorbar_ticks(1.5, 2.0) == [-1.5, 0.0, 1.5]  # nothing above the threshold


def test_time_courses_are_z_scored_and_their_spectrum_is_in_hz():
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(0)
    S = 0.03 * rng.standard_normal((4, 150))  # the scale a site's time courses come in
    fig = timecourse_plot(S, 0.8)
    ax, bx = fig.axes
    assert "Hz" in bx.get_xlabel() and "0.8 s" in bx.get_xlabel()
    assert "z-scored" in ax.get_title()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["IC01", "IC02", "IC03", "IC04"]
    traces = ax.get_lines()
    assert len(traces) == 4 and len(bx.get_lines()) == 4
    for line, zero in zip(traces, ax.get_yticks()):  # each trace drawn around its own tick
        y = line.get_ydata() - zero
        assert abs(np.mean(y)) < 1e-9 and np.std(y) == pytest.approx(1.0)
    assert bx.get_xlim()[1] == pytest.approx(1 / (2 * 0.8), rel=0.1)  # up to Nyquist, in Hz
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for a in (ax, bx):
        for axis in (a.xaxis, a.yaxis):
            boxes = [t.get_window_extent(renderer) for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
            assert not [(p, q) for i, p in enumerate(boxes) for q in boxes[i + 1:] if p.overlaps(q)]
    plt.close(fig)
    fig = timecourse_plot(S, None)  # no TR: volumes, not seconds
    assert "volume" in fig.axes[0].get_xlabel() and "Hz" not in fig.axes[1].get_xlabel()
    plt.close(fig)
