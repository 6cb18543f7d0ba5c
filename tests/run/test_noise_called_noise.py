"""A consortium too small for its budget: the run stops before any release unless asked to run anyway, and then
every output says the same about which components are noise."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

import dpneuro
from dpneuro.config import ConfigError
from dpneuro.datasets.synth import make_consortium
from dpneuro.run.naming import NOISE_NAME, read_component_table
from dpneuro.run.outputs import read_group_effects

R = 8
COVARIATES = {"group": ["control", "patient"], "age": [20, 70]}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Three hospitals of 4, 5 and 6 subjects (15 in all)."""
    root = tmp_path_factory.mktemp("small")
    return root, make_consortium(root / "data", n_sites=3, subjects_per_site=[4, 5, 6], n_components=R,
                                 n_timepoints=60, space="mni6mm", random_state=3, dtype="int16",
                                 effects={"patients": [0.5, 0.4, 0.5]})


def _ica(man, out, **kw):
    return dpneuro.DecentralizedICA(n_components=R, mask=man["mask"], random_state=1, parcels=100, out=out,
                                    epsilon=4.0, design="group + age", covariates=COVARIATES, **kw)


def _sites(man):
    return {s["site"]: s["path"] for s in man["sites"]}


def test_a_budget_that_buys_nothing_stops_before_any_release(small, tmp_path):
    _, man = small
    out = tmp_path / "refused"
    with pytest.raises(ConfigError, match="buys no component") as err:
        _ica(man, out).fit(_sites(man))
    text = str(err.value)
    assert "subjects per site" in text and "allow_noise_maps = true" in text
    assert not list(out.rglob("privacy.json")) and not list(out.rglob("*ledger*"))  # nothing was spent
    assert not list(out.rglob("reduce*"))


def test_run_anyway_every_output_marks_the_same_components_as_noise(small, tmp_path):
    _, man = small
    ica = _ica(man, tmp_path / "anyway", allow_noise_maps=True).fit(_sites(man))
    out = Path(ica.output_dir_)
    table = read_component_table(out / "components.tsv")
    signal = np.array([r["signal"] for r in table])
    assert len(table) == R and not signal.all()  # at this size the noise wins
    for r in table:  # a component below the noise is named noise, never a network
        assert (r["network_name"] == NOISE_NAME) == (not r["signal"]) and (r["noise"] or r["signal"])
    assert np.array_equal(ica.signal_components_, signal)
    # the released spectrum decides: as many signal components as eigenvalues above the noise's edge
    run = json.loads((out / "run.json").read_text())
    lam = np.asarray(ica.eigenvalues_)
    edge = float(run["signal"].split("edge (")[1].split(":")[0])
    assert int(signal.sum()) == int(np.sum(lam > edge))
    assert run["signal"].startswith(f"{int(signal.sum())} of {R} components carry signal")
    html = (out / "report.html").read_text()
    assert run["signal"].replace("'", "&#x27;") in html and "stand above it" not in html
    noise = [r["component"] for r in table if not r["signal"]]
    assert json.loads((out / "fnc.json").read_text())["noise_components"] == noise
    effects = read_group_effects(out / "group_effects.tsv")
    for r in effects:
        involved = set(r["measure"].replace("-", " ").split()[1:])
        assert r["signal"] == (not involved & set(noise))
        assert math.isnan(r["q"]) != r["signal"]
