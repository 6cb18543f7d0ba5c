"""A deployed site checks its own files at start-up, before it loads its data or takes part in any release: a
participants table that cannot give the design's covariates stops it there, naming the site, the table and the
subject; its ledger records nothing, no party releases anything, and the others stop naming it.

The real parties (sharedfs.aggregator_main / site_main, each with its own pinned key) run in threads."""

from __future__ import annotations

import shutil
from pathlib import Path

import deploy_common as dc
import pytest

from dpneuro.data.participants import CovariateError
from dpneuro.datasets.synth import make_consortium
from dpneuro.protocol.exchange import DirectoryExchange, PartyFailed

RUN = "startup"
COVARIATES = {"group": ["control", "patient"], "age": [20, 70]}


@pytest.fixture(scope="module")
def man(tmp_path_factory):
    return make_consortium(tmp_path_factory.mktemp("startup") / "data", n_sites=3, subjects_per_site=3,
                           n_components=4, n_timepoints=40, space="grid30", random_state=1,
                           effects={"patients": [0.4, 0.4, 0.4]})


def _released(cfg, site: str) -> list[str]:
    """The topics of the releases ``site`` sent, every stage's (its egress logs in the shared folder)."""
    topics = []
    for log in sorted((Path(cfg.exchange_dir) / RUN).glob(f"*/egress/{site}.jsonl")):
        topics += [r["topic"] for r in DirectoryExchange._parse_log(log.read_bytes())
                   if r["topic"].split(".")[0] == "release"]
    return topics


@pytest.mark.parametrize("case", ["missing subject", "unagreed level"])
def test_a_site_with_a_bad_participants_table_stops_at_start_up(man, tmp_path, case):
    site = tmp_path / "site-02"
    shutil.copytree(man["sites"][1]["path"], site)
    table = site / "participants.tsv"
    rows = table.read_text().splitlines()
    sid = rows[2].split("\t")[0]
    if case == "missing subject":
        table.write_text("\n".join(rows[:2] + rows[3:]) + "\n")
        says = f"{sid} (not in the participants table)"
    else:
        cells = rows[2].split("\t")
        table.write_text("\n".join([*rows[:2], "\t".join([cells[0], "Patient", *cells[2:]]), *rows[3:]]) + "\n")
        says = f"{sid} (group = 'Patient' is not one of the agreed levels ['control', 'patient'])"
    local = {**man, "sites": [{**s, "path": str(site)} if s["site"] == "site-02" else s for s in man["sites"]]}
    cfg = dc.run_config(local, tmp_path / "out", exchange_dir=str(tmp_path / "shared"), ica="spatial", fnc=False,
                        design="group + age", covariates=COVARIATES, glm_epsilon=8.0, glm_measures=["amplitude"],
                        timeout=30.0)
    names = [s.name for s in cfg.sites]
    keys_file, private = dc.party_keys(tmp_path / "keys", names)
    out: dict[str, object] = {}
    for t in dc.start_parties(cfg, keys_file, private, out, RUN):
        t.join(timeout=120)
        assert not t.is_alive(), "a party did not stop"

    err = out["site-02"]
    assert isinstance(err, CovariateError), err
    assert str(err).startswith("site 'site-02': ") and str(table) in str(err) and says in str(err), err
    # it stopped before its data were loaded and before the first release: nothing in its ledger, nothing sent
    work = Path(cfg.out) / ".dpneuro" / RUN / "site-02"
    assert not list(work.glob("*.result.npz")) and not list(work.glob("*.ckpt.npz")), sorted(work.iterdir())
    assert not list(work.glob("pipeline/work/load-*"))
    assert not (cfg.run_dir / "site-02" / "privacy.json").exists()
    for name in names:
        assert _released(cfg, name) == [], (name, _released(cfg, name))
    # the others stopped on its notice, naming it
    for party in ("aggregator", "site-01", "site-03"):
        assert isinstance(out[party], PartyFailed) and "site-02" in str(out[party]), (party, out[party])
    assert "before anything was loaded or released" in str(err)
