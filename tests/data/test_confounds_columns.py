"""fMRIPrep confounds tables with or without the ``*_power2`` columns (issue 58): a nilearn strategy uses the richest
of nilearn's models each table has the columns of, chosen from the column names, recorded in the site's record, and
checkable before anything is read."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpneuro.config import RunConfig
from dpneuro.data.cleaning import Cleaning, CleaningError
from dpneuro.data.load import load_site
from dpneuro.datasets.fmriprep import analysis_mask, write_fmriprep_site

TEMPLATE = Path(__file__).resolve().parents[2] / "site_templates" / "fmriprep.toml"


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """The same site written twice: with the ``*_power2`` columns (the default) and without them."""
    d = tmp_path_factory.mktemp("confounds")
    kw = dict(n_subjects=2, n_volumes=40, multi_run=False, random_state=3)
    return (write_fmriprep_site(d / "full", **kw), write_fmriprep_site(d / "no_power2", power2=False, **kw),
            analysis_mask(d / "mask.nii.gz"))


def _tables(site) -> list[Path]:
    return sorted(site.root.rglob("*_desc-confounds_timeseries.tsv"))


def test_the_generator_leaves_the_power2_columns_out_only_when_asked(trees):
    full, bare, _ = trees
    for a, b in zip(_tables(full), _tables(bare), strict=True):
        ta, tb = pd.read_csv(a, sep="\t"), pd.read_csv(b, sep="\t")
        assert "trans_x_power2" in ta and "csf_derivative1_power2" in ta
        assert list(tb) == [c for c in ta if not c.endswith("_power2")]
        pd.testing.assert_frame_equal(ta[list(tb)], tb)  # the same draws: only the columns differ


def test_the_fmriprep_template_runs_on_tables_without_power2_columns(trees, tmp_path):
    """The template's confounds = "simple" (nilearn's motion model "full") on tables without *_power2 columns:
    motion = "derivatives" for every run, as the site's record and console say."""
    from dpneuro.run.pipeline import stage_load, stage_space

    _, bare, mask = trees
    raw = tomllib.loads(TEMPLATE.read_text())
    raw.update(sites=[{"name": "site-01", "path": str(bare.root)}], out=str(tmp_path / "out"), mask=str(mask),
               n_components=4, simulation=True, seed=0, plan="conv")  # one site's load stage: no CAPE
    cfg = RunConfig.from_dict(raw, base=tmp_path).validate()
    assert cfg.confounds == "simple" and not cfg.confounds_options
    cfg_json = tmp_path / "cfg.json"
    cfg_json.write_text(json.dumps(cfg.to_json()))
    rec = json.loads(Path(stage_load(str(cfg_json), "site-01", stage_space(str(cfg_json)))).read_text())
    assert rec["n_subjects"] == 2
    assert rec["cleaning"]["adapted"] == [{"option": "motion", "preset": "full", "used": "derivatives", "runs": 2,
                                           "of": 2}]
    assert ("load_confounds_strategy(denoise_strategy='simple'), with motion='derivatives' instead of the preset's "
            "'full' for 2 of 2 runs (their confounds tables lack the preset's columns)") in rec["cleaning"]["description"]
    # the run's record (run.json, the report's data section) says it for that site
    from dpneuro.run.pipeline import cleaning_record

    said = cleaning_record(cfg, [rec])
    assert said["sites"] == {"site-01": rec["cleaning"]["description"]} and "site-01: " in said["description"]
    assert "sites" not in cleaning_record(cfg, [{**rec, "cleaning": {"description": "as configured"}}])


def test_the_adapted_strategy_is_nilearns_with_the_models_the_tables_have(trees):
    full, bare, mask = trees
    got = load_site(bare.root, mask, bids={"task": "rest"}, cleaning=Cleaning(confounds="scrubbing"))
    want = load_site(bare.root, mask, bids={"task": "rest"}, cleaning=Cleaning(
        confounds="scrubbing", confounds_options={"motion": "derivatives", "wm_csf": "derivatives"}))
    np.testing.assert_array_equal(got.X, want.X)
    assert [a["option"] for a in got.cleaning["adapted"]] == ["motion", "wm_csf"]
    # tables with every column: the preset as it is, and nothing recorded
    as_is = load_site(full.root, mask, bids={"task": "rest"}, cleaning=Cleaning(confounds="simple"))
    assert "adapted" not in as_is.cleaning and as_is.cleaning["description"] == Cleaning("simple").describe()


