"""Stage timings: one name per stage a run performs, the same in a simulation and in a deployment.

A simulation (:mod:`dpneuro.run.pipeline`) and the deployed parties
(:mod:`dpneuro.deploy.party`) time the same stages and label them with the
functions here, so ``run.json``, the CLI summary and every report name a stage
the same way, after the algorithm that actually ran (PD-SVD is not capePCA;
the cumulant unmixing is not capeDJICA).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping

from dpneuro.config import RunConfig

__all__ = ["reduction_name", "unmixing_name", "label", "timed", "total", "lines"]

_REDUCTIONS = {"capepca": "capePCA", "capepca-power": "capePCA, power iterations", "none": "PCA without noise",
               "pdsvd": "PD-SVD"}


def reduction_name(cfg: RunConfig) -> str:
    """The reduction that ran: capePCA (one release or power iterations), the PCA without noise, or PD-SVD."""
    name = _REDUCTIONS[cfg.reduction]
    if cfg.reduction.startswith("capepca") and cfg.plan == "none":
        return name + ", plan none: no noise"
    return name


def unmixing_name(cfg: RunConfig) -> str:
    """The unmixing that ran: spatial ICA of the released basis, capeDJICA rounds, or the cumulant ICA."""
    if cfg.ica == "spatial":
        return "spatial ICA"
    return "cumulant ICA" if cfg.cumulant_unmixing else "capeDJICA"


def label(cfg: RunConfig, stage: str, site: str = "") -> str:
    """The name of ``stage`` (at ``site`` for the per-site stages) in every timings table.

    Stages: ``space`` (mask and features), ``load``, ``reduce``, ``unmix``,
    ``fnc`` (static FNC), ``states`` (dFNC brain states), ``summary`` (a deployment's closing exchange),
    ``maps`` (the consortium's maps and privacy record), ``timecourses``,
    ``site_maps`` (a site's own voxel maps), ``occupancy`` (a site's
    brain-state dynamics) and ``report``.
    """
    at = f" {site}" if site else ""
    names = {
        "space": "space (mask, features)",
        "load": f"load{at}",
        "reduce": f"reduce ({reduction_name(cfg)})",
        "unmix": f"unmix ({unmixing_name(cfg)})",
        "fnc": "static FNC",
        "glm": "group statistics",
        "states": "brain states (dFNC)",
        "summary": "summary (ledgers in, unmixing out)",
        "maps": "maps and privacy record",
        "timecourses": f"time courses{at}",
        "site_maps": f"site voxel maps{at}",
        "occupancy": f"brain-state dynamics{at}",
        "report": "report (figures, HTML)",
    }
    return names.get(stage, f"{stage}{at}")  # a stage without a longer name goes by its own


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall time of the ``with`` block to ``timings[name]`` (seconds)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0


def total(timings: Mapping[str, float]) -> float:
    return float(sum(float(v) for v in timings.values()))


def lines(timings: Mapping[str, float]) -> list[str]:
    """One aligned line per stage and the total, for a terminal."""
    if not timings:
        return []
    width = max(len(k) for k in timings)
    rows = [f"{k:<{width}}  {float(v):8.1f} s" for k, v in timings.items()]
    return rows + [f"{'total':<{width}}  {total(timings):8.1f} s"]
