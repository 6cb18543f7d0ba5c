"""One route for a call: the path of ``DecentralizedICA(epsilon=...).fit()`` to each noise draw visits each module
once, and the planner builds each stage's algorithms once per configuration it plans."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from dataclasses import replace

import pytest

from dpneuro.config import RunConfig
from dpneuro.datasets.synth import make_consortium
from dpneuro.estimators import DecentralizedICA
from dpneuro.run import planner, stages
from dpneuro.run.planner import plan_for_target, site_shapes


def _frames(frame) -> list[tuple[str, str]]:
    """dpneuro's (module, function) frames on the stack of ``frame``, outermost first."""
    out = []
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if name.startswith("dpneuro."):
            out.append((name.removeprefix("dpneuro."), frame.f_code.co_name))
        frame = frame.f_back
    return out[::-1]


def _visits(frames: list[tuple[str, str]]) -> list[str]:
    """The modules a path visits, in order: one visit per run of consecutive frames in a module."""
    names = [m for m, _ in frames]
    return [m for i, m in enumerate(names) if i == 0 or names[i - 1] != m]


@pytest.fixture(scope="module")
def routes(tmp_path_factory):
    """Every distinct route to a noise draw in a 3-site fit with a total epsilon and static FNC: the caller's
    path to the in-process party runner, joined with the site thread's path from it."""
    tmp = tmp_path_factory.mktemp("route")
    m = make_consortium(tmp / "data", n_sites=3, subjects_per_site=6, n_components=3, n_timepoints=40,
                        space="grid30", random_state=0)
    est = DecentralizedICA(n_components=3, epsilon=8.0, fnc=True, mask=m["mask"], out=tmp / "out", random_state=0)
    caller: list[list[tuple[str, str]]] = []
    draws: set[tuple[tuple[str, str], ...]] = set()

    def profile(frame, event, arg):
        if event != "call":
            return
        name, fn = frame.f_globals.get("__name__"), frame.f_code.co_name
        if name == "dpneuro.protocol.simulation" and fn == "run_parties" and not caller:
            caller.append(_frames(frame))
        elif name == "dpneuro.privacy.noise" and fn == "gaussian":
            draws.add(tuple(_frames(frame)))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        est.fit({s["site"]: str(tmp / "data" / s["path"]) for s in m["sites"]})
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    head = caller[0][:-1]  # up to the party runner, which the site thread's path starts at
    return [head + list(d) for d in sorted(draws)]


def test_every_route_to_a_noise_draw_visits_each_module_once(routes):
    # the PCA's and the FNC's zero-sum and release draws
    assert len(routes) == 4
    assert {f for r in routes for m, f in r if m == "run.roles"} == {"reduce_site", "fnc_site"}
    for frames in routes:
        route = _visits(frames)
        assert [m for m, n in Counter(route).items() if n > 1] == [], " -> ".join(route)


def test_the_route_passes_the_layers_in_order(routes):
    for route in map(_visits, routes):
        assert route[0] == "estimators" and route[-1] == "privacy.noise"
        at = [route.index(m) for m in ("run.pipeline", "run.stages", "protocol.simulation", "run.roles",
                                       "protocol.driver", "protocol.cape.phases")]
        assert at == sorted(at), " -> ".join(route)


def test_a_plan_builds_each_stage_once_per_configuration(tmp_path, monkeypatch):
    """The planner predicts the ledgers and reads the budget settings from the same algorithms: built once for
    the configuration given and once for the one it plans."""
    cfg = RunConfig.from_dict({"sites": [{"name": f"s{i}", "path": str(tmp_path)} for i in range(3)],
                               "out": str(tmp_path / "o"), "n_components": 5, "ica": "temporal", "fnc": True})
    built = Counter()
    counted = tuple(replace(rel, algorithms=_counted(rel.algorithms, rel.name, built)) if rel.algorithms else rel
                    for rel in stages.RELEASES)
    monkeypatch.setattr(stages, "RELEASES", counted)
    monkeypatch.setattr(planner, "RELEASES", counted)
    shapes = site_shapes(cfg, subjects=10, timepoints=100)
    plan = plan_for_target(cfg, shapes, 60, 4.0)
    assert dict(built) == {"reduce": 2, "unmix": 2, "fnc": 2}
    assert max(plan.epsilon.values()) == pytest.approx(4.0, rel=1e-6)
    built.clear()
    planner.spend(cfg, shapes, 60)
    assert dict(built) == {"reduce": 1, "unmix": 1, "fnc": 1}


def _counted(fn, name, counter):
    def wrapped(cfg, dim):
        counter[name] += 1
        return fn(cfg, dim)
    return wrapped
