"""A simulation's pre-flight: every check that needs no release is made before the first one, and before any
site's fMRI data are loaded. Bad participants tables (a subject missing, a level the consortium did not agree on, a
covariate that is not a number, a column missing) stop `dpneuro run` naming the site, the table and the subject;
nothing is loaded, released or written under out/."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dpneuro.cli import main
from dpneuro.config import ConfigError, RunConfig
from dpneuro.data.participants import CovariateError
from dpneuro.datasets.synth import make_consortium
from dpneuro.run import factory, pipeline

COVARIATES = {"group": ["control", "patient"], "age": [20, 70]}


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    """3 sites x 3 subjects, each site's participants.tsv with group, age and sex."""
    root = tmp_path_factory.mktemp("preflight")
    return make_consortium(root / "data", n_sites=3, subjects_per_site=3, n_components=4, n_timepoints=40,
                           space="grid30", random_state=2, effects={"patients": [0.4, 0.4, 0.4]})


def _toml(tmp_path: Path, man: dict, site_path: Path, out: Path | None = None, **extra) -> Path:
    """The run on ``man`` with site-02's data read from ``site_path`` (a copy whose table a test edits)."""
    sites = "".join(f'[[sites]]\nname = "{s["site"]}"\npath = "{site_path if i == 1 else s["path"]}"\n'
                    for i, s in enumerate(man["sites"]))
    more = "".join(f"{k} = {v}\n" for k, v in extra.items())
    toml = tmp_path / "run.toml"
    toml.write_text(f'out = "{out or tmp_path / "out"}"\nmask = "{man["mask"]}"\nn_components = 4\nseed = 0\n'
                    f'simulation = true\nparcels = 30\nica = "spatial"\nfnc = false\ndesign = "group + age"\n'
                    f'glm_measures = ["amplitude"]\nglm_epsilon = 8.0\n{more}'
                    f'[covariates]\ngroup = ["control", "patient"]\nage = [20, 70]\n{sites}')
    return toml


def _site_copy(tmp_path: Path, man: dict) -> tuple[Path, list[list[str]]]:
    site = tmp_path / "site-02"
    shutil.copytree(man["sites"][1]["path"], site)
    rows = [ln.split("\t") for ln in (site / "participants.tsv").read_text().splitlines()]
    return site, rows


def _write(site: Path, rows: list[list[str]]) -> Path:
    table = site / "participants.tsv"
    table.write_text("".join("\t".join(r) + "\n" for r in rows))
    return table


def _edits(rows: list[list[str]]) -> dict[str, tuple[list[list[str]], str]]:
    """Each bad table of the tests and what the error must say of it."""
    sid = rows[2][0]
    patient = [r if r[0] != sid else [r[0], "Patient", *r[2:]] for r in rows]
    old = [r if r[0] != sid else [r[0], r[1], "old", *r[3:]] for r in rows]
    return {"missing subject": ([r for r in rows if r[0] != sid], f"{sid} (not in the participants table)"),
            "unagreed level": (patient, f"{sid} (group = 'Patient' is not one of the agreed levels "
                                        "['control', 'patient'])"),
            "not a number": (old, f"{sid} (age = 'old' is not a number)"),
            "no column": ([[r[0], r[2]] for r in rows], "no column ['group']")}