def check_site_confounds(root, cleaning: Cleaning, filters=None) -> Cleaning:
    """A site's tables as the run's pre-flight checks them: its runs as its loader finds them."""
    from dpneuro.data.cleaning import check_confounds_tables
    from dpneuro.data.discovery import find_subjects

    found = find_subjects(root, filters=filters, default_desc=cleaning.desc)
    return check_confounds_tables([f for _, files in found.subjects for f in files], cleaning)


def test_a_sites_tables_are_checked_before_anything_is_read(trees, tmp_path):
    full, bare, _ = trees
    used = check_site_confounds(bare.root, Cleaning(confounds="simple"), filters={"task": "rest"})
    assert [(a["option"], a["used"], a["runs"]) for a in used.adaptations()] == [("motion", "derivatives", 2)]
    assert "motion='derivatives' instead of the preset's 'full' for 2 of 2 runs" in used.describe()
    assert not check_site_confounds(full.root, Cleaning(confounds="simple")).adaptations()
    # the same columns, the same choice: only the column names decide
    again = check_site_confounds(bare.root, Cleaning(confounds="simple"), filters={"task": "rest"})
    assert again.adapted == used.adapted
    # what the configuration sets is used as it is: refused by name when a table lacks its columns
    with pytest.raises(CleaningError, match=r"confounds_options sets motion = 'full', whose column\(s\) "
                                            r"\['trans_x_power2'.*set a model its columns allow \(motion = "
                                            r"'derivatives'\)"):
        check_site_confounds(bare.root, Cleaning(confounds="simple", confounds_options={"motion": "full"}))
    # a table without even the base columns, or a column list's: refused naming the table and the columns
    site = write_fmriprep_site(tmp_path / "s", n_subjects=2, n_volumes=40, multi_run=False, random_state=4)
    table = next(t for t in _tables(site) if "sub-02_task-rest" in t.name)
    pd.read_csv(table, sep="\t").drop(columns=["csf"]).to_csv(table, sep="\t", index=False, na_rep="n/a")
    with pytest.raises(CleaningError, match=r"sub-02_task-rest_desc-confounds_timeseries.tsv.*no column\(s\) "
                                            r"\['csf'\].*'simple' strategy needs for its 'wm_csf' confounds"):
        check_site_confounds(site.root, Cleaning(confounds="simple"), filters={"task": "rest"})
    with pytest.raises(CleaningError, match=r"no column\(s\) \['csf'\]"):
        check_site_confounds(site.root, Cleaning(confounds=("trans_x", "csf")), filters={"task": "rest"})


def test_the_run_checks_every_sites_tables_before_its_first_release(tmp_path):
    """The pre-flight's site checks (a simulation's before anything is loaded, a deployed site's at start-up)
    include the confounds tables: a table without a column the strategy needs stops the run naming the site."""
    from dpneuro.config import SiteEntry
    from dpneuro.run import pipeline

    site = write_fmriprep_site(tmp_path / "s", n_subjects=2, n_volumes=40, multi_run=False, random_state=4,
                               power2=False)
    cfg = RunConfig(sites=[SiteEntry(f"site-0{i + 1}", str(site.root)) for i in range(3)], out=str(tmp_path / "o"),
                    confounds="simple", bids={"task": "rest"})
    used = pipeline.check_site_confounds(cfg, "site-02")  # no *_power2: the fallback, said before any load
    assert [(a["option"], a["used"]) for a in used.adaptations()] == [("motion", "derivatives")]
    table = next(t for t in _tables(site) if "sub-02_task-rest" in t.name)
    pd.read_csv(table, sep="\t").drop(columns=["csf"]).to_csv(table, sep="\t", index=False, na_rep="n/a")
    with pytest.raises(CleaningError, match=r"site 'site-02': .*no column\(s\) \['csf'\].*before anything was "
                                            r"loaded or released"):
        pipeline.check_site(cfg, "site-02")
    assert ("load", pipeline.check_site_confounds) in pipeline.SITE_CHECKS
