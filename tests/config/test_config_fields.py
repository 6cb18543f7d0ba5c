"""Each RunConfig field is described once, in its metadata: what it accepts (enforced, naming the field), what it
means (rendered into docs/api.md, run.toml and --help), whether every party agrees on it and which stages use it."""

import argparse
import math
from dataclasses import MISSING, fields, replace
from numbers import Integral, Real
from pathlib import Path

import pytest

from dpneuro.cli import build_parser
from dpneuro.config import (
    STAGES,
    Boolean,
    ConfigError,
    Interval,
    OrNone,
    RunConfig,
    SiteEntry,
    StrOptions,
    check_delta,
    consortium_fields,
    constraint,
    estimator_name,
    run_template,
    stage_fields,
    summary,
    with_settings,
)

REPO = Path(__file__).resolve().parents[2]

# What deploy/party.py (CONSORTIUM_FIELDS) and pipeline.py (STAGE_FIELDS) listed by hand before the fields' metadata
# described them: the derived sets must not change by accident.
FROZEN_CONSORTIUM = {
    "plan", "n_colluding", "delta", "epsilon", "pca_epsilon", "pca_subject_bound", "pca_contribution", "max_memory_gb",
    "ica_epsilon_i", "ica_delta_i", "ica_rounds", "ica_unmixing", "cumulant_epsilon",
    "clip_G", "clip_h", "ica_clip_unit", "ica_bias", "calibration", "reduction", "ica", "n_components", "optimizer",
    "standardize", "min_volumes", "parcels", "pdsvd_iterations", "brain_states", "states_epsilon",
    "states_method", "states_window", "states_step", "states_metric", "seed", "simulation", "confounds",
    "confounds_options", "detrend", "high_pass", "low_pass", "smoothing_fwhm",
    # added with their features, each to the set its stage's fields belong to
    "atlas_fill", "allow_noise_maps", "fnc", "fnc_epsilon", "design", "covariates", "glm_measures", "glm_epsilon",
    "question", "glm_hypotheses",
}
FROZEN_STAGES = {
    "space": {"mask", "space", "parcels", "atlas", "atlas_fill"},
    "load": {"sites", "standardize", "min_volumes", "bids", "confounds", "confounds_options", "detrend", "high_pass",
             "low_pass", "smoothing_fwhm", "on_bad_subject"},
    "reduce": {"n_components", "reduction", "plan", "n_colluding", "pca_epsilon", "pca_subject_bound",
               "pca_contribution", "ica", "delta", "seed", "pdsvd_iterations", "max_memory_gb"},
    "unmix": {"ica", "plan", "n_colluding", "ica_epsilon_i", "ica_delta_i", "ica_rounds", "clip_G", "clip_h",
              "ica_clip_unit", "ica_bias", "optimizer", "calibration", "ica_unmixing", "cumulant_epsilon", "seed"},
    "fnc": {"fnc", "fnc_epsilon", "plan", "n_colluding", "delta", "seed"},
    "states": {"brain_states", "states_epsilon", "states_method", "states_window", "states_step", "states_metric",
               "plan", "n_colluding", "delta", "seed"},
    "glm": {"design", "covariates", "glm_measures", "glm_hypotheses", "glm_epsilon", "plan", "n_colluding", "delta", "seed"},
    "maps": {"delta", "truth", "plan", "n_colluding", "seed", "site_voxel_maps", "site_maps_method"},
}


def test_consortium_and_stage_fields_are_those_listed_by_hand_before():
    assert set(consortium_fields()) == FROZEN_CONSORTIUM
    assert set(STAGES) == set(FROZEN_STAGES)
    for stage, names in FROZEN_STAGES.items():
        assert set(stage_fields(stage)) == names, stage
    assert stage_fields("report") == ()  # the report depends on every field (pipeline.stage_key)


def test_every_field_carries_one_description():
    for f in fields(RunConfig):
        m = f.metadata
        assert m["doc"].strip().endswith(".") and summary(f.name).endswith("."), f.name
        assert isinstance(m["agree"], bool) and set(m["stages"]) <= set(STAGES), f.name
        assert m["constraint"].describe() and callable(m["constraint"].check), f.name
        assert estimator_name(f.name) == ("random_state" if f.name == "seed" else f.name)
        if f.default is not MISSING:  # every default is accepted by its own constraint
            m["constraint"].check(f.name, f.default)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    sites = []
    for i in range(4):
        (root / f"s{i}").mkdir()
        sites.append(SiteEntry(f"site-{i}", str(root / f"s{i}")))
    return RunConfig(sites=sites, out=str(root / "out"), exchange_dir=str(root / "x")).validate()


def _refused(cfg: RunConfig, name: str) -> str:
    with pytest.raises(ConfigError) as exc:
        cfg.validate()
    msg = str(exc.value)
    assert f"'{name}'" in msg or f"'{name}." in msg, (name, msg)
    return msg


#: values no field accepts: not a number, infinite, negative, or of no TOML type
NEVER = [math.nan, math.inf, -math.inf, -1, -0.5, -10**30, 1j, b"bytes", object(), (1, 2)]