@pytest.mark.parametrize("case", ["missing subject", "unagreed level", "not a number", "no column"])
def test_a_bad_participants_table_stops_the_run_before_anything_is_loaded(consortium, tmp_path, capsys, monkeypatch,
                                                                          case):
    man = consortium
    site, rows = _site_copy(tmp_path, man)
    bad, says = _edits(rows)[case]
    table = _write(site, bad)

    def no_load(*args, **kwargs):
        raise AssertionError("a site's data were loaded")

    monkeypatch.setattr(pipeline, "load_site", no_load)  # the serial plugin runs the stages in this process
    assert main(["run", str(_toml(tmp_path, man, site)), "-q", "--plugin", "serial"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("dpneuro run: error: site 'site-02': ") and str(table) in err and says in err, err
    assert "before anything was loaded or released" in err
    # nothing was loaded, released or recorded: no stage's folder, no ledger, no privacy record
    out = tmp_path / "out"
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()], sorted(out.rglob("*"))


def test_with_on_bad_subject_skip_the_pre_flight_lets_the_stage_leave_them_out(consortium, tmp_path):
    """A subject without usable covariates is left out of the model by the stage, as before; a table that cannot
    give the design's columns still stops the run."""
    man = consortium
    site, rows = _site_copy(tmp_path, man)
    bad, _ = _edits(rows)["unagreed level"]
    _write(site, bad)
    cfg, _ = pipeline.prepare(RunConfig.read(_toml(tmp_path, man, site, on_bad_subject='"skip"')))
    assert cfg.on_bad_subject == "skip"
    _write(site, _edits(rows)["no column"][0])
    with pytest.raises(CovariateError, match=r"site 'site-02': .*no column \['group'\]"):
        pipeline.prepare(cfg)


def test_the_pre_flight_and_the_stage_call_the_same_check(consortium, tmp_path):
    """The pre-flight checks the subjects discovery finds, the stage those it loaded: the same function
    (dpneuro.data.participants.check_covariates) and the same message."""
    from dpneuro.data.participants import check_covariates

    man = consortium
    site, rows = _site_copy(tmp_path, man)
    bad, says = _edits(rows)["unagreed level"]
    table = _write(site, bad)
    cfg = RunConfig.read(_toml(tmp_path, man, site)).resolved()
    assert pipeline.site_subjects(cfg, "site-02") == [r[0] for r in rows[1:]]
    with pytest.raises(CovariateError) as direct:
        check_covariates(table, [r[0] for r in rows[1:]], factory.glm_settings(cfg).design, 1, "site-02")
    with pytest.raises(CovariateError) as preflight:
        pipeline.check_site(cfg, "site-02")
    assert str(preflight.value).startswith(str(direct.value)) and says in str(direct.value)
    # a run that stops before the group statistics does not read the tables
    pipeline.check_site(cfg, "site-02", until="unmix")


def test_a_participants_table_is_read_as_a_spreadsheet_may_save_it(tmp_path):
    """A byte-order mark before participant_id, a table of no subject, bytes that are not text: each read or
    refused by name."""
    from dpneuro.algorithms.glm import Design, parse_design
    from dpneuro.data.participants import check_covariates

    design = Design(parse_design("group", {"group": ["control", "patient"]}), ("a", "b"))
    table = tmp_path / "participants.tsv"
    table.write_bytes(b"\xef\xbb\xbfparticipant_id\tgroup\nsub-01\tpatient\n")
    rows, _, why = check_covariates(table, ["sub-01"], design, 0, "a")
    assert list(rows) == ["sub-01"] and not why
    table.write_text("participant_id\tgroup\n")
    with pytest.raises(CovariateError, match=r"site 'a': 1 subject\(s\) .*sub-01 \(not in the participants table\)"):
        check_covariates(table, ["sub-01"], design, 0, "a")
    table.write_bytes(b"participant_id\tgroup\nsub-01\t\xff\xfe\n")
    with pytest.raises(CovariateError, match="site 'a': .*cannot be read"):
        check_covariates(table, ["sub-01"], design, 0, "a")


def test_an_input_inside_the_runs_working_folder_is_refused(consortium, tmp_path):
    """The run removes its Pydra cache under <out>/work after a failure: no input may lie there."""
    man = consortium
    site = tmp_path / "out" / "work" / "site-02"
    shutil.copytree(man["sites"][1]["path"], site)
    with pytest.raises(ConfigError, match=r"sites\[1\] \(site-02\).*inside the run's working folder"):
        pipeline.prepare(RunConfig.read(_toml(tmp_path, man, site)))


def test_an_output_folder_that_cannot_be_written_is_refused_before_anything_is_loaded(consortium, tmp_path):
    man = consortium
    site, _ = _site_copy(tmp_path, man)
    (tmp_path / "a-file").write_text("")  # a folder below a file cannot be made, whoever runs the test
    with pytest.raises(ConfigError, match="'out': the run's working folder .*a-file/out/work cannot be written"):
        pipeline.prepare(RunConfig.read(_toml(tmp_path, man, site, out=tmp_path / "a-file" / "out")))
