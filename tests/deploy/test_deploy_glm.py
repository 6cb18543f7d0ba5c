"""Group statistics in a deployed run: the aggregator and 4 sites as processes over a shared folder, each site
reading its own participants table, give the simulation's group effects; no site's table or measures leave it."""

from __future__ import annotations

import json

import deploy_common as dc
import numpy as np
from test_deploy_sharedfs import _run_all, write_config

from dpneuro.datasets.synth import make_consortium
from dpneuro.run.outputs import read_group_effects

COVARIATES = {"group": ["control", "patient"], "age": [20, 70]}


def test_a_deployed_consortium_fits_the_group_model_as_the_simulation_does(tmp_path):
    man = make_consortium(tmp_path / "data", n_sites=4, subjects_per_site=[4, 3, 5, 4], n_components=4,
                          n_timepoints=40, space="grid30", random_state=0,
                          effects={"patients": [0.25, 0.5, 0.4, 0.5]})
    kw = dict(ica="spatial", design="group + age", covariates=COVARIATES, glm_epsilon=8.0,
              glm_measures=["amplitude"])
    cfg = write_config(tmp_path / "run.toml", man, out=tmp_path / "out", exchange=tmp_path / "shared", **kw)
    _run_all(cfg, man, tmp_path)
    ref = dc.reference(dc.run_config(man, tmp_path / "sim", **kw))["glm"]
    rows = read_group_effects(tmp_path / "out" / "dpneuro" / "group_effects.tsv")
    got = np.array([r["estimate"] for r in rows]).reshape(np.shape(ref["estimate"]))
    np.testing.assert_allclose(got, ref["estimate"], rtol=1e-5, atol=1e-6)
    assert "Group statistics" in (tmp_path / "out" / "dpneuro" / "report.html").read_text()
    counts = json.loads((tmp_path / "out" / "dpneuro" / "group_effects.json").read_text())["subjects"]
    assert counts == {s["site"]: len(s["subjects"]) for s in man["sites"]}
    # what left the sites for this stage: one release each, no covariate and no subject's measure by name
    for s in man["sites"]:
        sent = (tmp_path / "shared" / "dpneuro" / "glm" / "egress" / f"{s['site']}.jsonl").read_text()
        assert "patient" not in sent and "sub-" not in sent