def _invalid(f) -> list:
    """Values the field must refuse: NEVER, booleans for a non-boolean, 3.5 for an integer, the declared range's
    outside and edges it excludes, and (for a bounded range) huge values."""
    c = f.metadata["constraint"]
    inner = c.inner if isinstance(c, OrNone) else c
    out = list(NEVER)
    if not isinstance(inner, Boolean):
        out += [True, False]
    else:
        out += [0, 1, "true", None]
    if not isinstance(c, OrNone) and not isinstance(inner, Boolean):
        out.append(None)
    if isinstance(inner, StrOptions):
        out += ["", "no-such-option", inner.options[0].upper() + "!", 1.0]
    for cc in (inner, getattr(inner, "inner", None)):  # an Interval, possibly inside Excluding
        if isinstance(cc, Interval):
            out += ["1", 3.5] if cc.kind is Integral else ["1.0"]
            if cc.left is not None:
                out.append(cc.left - 1)
                if cc.closed in ("right", "neither"):
                    out.append(cc.left)
            if cc.right is not None:
                out += [cc.right * 2 + 1, 1e300, 10**30]
                if cc.closed in ("left", "neither"):
                    out.append(cc.right)
    if f.name == "brain_states":
        out.append(1)
    return out


#: valid values of fields whose constraint alone does not say (paths must exist, names must be safe)
VALID = {"out": ["elsewhere"], "mask": [""], "space": ["mni4mm", "grid30"], "atlas": [""], "run_id": ["run-2.b"],
         "exchange_dir": ["other"], "truth": [""], "bids": [{"task": "rest", "run": 2}], "confounds": ["simple"],
         "confounds_options": [{}], "cluster": [{}], "sites": [],
         # the rules tying fields together: features D >= n_components, brain_states <= n_components pairs
         "parcels": [0, 20, 500], "brain_states": [0, 2, 19], "n_components": [2, 100]}


def _valid(f) -> list:
    c = f.metadata["constraint"]
    if f.name in VALID:
        return VALID[f.name]
    out = []
    inner = c.inner if isinstance(c, OrNone) else c
    if isinstance(c, OrNone):
        out.append(None)
    if isinstance(inner, Boolean):
        out += [True, False]
    if isinstance(inner, StrOptions):
        out += list(inner.options)
    cc = inner if isinstance(inner, Interval) else getattr(inner, "inner", None)
    if isinstance(cc, Interval):
        lo = cc.left if cc.closed in ("left", "both") else None
        if cc.right is not None:
            out.append((cc.left + cc.right) / 2)
            if cc.closed in ("right", "both"):
                out.append(cc.right)
        else:
            out += [cc.left + 1, cc.left + 3]
        if lo is not None:
            out.append(lo)
        if cc.kind is Real and cc.right is None:
            out.append(1e6)  # large but finite
    return out


def test_fuzz_every_field(base):
    """Every field: each invalid value refused by validate() naming the field, each valid one accepted."""
    for f in fields(RunConfig):
        for bad in _invalid(f):
            _refused(replace(base, **{f.name: bad}), f.name)
        for good in _valid(f):
            if f.name == "n_colluding" and good and good > 1:
                continue  # CAPE's limit for 4 sites is a rule of the protocol, checked when it runs
            if f.name == "question" and good == "group differences":  # a question about the design needs one
                _refused(replace(base, question=good, design=""), "question")
                replace(base, question=good, design="group", covariates={"group": ["a", "b"]}).validate()
                continue
            replace(base, **{f.name: good}).validate()


def test_toml_values_are_refused_as_they_are_read(base):
    d = {"out": "o", "sites": [{"name": "a", "path": "."}]}
    for f in fields(RunConfig):
        if f.name in ("sites", "out"):
            continue
        for bad in (True, math.nan, -1, "x" * 3):
            if f.metadata["constraint"].accepts(bad) or (f.name == "bids" and bad == "xxx"):
                continue
            with pytest.raises(ConfigError, match=f"'{f.name}'"):
                RunConfig.from_dict({**d, f.name: bad})


def test_the_issue_values_are_refused(base):
    for name, value in (("delta", 0.5), ("pca_epsilon", True), ("n_components", 3.5), ("ica_rounds", 2.5),
                        ("min_volumes", -3), ("clip_G", math.inf), ("states_epsilon", True)):
        _refused(replace(base, **{name: value}), name)
    assert "1/N" in _refused(replace(base, delta=0.1), "delta")
    assert "features D" in _refused(replace(base, n_components=200), "n_components")
    replace(base, n_components=200, parcels=0).validate()  # voxels: D is the grid's, known when the data are read


def test_delta_below_one_over_the_smallest_site():
    check_delta(1e-5, 1000)
    check_delta(0.009, 100)
    for delta, n in ((0.01, 100), (0.05, 20), (1e-3, 1000)):
        with pytest.raises(ConfigError, match=r"config field 'delta'.*1/N"):
            check_delta(delta, n)


def test_docs_and_template_are_generated_from_the_fields():
    """``python -m dpneuro.config --write .`` rewrites both; a field edited without it fails here."""
    api = (REPO / "docs" / "api.md").read_text()
    assert api == with_settings(api)
    for f in fields(RunConfig):
        assert f"| `{f.name}` |" in api
    template = (REPO / "site_templates" / "run.toml").read_text()
    assert template == run_template()
    assert "|r|" not in template and "tuned for" not in template  # no measured figures in a template


def test_help_comes_from_the_fields():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("site", "aggregator", "run", "demo", "synth", "budget"):
        assert sub.choices[name].description, name
    helps = {a.dest: a.help for a in sub.choices["budget"]._actions}
    for f in fields(RunConfig):
        if flag := f.metadata.get("flag"):
            dest = flag.replace("-", "_")
            assert f.name in helps[dest] and summary(f.name) in helps[dest]
            c = constraint(f.name)
            c = c.inner if isinstance(c, OrNone) else c
            if isinstance(c, StrOptions):
                action = next(a for a in sub.choices["budget"]._actions if a.dest == dest)
                assert tuple(action.choices) == c.options
