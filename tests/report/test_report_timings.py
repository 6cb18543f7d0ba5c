"""What a member publishes from: every stage timed under its own name, the settings the run used, each site's
voxel maps beside the consortium's, and figures whose labels can be read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpneuro.config import RunConfig, SiteEntry
from dpneuro.data.io import load_space
from dpneuro.datasets.synth import make_consortium
from dpneuro.report.figures import colorbar_ticks, component_figure, timecourse_plot
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


def test_a_spatial_run_times_every_stage_and_shows_each_sites_voxel_maps(data):
    cfg, run, page = _run(data, "spatial", ica="spatial")
    timings = run["timings_s"]
    assert list(timings) == _expected(cfg, site_maps=True, states=False)
    assert "reduce (capePCA)" in timings and "unmix (spatial ICA)" in timings
    assert all(v >= 0 for v in timings.values()) and timings[label(cfg, "site_maps", "site-01")] > 0
    for name in timings:  # the report shows what run.json recorded, with a total
        assert f"<td>{name}</td>" in page
    assert "<td>total</td>" in page
    # every site's voxel map of every component, beside the consortium's map
    for s in SITES:
        assert page.count(f'<img alt="{s} IC') == R
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


# -- figures ----------------------------------------------------------------------------------------------

def _overlaps(boxes) -> list:
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]


@pytest.mark.parametrize("vmax", [2.2, 2.6, 3.8, 6.0, 25.0])
def test_colour_bar_labels_neither_overlap_nor_hide_under_the_caption(vmax):
    import matplotlib.pyplot as plt

    mask, affine = load_space("mni6mm")
    data = np.zeros(mask.shape)
    ijk = np.argwhere(mask)
    centre = ijk.mean(axis=0)
    data[mask] = vmax * np.exp(-np.sum((ijk - centre) ** 2, axis=1) / 20.0)  # one blob peaking at vmax
    data[tuple(ijk[0])] = -vmax
    fig = component_figure(nib.Nifti1Image(data, affine), title="IC01")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    cbar_ax = max(fig.axes, key=lambda ax: ax.get_position().height / max(ax.get_position().width, 1e-9))
    labels = [t for t in cbar_ax.yaxis.get_ticklabels() if t.get_visible() and t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in labels]
    assert len(labels) >= 2 and not _overlaps(boxes), [t.get_text() for t in labels]
    shown = {float(t.get_text().replace("\u2212", "-")) for t in labels}
    assert {2.0, -2.0} <= shown  # the threshold is marked
    caption = next(t for t in fig.texts if "z-score" in t.get_text()).get_window_extent(renderer)
    assert not any(caption.overlaps(b) for b in boxes)
    plt.close(fig)


def test_colorbar_ticks_drop_an_end_too_close_to_the_threshold():
    assert colorbar_ticks(6.0, 2.0) == [-6.0, -2.0, 2.0, 6.0]
    assert colorbar_ticks(2.3, 2.0) == [-2.0, 2.0]
    assert colorbar_ticks(1.5, 2.0) == [-1.5, 0.0, 1.5]  # nothing above the threshold


def test_time_courses_are_z_scored_and_their_spectrum_is_in_hz():
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(0)
    S = 0.03 * rng.standard_normal((4, 150))  # the scale a site's time courses come in
    fig = timecourse_plot(S, 0.8)
    axes = np.array(fig.axes).reshape(4, 2)
    assert "Hz" in axes[-1, 1].get_xlabel() and "0.8 s" in axes[-1, 1].get_xlabel()
    assert "z-scored" in axes[0, 0].get_title()
    for ax in axes[:, 0]:
        y = ax.get_lines()[0].get_ydata()
        assert abs(np.mean(y)) < 1e-9 and np.std(y) == pytest.approx(1.0)
    assert axes[-1, 1].get_xlim()[1] == pytest.approx(1 / (2 * 0.8), rel=0.1)  # up to Nyquist, in Hz
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in axes.ravel():
        for axis in (ax.xaxis, ax.yaxis):
            boxes = [t.get_window_extent(renderer) for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
            assert not _overlaps(boxes)
    plt.close(fig)
    fig = timecourse_plot(S, None)  # no TR: volumes, not seconds
    assert "volume" in fig.axes[-2].get_xlabel() and "Hz" not in fig.axes[-1].get_xlabel()
    plt.close(fig)


def test_figures_drawn_by_worker_processes_are_the_ones_drawn_here(tmp_path):
    """A report's many figures go to worker processes; each PNG must be byte for byte what this process draws."""
    from dpneuro.report.figures import PARALLEL_FIGURES, render_many

    mask, affine = load_space("mni6mm")
    rng = np.random.default_rng(3)
    jobs = []
    for i in range(PARALLEL_FIGURES):
        vol = np.zeros(mask.shape)
        vol[mask] = rng.standard_normal(int(mask.sum())) * (1 + i % 3)
        jobs.append((nib.Nifti1Image(vol, affine), f"fig_{i:02d}.png", {"title": f"IC{i + 1:02d}", "width": 5.4}))
    drawn = {}
    for where, workers in (("serial", 1), ("parallel", 2)):
        (tmp_path / where).mkdir()
        drawn[where] = render_many([(img, tmp_path / where / name, kw) for img, name, kw in jobs], workers=workers)
    serial, parallel = drawn["serial"], drawn["parallel"]
    # the workers are gone on return: idle ones held a Pydra worker process for loky's 300 s timeout
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    if children.exists():
        def cmd(pid):
            try:
                return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:  # exited meanwhile
                return ""

        alive = [c for c in map(cmd, children.read_text().split()) if c and "resource_tracker" not in c]
        assert not alive, f"render workers still running: {alive}"
    assert [Path(p).name for p in parallel] == [Path(p).name for p in serial] == [name for _, name, _ in jobs]
    for a, b in zip(serial, parallel):
        assert Path(a).read_bytes() == Path(b).read_bytes(), Path(a).name
