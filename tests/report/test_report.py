"""The report as a neuroscientist opens it: in a real browser, offline, every image there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from browser import chromium, inspect_page
from test_report_timings import assert_every_map_shown

from dpneuro.config import RunConfig
from dpneuro.data.images import load_space
from dpneuro.datasets.synth import make_consortium
from dpneuro.report.figures import read_timecourses, template_problem
from dpneuro.workflows import run_workflow


@pytest.fixture(scope="module")
def mni_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    man = make_consortium(root / "data", n_sites=3, subjects_per_site=4, n_components=4, n_timepoints=40,
                          space="mni6mm", random_state=2, dtype="int16")
    cfg = RunConfig.from_dict(dict(
        sites=[{"name": s["site"], "path": s["path"]} for s in man["sites"]], out=str(root / "run"),
        mask=man["mask"], space="mni6mm", parcels=40, n_components=4, truth=str(root / "data"),
        pca_epsilon=200.0, ica_epsilon_i=5.0, ica_rounds=10, clip_G=0.7, clip_h=0.7, seed=0,
        interactive_maps=True)).validate()
    res = run_workflow(cfg)
    return cfg, res


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_report_content(mni_run):
    cfg, res = mni_run
    html = open(res["report"], encoding="utf-8").read()
    assert "slice coordinates in mm" in html and "|z| &gt; 2" in html
    assert html.count("<iframe") == 4  # one interactive view per component
    # every component's map beside its truth's, and each site's voxel map of it: a picture each, none lost
    assert_every_map_shown(html, 4, [s.name for s in cfg.sites] if cfg.site_voxel_maps else (), truth=True)
    assert 'alt="time courses"' not in html  # no site's subject data in the consortium report
    tsvs = sorted((cfg.run_dir / "timecourses").glob("site-??.tsv"))
    assert len(tsvs) == 3
    for tsv in tsvs:  # each site's subjects' own FNC beside its time courses: one row per subject, 6 pairs
        rows = tsv.with_name(f"{tsv.stem}_fnc.tsv").read_text().splitlines()
        assert len(rows) == 1 + 4 and rows[0].split("\t")[1:] == [
            f"IC{i:02d}-IC{j:02d}" for i in range(1, 5) for j in range(i + 1, 5)]
    for tsv in tsvs:
        subjects, tc = read_timecourses(tsv)
        assert tc.shape[0] == 4 and len(set(subjects)) == 4
    privacy = json.loads((cfg.run_dir / "privacy.json").read_text())
    assert "against the aggregator" in html and f'class="privacybox {privacy["strength"]}"' in html
    # a page to publish from: every component at a glance first, the FNC, then each component named
    at_glance, fnc, maps = (html.index(h) for h in ("Components at a glance", "Static functional network",
                                                      "<h2>Spatial maps"))
    assert at_glance < fnc < maps < html.index("<h3>Released spectrum")
    rows = (cfg.run_dir / "components.tsv").read_text().splitlines()
    assert len(rows) == 5 and rows[0].startswith("component\tnetwork\tnetwork_name")
    for row in rows[1:]:  # each component's row in the report's table, its network in its caption
        cells = row.split("\t")
        assert f"<td>{cells[0]}</td><td>{cells[2]}</td>" in html
    fnc_json = json.loads((cfg.run_dir / "fnc.json").read_text())
    assert f"standard deviation {fnc_json['noise_sd']:.3f}" in html
    assert "features (40 coordinate parcels; painted back to voxels)" in html
    assert "top-k principal subspace" in html  # the run's subspace contributions, not second moments


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_report_loads_offline_in_a_browser_with_every_image(mni_run, tmp_path):
    if chromium() is None:
        if os.environ.get("DPNEURO_REQUIRE_BROWSER"):
            pytest.fail("Chromium is required here (DPNEURO_REQUIRE_BROWSER) but not installed")
        pytest.skip("needs Debian's chromium (installed by .ci/run)")
    _, res = mni_run
    page = inspect_page(Path(res["report"]), screenshot=tmp_path / "report.png")
    assert page["errors"] == [], page["errors"]
    assert page["remote_requests"] == [], page["remote_requests"]
    # maps, their truths and the sites' voxel maps, the overview, FNC and spectrum (spatial ICA: no convergence)
    assert len(page["images"]) == 4 + 4 + 4 * 3 + 3
    assert all(w > 0 and h > 0 for _, w, h in page["images"]), page["images"]
    alts = [alt for alt, _, _ in page["images"]]
    assert {"every component", "static FNC", "released spectrum"} <= set(alts), alts
    assert alts[0] == "every component"  # the overview opens the page
    assert page["iframes"] == 4
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_native_space_grids_are_not_drawn_on_the_template():
    mask, affine = load_space("mni6mm")
    img = nib.Nifti1Image(mask.astype(np.uint8), affine)
    assert template_problem(img) is None
    shifted = affine.copy()
    shifted[:3, 3] += [0.0, 120.0, 90.0]  # a head in scanner coordinates, far from MNI's origin
    problem = template_problem(nib.Nifti1Image(mask.astype(np.uint8), shifted))
    assert problem and "not in MNI space" in problem
