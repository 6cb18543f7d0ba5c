"""Splitting a total GDP budget over the releasing stages (:func:`dpneuro.privacy.split_gdp`)."""

import math

import numpy as np
import pytest

from dpneuro.privacy import split_gdp


def _totals(site_mu, before, after):
    """Each site's composed mu once every stage's multiplier goes from ``before`` to ``after`` (mu ~ 1 / z)."""
    return [math.sqrt(sum((m[st] * before[st] / after[st]) ** 2 for st in m)) for m in site_mu]


@pytest.mark.parametrize("seed", range(20))
def test_the_most_exposed_site_spends_the_target(seed):
    rng = np.random.default_rng(seed)
    stages = ["reduce", "unmix", "states"][: rng.integers(1, 4)]
    site_mu = [{st: float(rng.uniform(0.05, 3.0)) for st in stages} for _ in range(rng.integers(3, 7))]
    z = {st: float(rng.uniform(0.5, 20.0)) for st in stages}
    target = float(rng.uniform(0.1, 5.0))
    raw = rng.uniform(0.1, 1.0, len(stages))
    share = dict(zip(stages, raw / raw.sum())) if rng.integers(2) else None
    planned = split_gdp(site_mu, target, z, share)
    assert max(_totals(site_mu, z, planned)) == pytest.approx(target, rel=1e-12)


def test_equal_sites_get_the_shares_asked_for():
    site_mu, z = [{"reduce": 2.0, "unmix": 0.5}] * 4, {"reduce": 3.0, "unmix": 7.0}
    planned = split_gdp(site_mu, 1.0, z, {"reduce": 0.7, "unmix": 0.3})
    spent = {st: (site_mu[0][st] * z[st] / planned[st]) ** 2 for st in z}
    assert spent == pytest.approx({"reduce": 0.7, "unmix": 0.3}, rel=1e-12)


def test_by_default_every_stage_keeps_its_part():
    site_mu = [{"reduce": 3.0, "unmix": 4.0}, {"reduce": 1.5, "unmix": 2.0}]  # total 5 at the first site
    planned = split_gdp(site_mu, 2.5, {"reduce": 1.0, "unmix": 5.0})
    assert planned == pytest.approx({"reduce": 2.0, "unmix": 10.0}, rel=1e-12)  # both halved in mu


def test_stages_peaking_at_different_sites_spend_more_each():
    """No site takes the maximum of every stage, so each stage may have more than its share alone would give."""
    site_mu, z = [{"reduce": 1.0, "unmix": 0.1}, {"reduce": 0.1, "unmix": 1.0}], {"reduce": 1.0, "unmix": 1.0}
    planned = split_gdp(site_mu, 1.0, z, {"reduce": 0.5, "unmix": 0.5})
    assert max(_totals(site_mu, z, planned)) == pytest.approx(1.0, rel=1e-12)
    alone = {st: (max(m[st] for m in site_mu) * z[st] / planned[st]) ** 2 for st in z}
    assert all(v > 0.5 for v in alone.values())
