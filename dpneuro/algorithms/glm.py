"""Private group statistics: every measure's linear model, fitted from CAPE-released sufficient statistics.

The consortium asks whether its subjects differ (patients against controls, an
age slope) on what the run measured per subject: the static FNC edges and each
component's amplitude. No site shares a subject's numbers. Per subject, at its
site: covariates x (C columns) and measures y (Q values). The model of measure
q has an intercept per site: y_q = alpha_{q,site} + x' beta_q + e, so every
effect is a within-site one and a site's offset never enters it.

Privacy (docs/privacy.md, "Group statistics"): each entry of x is in [-1, 1]
(a level of a categorical covariate as +1 at the level and -1 elsewhere, so its
square is the public count; a continuous covariate mapped from its public
range; values outside are clipped and counted), so ||x|| <= sqrt(C); each
family of measures is scaled onto a public L2 bound (:data:`FAMILY_RMS` times
the square root of its size), so ||y|| <= B_y. A subject contributes five
blocks (:data:`BLOCKS`): its site's slot of x and of y (the per-site sums the
site intercepts need), the private entries of x x', x y', and each family's
||y||^2, each scaled onto a share a_k of a unit norm (:data:`SHARES`), so
||t|| <= 1 whatever its data, and site s releases the mean of its subjects' t
(:class:`CapeGLM`): sensitivity 2 / M_s under replacement. The aggregator's
CAPE-weighted mean times N holds the sums, each with public Gaussian noise.

Inference (:func:`fit_glm`) is post-processing of the release. The within-site
moments (X'X less each site's n_s xbar xbar', X'Y less n_s xbar ybar') are
unbiased under the noise (a product of two released sums has independent
noises; a square loses its noise's variance), so the least-squares estimate is
unbiased to second order in the noise, and a design the budget resolves is
never shrunk. Its standard error adds the sampling variance (from each family's
pooled residual variance) and the privacy noise's variance (the delta method on
the release's public noise, every product of sums in it estimated without
bias); intervals and p-values are t's with N - S - C degrees of freedom,
q-values Benjamini-Hochberg within each contrast
(``scipy.stats.false_discovery_control``). :func:`detectable_effect` gives the
same standard error before the run, from public quantities only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from dpneuro import privacy
from dpneuro.algorithms.dfnc import noise_multipliers
from dpneuro.algorithms.fnc import subject_fnc
from dpneuro.algorithms.subject_mean import CapeSubjectMean, clip_subjects
from dpneuro.data.networks import REGIONS
from dpneuro.privacy import PrivacyLedger
from dpneuro.protocol.cape import NoisePlan, planned_ledgers, run_cape
from dpneuro.protocol.cape import ledgers as cape_ledgers

__all__ = ["BLOCKS", "CapeGLM", "Covariate", "Design", "FAMILY_RMS", "GLMSettings", "MEASURES", "REFERENCE_SD",
           "SHARES", "WEAK_DESIGN", "bh_power", "contrast_errors", "detectable", "fit_glm", "kind", "measure_names",
           "network_pairs", "normal_hypothesis", "pack_statistics", "parse_design", "subject_measures",
           "unpack_statistics"]

#: the measures a site computes per subject from its component time courses
MEASURES = ("fnc", "amplitude", "states", "networks")
#: each family's public L2 bound is FAMILY_RMS sqrt(its size): an RMS of 0.3 per entry of the subject's deviation
#: from the consortium's mean FNC (Fisher z), of its relative log amplitudes and of its brain-state dynamics
#: (fractions)
FAMILY_RMS = {"fnc": 0.3, "amplitude": 0.3, "states": 0.3, "networks": 0.3}
#: shares a_k^2 of a subject's unit norm (:data:`BLOCKS`): most to the covariate x measure products, which carry
#: the effects; the per-site sums (the site intercepts), the covariates' products and the squares (the residual
#: variance) need little (benchmarks/group_stats.py measures the split)
SHARES = {"x": 0.1, "y": 0.25, "xx": 0.06, "xy": 0.5, "yy": 0.09}
#: a direction of the within-site X'X less than WEAK_DESIGN times its noise's spectral norm is held there (its
#: effects shrunk, and said): a design the budget cannot resolve. With +-1 level codes and site intercepts the
#: within-site X'X is of the order of N and its noise of a few units, so a consortium of tens of subjects per site
#: is far above it
WEAK_DESIGN = 2.0
#: a contrast whose column puts more than this share of its weight on a held direction is unresolved: its q is
#: NaN (no finding). On 4 pseudo-sites of 8-9 real people every direction is held and the shared design noise
#: made a discovery in 0.11 of null draws per contrast where q was kept (benchmarks/group_stats.py, part real)
UNRESOLVED_LOADING = 0.1


# -- the design ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Covariate:
    """One term of the design: categorical (``levels``, the first the reference; a column per other level, +1 at
    that level and -1 elsewhere, so its square is public) or continuous (public range ``low``..``high``, mapped
    onto [-1, 1])."""

    name: str
    levels: tuple[str, ...] = ()
    low: float = 0.0
    high: float = 0.0

    @property
    def categorical(self) -> bool:
        return bool(self.levels)

    def columns(self) -> list[str]:
        return [f"{self.name}[{lv}]" for lv in self.levels[1:]] if self.categorical else [self.name]

    def encode(self, value: str) -> tuple[list[float], bool]:
        """This covariate's columns for one subject's value, and whether a continuous value was clipped."""
        if self.categorical:
            if value not in self.levels:
                raise ValueError(f"{self.name} = {value!r} is not one of the agreed levels {list(self.levels)}")
            return [1.0 if value == lv else -1.0 for lv in self.levels[1:]], False
        v = float(value)
        if not math.isfinite(v):
            raise ValueError(f"{self.name} = {value!r} is not a number")
        mid, half = (self.low + self.high) / 2, (self.high - self.low) / 2
        u = (v - mid) / half
        return [min(1.0, max(-1.0, u))], abs(u) > 1.0

    def per_unit(self) -> float:
        """Factor from a coefficient of the encoded column to one per unit of the covariate (a level's column
        spans 2 from the reference to the level)."""
        return 2.0 if self.categorical else 2.0 / (self.high - self.low)


def parse_design(design: str, covariates: Mapping[str, Any]) -> tuple[Covariate, ...]:
    """The terms of ``design`` ("group + age + sex"), each described in ``covariates``: a list of level names
    (categorical, the first the reference) or [low, high] (continuous, its public range)."""
    names = [t.strip() for t in design.split("+") if t.strip()]
    if not names:
        raise ValueError("the design names no covariate; e.g. design = \"group + age\"")
    if len(set(names)) != len(names):
        raise ValueError(f"design {design!r} names a covariate twice")
    out = []
    for name in names:
        if name == "site":
            raise ValueError("the site is always in the model as a covariate of its own: leave it out of the design")
        spec = covariates.get(name)
        if spec is None:
            raise ValueError(f"design term {name!r} has no entry in covariates: give its levels "
                             f"(e.g. {name} = [\"control\", \"patient\"]) or its public range (e.g. {name} = [18, 80])")
        spec = list(spec)
        if len(spec) >= 2 and all(isinstance(v, str) for v in spec):
            if len(set(spec)) != len(spec):
                raise ValueError(f"covariate {name!r}: its levels repeat: {spec}")
            out.append(Covariate(name, levels=tuple(spec)))
        elif (len(spec) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in spec)
              and math.isfinite(spec[0]) and math.isfinite(spec[1]) and spec[0] < spec[1]):
            out.append(Covariate(name, low=float(spec[0]), high=float(spec[1])))
        else:
            raise ValueError(f"covariate {name!r}: {spec!r} is neither two or more level names nor a range "
                             "[low, high] with low < high")
    return tuple(out)


@dataclass(frozen=True)
class Design:
    """The consortium's design: its covariates' columns (each in [-1, 1]) and one intercept per site.

    A design row (:meth:`rows`) is the covariate columns followed by a one-hot of the subject's site. The model
    of every measure has a free intercept per site, so the covariates' effects are the within-site ones (the
    site's offset, from scanner or population, never leaks into a group difference), and the model never needs
    a site's shares of its covariates made public.
    """

    covariates: tuple[Covariate, ...]
    sites: tuple[str, ...]

    @property
    def covariate_columns(self) -> tuple[str, ...]:
        return tuple(c for cov in self.covariates for c in cov.columns())

    @property
    def n_covariates(self) -> int:
        """C: the covariate columns (a level's +-1 code or a continuous covariate)."""
        return len(self.covariate_columns)

    @property
    def columns(self) -> tuple[str, ...]:
        return (*self.covariate_columns, *(f"site[{s}]" for s in self.sites))

    @property
    def p(self) -> int:
        """Coefficients of each measure's model (and the width of a design row): C slopes and S site intercepts."""
        return len(self.columns)

    @property
    def norm_bound(self) -> float:
        """B_x: the covariate part of a design row, C entries in [-1, 1]."""
        return math.sqrt(self.n_covariates)

    @property
    def indicators(self) -> list[int]:
        """The covariate columns of categorical levels (+-1: each squares to 1, so their diagonal of X'X is the
        public subject count)."""
        out, j = [], 0
        for cov in self.covariates:
            n = len(cov.columns())
            if cov.categorical:
                out += range(j, j + n)
            j += n
        return out

    @property
    def private_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The entries (i <= j) of the covariates' X'X a site releases: all but a level's square (always 1)."""
        i, j = np.triu_indices(self.n_covariates)
        keep = ~((i == j) & np.isin(i, self.indicators))
        return i[keep], j[keep]

    @property
    def moment_bound(self) -> float:
        """The L2 bound of a subject's released entries of x x' (:attr:`private_pairs`, each in [-1, 1])."""
        return math.sqrt(len(self.private_pairs[0]))

    def contrasts(self) -> list[tuple[str, int, float]]:
        """What is tested: each covariate's columns, as (label, column, factor to per unit)."""
        out, j = [], 0
        for cov in self.covariates:
            for col in cov.columns():
                label = (f"{cov.name}: {col[len(cov.name) + 1:-1]} vs {cov.levels[0]}" if cov.categorical
                         else f"{cov.name} (per unit)")
                out.append((label, j, cov.per_unit()))
                j += 1
        return out

    def rows(self, values: Sequence[Mapping[str, str]], site: int) -> tuple[np.ndarray, int]:
        """The design rows of a site's subjects (their covariates by name; ``site`` its index in
        :attr:`sites`) and how many values were clipped."""
        if not 0 <= site < len(self.sites):
            raise ValueError(f"site index {site} is not one of the design's {len(self.sites)} sites")
        X = np.zeros((len(values), self.p))
        clipped = 0
        for i, v in enumerate(values):
            row = []
            for cov in self.covariates:
                enc, cut = cov.encode(v[cov.name])
                row += enc
                clipped += cut
            X[i, :len(row)] = row
            X[i, len(row) + site] = 1.0
        return X, clipped


# -- the measures -------------------------------------------------------------------------------

def network_pairs(networks: Sequence[str] | None) -> list[tuple[str, list[tuple[int, int]]]]:
    """The network-level FNC measures of components labelled ``networks`` (one atlas network per component,
    :func:`dpneuro.run.naming.component_networks`): for every two networks (in the atlas's order) the component
    pairs between them, and for a network of two or more components the pairs within it; components labelled
    noise, unnamed or outside grey matter ("Other") are in none. Each as ("networks A-B", pairs i < j)."""
    if networks is None:
        return []
    order = {n: k for k, n in enumerate(REGIONS)}
    members: dict[str, list[int]] = {}
    for i, net in enumerate(networks):
        if net in order and net != "Other":
            members.setdefault(net, []).append(i)
    nets = sorted(members, key=order.__getitem__)
    out = []
    for x, a in enumerate(nets):
        for b in nets[x:]:
            pairs = sorted((min(i, j), max(i, j)) for i in members[a] for j in members[b] if i != j)
            pairs = sorted(set(pairs))
            if pairs:
                out.append((f"networks {a}-{b}", pairs))
    return out


def measure_names(measures: Sequence[str], n_components: int, n_states: int = 0,
                  networks: Sequence[str] | None = None) -> list[str]:
    """Each measure's name, in the order of :func:`subject_measures`: "fnc IC01-IC02", "amplitude IC03",
    "occupancy S1", "dwell S1", "transitions", "networks Default-Default" (:func:`network_pairs`)."""
    iu = np.triu_indices(n_components, 1)
    names = {"fnc": [f"fnc IC{i + 1:02d}-IC{j + 1:02d}" for i, j in zip(*iu)],
             "amplitude": [f"amplitude IC{i + 1:02d}" for i in range(n_components)],
             "states": [*(f"occupancy S{k + 1}" for k in range(n_states)),
                        *(f"dwell S{k + 1}" for k in range(n_states)), "transitions"],
             "networks": [name for name, _ in network_pairs(networks)]}
    return [n for m in measures for n in names[m]]


def family_sizes(measures: Sequence[str], n_components: int, n_states: int = 0,
                 networks: Sequence[str] | None = None) -> dict[str, slice]:
    """Each family's columns among the measures."""
    out, at = {}, 0
    for m in measures:
        if m not in MEASURES:
            raise ValueError(f"unknown measure {m!r}; measures: {list(MEASURES)}")
        size = {"fnc": n_components * (n_components - 1) // 2, "amplitude": n_components,
                "states": 2 * n_states + 1, "networks": len(network_pairs(networks))}[m]
        out[m] = slice(at, at + size)
        at += size
    return out


def kind(name: str) -> str:
    """The family a measure or a hypothesis belongs to ("fnc IC01-IC02" -> "fnc"; "occupancy S1" -> "states")."""
    first = name.split()[0]
    return "states" if first in ("occupancy", "dwell", "transitions") else first


def subject_measures(S, lengths: Sequence[int], measures: Sequence[str], fnc_centre=None,
                     dynamics: Mapping[str, np.ndarray] | None = None, networks: Sequence[str] | None = None
                     ) -> tuple[np.ndarray, list[str], dict[str, slice]]:
    """Every subject's measures (M x Q) from a site's component time courses S (R x N, subjects in order): the
    FNC edges (Fisher z, minus the consortium's public mean ``fnc_centre`` when known), each component's
    relative log amplitude (log of its time course's sd over the RMS of the subject's components' sds), from
    its brain-state ``dynamics`` (:func:`dpneuro.algorithms.dfnc.site_dynamics` with ``n_windows``, each
    subject's window count) each state's fraction of time less 1/K, its mean dwell as a fraction of the
    subject's windows, and the transitions per window, and the network-level FNC (the mean of the centred edges
    between two networks, :func:`network_pairs` of the components' ``networks``). Returns the matrix, each
    measure's name (:func:`measure_names`) and each family's columns."""
    S = np.asarray(S, np.float64)
    R = S.shape[0]
    bounds = np.cumsum([0, *[int(n) for n in lengths]])
    if bounds[-1] != S.shape[1]:
        raise ValueError(f"the subjects' lengths sum to {bounds[-1]}, the time courses have {S.shape[1]} columns")
    K = 0 if dynamics is None else int(np.shape(dynamics["occupancy"])[1])
    families = family_sizes(measures, R, K, networks)
    edges = None
    if {"fnc", "networks"} & set(measures):
        F = np.array([subject_fnc(S[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]).reshape(len(lengths), -1)
        edges = F if fnc_centre is None else F - np.asarray(fnc_centre, np.float64)[None, :]
    blocks = []
    for m in measures:
        if m == "fnc":
            block = edges
        elif m == "networks":
            index = {(int(i), int(j)): k for k, (i, j) in enumerate(zip(*np.triu_indices(R, 1)))}
            block = np.zeros((len(lengths), 0)) if not network_pairs(networks) else np.stack(
                [edges[:, [index[p] for p in pairs]].mean(axis=1) for _, pairs in network_pairs(networks)], axis=1)
        elif m == "amplitude":
            # relative to the subject's own RMS over components: the time courses' scale follows the public
            # whitening, and a subject's overall gain (scanner, head size) is not a component's amplitude
            sd = np.maximum(np.array([S[:, a:b].std(axis=1) for a, b in zip(bounds[:-1], bounds[1:])]), 1e-300)
            block = np.log(sd / np.sqrt((sd**2).mean(axis=1, keepdims=True)))
        else:
            if dynamics is None:
                raise ValueError("the states measures need the subjects' brain-state dynamics")
            n = np.asarray(dynamics["n_windows"], np.float64)[:, None]
            block = np.hstack([np.asarray(dynamics["occupancy"]) - 1.0 / K,
                               np.asarray(dynamics["dwell_windows"]) / n,
                               np.asarray(dynamics["transitions"], np.float64)[:, None] / np.maximum(n - 1, 1)])
        blocks.append(block)
    return np.concatenate(blocks, axis=1), measure_names(measures, R, K, networks), families


def normal_hypothesis(name: str, n_components: int | None = None) -> str:
    """A hypothesis's measure name in :func:`measure_names`'s spelling ("fnc IC03-IC01" -> "fnc IC01-IC03",
    "networks Default-Vis" -> "networks Vis-Default", the atlas's order), or ValueError naming what is wrong."""
    parts = str(name).split()
    example = ('e.g. "networks Vis-Default" (atlas networks: ' + ", ".join(REGIONS[:-1])
               + '), "fnc IC01-IC02" or "amplitude IC03"')
    if not parts or kind(parts[0]) not in MEASURES or (parts[0] != "transitions" and len(parts) != 2):
        raise ValueError(f"{name!r} is not a measure; {example}")
    if parts[0] == "transitions":
        return "transitions"
    what, which = parts

    def component(text: str) -> int:
        if not (text.startswith("IC") and text[2:].isdigit() and int(text[2:]) >= 1
                and (n_components is None or int(text[2:]) <= n_components)):
            raise ValueError(f"{name!r}: {text!r} is not a component IC01..IC{n_components or 'R':02}")
        return int(text[2:])

    if what == "networks":
        a, _, b = which.partition("-")
        order = {n: k for k, n in enumerate(REGIONS[:-1])}
        if a not in order or b not in order:
            raise ValueError(f"{name!r}: networks are named by the atlas's abbreviations; {example}")
        a, b = sorted((a, b), key=order.__getitem__)
        return f"networks {a}-{b}"
    if what == "fnc":
        a, _, b = which.partition("-")
        i, j = sorted((component(a), component(b)))
        if i == j:
            raise ValueError(f"{name!r}: an edge joins two different components")
        return f"fnc IC{i:02d}-IC{j:02d}"
    if what == "amplitude":
        return f"amplitude IC{component(which):02d}"
    if not (which.startswith("S") and which[1:].isdigit() and int(which[1:]) >= 1):
        raise ValueError(f"{name!r}: {which!r} is not a brain state S1, S2, ...")
    return f"{what} {which}"


def family_bounds(families: Mapping[str, slice]) -> dict[str, float]:
    """Each family's public L2 bound per subject (a hypothesis is a family of its own: its kind's RMS)."""
    return {m: FAMILY_RMS[kind(m)] * math.sqrt(sl.stop - sl.start) for m, sl in families.items()}


# -- sufficient statistics, packed with a subject's norm at most 1 -------------------------------

#: the blocks of a subject's contribution, in the order packed: its site's slot of the covariates' and of the
#: measures' sums, the covariates' private products, the covariate x measure products, each family's sum of
#: squares
BLOCKS = ("x", "y", "xx", "xy", "yy")


def _bounds(design: Design, families: Mapping[str, slice]) -> dict[str, float]:
    """Each block's L2 bound per subject."""
    fam = family_bounds(families)
    bx, by = design.norm_bound, math.sqrt(sum(b**2 for b in fam.values()))
    return {"x": bx, "y": by, "xx": design.moment_bound, "xy": bx * by,
            "yy": math.sqrt(sum(b**4 for b in fam.values()))}


def _sizes(design: Design, families: Mapping[str, slice]) -> dict[str, int]:
    S, C = len(design.sites), design.n_covariates
    Q = sum(sl.stop - sl.start for sl in families.values())
    return {"x": S * C, "y": S * Q, "xx": len(design.private_pairs[0]), "xy": C * Q, "yy": len(families)}


def _scales(design: Design, families: Mapping[str, slice]) -> dict[str, float]:
    """Each block's factor a_k / B_k: a block's share a_k^2 of a subject's unit norm (:data:`SHARES`, over the
    blocks the design has) over its bound."""
    sizes = _sizes(design, families)
    total = sum(SHARES[k] for k in BLOCKS if sizes[k])
    return {k: math.sqrt(SHARES[k] / total) / b if sizes[k] else 0.0 for k, b in _bounds(design, families).items()}


def statistics_length(design: Design, families: Mapping[str, slice]) -> int:
    return sum(_sizes(design, families).values())


def pack_statistics(X: np.ndarray, Y: np.ndarray, design: Design, families: Mapping[str, slice]
                    ) -> tuple[np.ndarray, int]:
    """Every subject's contribution t (M x L, each of L2 norm at most 1) from its design row (:meth:`Design.rows`)
    and measures, and how many subjects' measures were scaled onto their bound."""
    bounds = family_bounds(families)
    X, Y = np.asarray(X, np.float64), np.array(Y, np.float64)
    scaled = np.zeros(len(Y), bool)
    for m, sl in families.items():
        Y[:, sl], cut = clip_subjects(Y[:, sl], bounds[m])
        scaled |= cut
    C = design.n_covariates
    x, h = X[:, :C], X[:, C:]  # covariates; the site's one-hot
    c = _scales(design, families)
    i, j = design.private_pairs
    blocks = {"x": (h[:, :, None] * x[:, None, :]).reshape(len(X), -1),
              "y": (h[:, :, None] * Y[:, None, :]).reshape(len(X), -1),
              "xx": x[:, i] * x[:, j],
              "xy": (x[:, :, None] * Y[:, None, :]).reshape(len(X), -1),
              "yy": np.stack([(Y[:, sl] ** 2).sum(axis=1) for sl in families.values()], axis=1)}
    return np.concatenate([c[k] * blocks[k] for k in BLOCKS], axis=1), int(scaled.sum())


def unpack_statistics(mean, counts: Sequence[float], noise_var: float, design: Design,
                      families: Mapping[str, slice]) -> dict[str, Any]:
    """The consortium's sums from its mean contribution over the sites' subjects (``counts``, public): per site
    the covariates' and the measures' sums (``Sx`` S x C, ``Sy`` S x Q), the covariates' X'X (``XX``, the
    levels' diagonal the public count), X'Y (``XY``, C x Q) and each family's sum of squares (``YY``); with each
    block's noise sd (``sd``, public: from the plan's per-entry variance of the mean)."""
    S, C = len(design.sites), design.n_covariates
    Q = sum(sl.stop - sl.start for sl in families.values())
    counts = np.asarray(counts, np.float64)
    if counts.shape != (S,):
        raise ValueError(f"{counts.size} site counts for a design of {S} sites")
    n = float(counts.sum())
    c = _scales(design, families)
    sizes = _sizes(design, families)
    total = np.asarray(mean, np.float64) * n
    if total.shape != (sum(sizes.values()),):
        raise ValueError(f"the release has {total.shape} entries, the design and measures need {sum(sizes.values())}")
    parts, at = {}, 0
    for k in BLOCKS:
        parts[k] = total[at:at + sizes[k]] / c[k] if sizes[k] else total[at:at]
        at += sizes[k]
    XX = np.zeros((C, C))
    i, j = design.private_pairs
    XX[i, j] = XX[j, i] = parts["xx"]
    for g in design.indicators:
        XX[g, g] = n
    sd = n * math.sqrt(noise_var)
    return {"Sx": parts["x"].reshape(S, C), "Sy": parts["y"].reshape(S, Q), "XX": XX,
            "XY": parts["xy"].reshape(C, Q), "YY": parts["yy"], "counts": counts, "n": n,
            "sd": {k: sd / c[k] if sizes[k] else 0.0 for k in BLOCKS}}


# -- inference ----------------------------------------------------------------------------------

def _within_site(st: Mapping[str, Any], noise_x: float) -> tuple[np.ndarray, np.ndarray]:
    """The covariates' within-site moments X~'X~ (C x C) and X~'Y (C x Q) from the sums (arrays may carry a
    leading batch axis): X'X minus each site's n_s xbar xbar', with the noise's own square (``noise_x``^2 per
    entry of a site's sums, public) taken out so the estimate is unbiased; X'Y minus n_s xbar ybar', whose two
    factors' noises are independent."""
    counts = np.asarray(st["counts"], np.float64)
    live = counts > 0
    Sx, Sy = np.asarray(st["Sx"])[..., live, :], np.asarray(st["Sy"])[..., live, :]
    w = 1.0 / counts[live]
    C = Sx.shape[-1]
    A = np.asarray(st["XX"]) - np.einsum("...sc,...sd,s->...cd", Sx, Sx, w) + noise_x**2 * w.sum() * np.eye(C)
    B = np.asarray(st["XY"]) - np.einsum("...sc,...sq,s->...cq", Sx, Sy, w)
    return A, B


def _residual_variance(st: Mapping[str, Any], beta: np.ndarray, B: np.ndarray, df: float,
                       families: Mapping[str, slice]) -> np.ndarray:
    """Each measure's residual variance (Q): its family's, pooled over the family's measures (one released sum of
    squares per family: its noise is a fraction of what it estimates where a sum per measure would drown).

    The family's residual sum of squares is its sum of squares less the fitted effects and the sites' means.
    The sites' part (from the noisy per-site sums) is taken out only as far as its noise allows: its unbiased
    estimate less two of its sd, never below zero. So the variance is never understated by the noise; while the
    noise leaves the sites' offsets in, it is overstated by their spread, a conservative error in a part of the
    interval the privacy noise dominates."""
    counts = np.asarray(st["counts"], np.float64)
    live = counts > 0
    sd_y, sd_yy = st["sd"]["y"], st["sd"]["yy"]
    Sy, n_s = np.asarray(st["Sy"])[live], counts[live][:, None]
    fitted = np.einsum("cq,cq->q", beta, B)
    out = np.empty(B.shape[1])
    for f, sl in enumerate(families.values()):
        between = float(((Sy[:, sl] ** 2 - sd_y**2) / n_s).sum())
        sd_between = math.sqrt(float((2 * sd_y**4 / n_s**2 + 4 * sd_y**2 * np.maximum(Sy[:, sl] ** 2 - sd_y**2, 0)
                                      / n_s**2).sum()))
        rss = float(np.asarray(st["YY"])[f]) - max(0.0, between - 2 * sd_between) - float(fitted[sl].sum())
        dof = df * (sl.stop - sl.start)
        out[sl] = max(rss, sd_yy + 1e-300) / dof  # below its own noise: held at the noise, not at zero
    return out


def _noise_covariance(st: Mapping[str, Any], beta: np.ndarray, design: Design) -> np.ndarray:
    """The privacy noise's covariance (Q x C x C) of X~'Y - X~'X~ beta for each measure's column, to first order
    in the noise (the delta method: the estimate's noise is A^-1 times it). Every product of released sums in it is
    replaced by its unbiased estimate (a square less the noise's variance), so the noise's spread is not judged at
    a point the noise itself inflated."""
    counts = np.asarray(st["counts"], np.float64)
    live = counts > 0
    sd = st["sd"]
    tx, ty = sd["x"] ** 2, sd["y"] ** 2
    Sx, Sy, n = np.asarray(st["Sx"])[live], np.asarray(st["Sy"])[live], counts[live]
    C, Q = beta.shape
    eye = np.eye(C)
    cov = np.broadcast_to(sd["xy"] ** 2 * eye, (Q, C, C)).copy()
    # the per-site covariate sums' noise, times the measures' sums, and the measures' sums' noise, times theirs
    xx = np.einsum("sc,sd,s->cd", Sx, Sx, 1 / n**2) - tx * (1 / n**2).sum() * eye
    cov += ty * xx + tx * ty * (1 / n**2).sum() * eye
    # e_x enters X~'Y through -e_x Sy' and X~'X~ beta through Sx (e_x . beta) + e_x (Sx . beta): M_s e_x, with
    # M_s = (Sx . beta - Sy) I + Sx beta'
    a = np.einsum("sc,cq->sq", Sx, beta) - Sy  # S x Q
    bb = (beta**2).sum(axis=0)  # Q
    w = 1 / n**2
    a2 = np.einsum("sq,s->q", a**2, w) - (tx * bb + ty) * w.sum()
    aSx = np.einsum("sq,sc,s->qc", a, Sx, w) - tx * w.sum() * beta.T
    SxSx = np.einsum("sc,sd,s->cd", Sx, Sx, w) - tx * w.sum() * eye
    MM = (a2[:, None, None] * eye + np.einsum("qc,dq->qcd", aSx, beta) + np.einsum("cq,qd->qcd", beta, aSx)
          + bb[:, None, None] * SxSx[None])
    cov += tx * MM
    # the covariates' own products: each private pair's noise moves both of its rows
    i, j = design.private_pairs
    G = np.zeros((len(i), C, Q))
    G[np.arange(len(i)), i] += beta[j]
    off = i != j
    G[np.arange(len(i))[off], j[off]] += beta[i[off]]
    cov += sd["xx"] ** 2 * np.einsum("pcq,pdq->qcd", G, G)
    w_, V = np.linalg.eigh(cov)  # the unbiased plug-ins can leave a small negative direction
    return np.einsum("qij,qj,qkj->qik", V, np.maximum(w_, 0.0), V)


def _solve(A: np.ndarray, B: np.ndarray, floor: float) -> np.ndarray:
    """A^-1 B for symmetric A (..., C, C), each eigenvalue held at least ``floor``."""
    w, V = np.linalg.eigh(A)
    return np.einsum("...ij,...j,...kj,...kq->...iq", V, 1.0 / np.maximum(w, floor), V, B)


def fit_glm(stats_: Mapping[str, Any], design: Design, families: Mapping[str, slice] | None = None, *,
            level: float = 0.95, random_state=None) -> dict[str, np.ndarray]:
    """Each tested contrast's estimate on every measure, with its interval, p- and q-value.

    ``stats_``: :func:`unpack_statistics` (noise sd 0 for exact statistics: then this is OLS with site
    intercepts). ``families``: each family's measures (their residual variance is pooled within it); default,
    one family. The estimate is the within-site least-squares solution of the released statistics, each of its
    terms unbiased under the noise; the privacy noise's share of its variance is the delta method's
    (:func:`_noise_covariance`, from the release's public noise), the sampling share OLS's from the residual
    variance; ``random_state`` seeds the draws that measure the design's noise. Intervals and p-values are t's
    with N - S - C degrees of freedom, q-values Benjamini-Hochberg within each contrast. Returns arrays C x Q:
    ``estimate``, ``se``, ``ci_low``, ``ci_high``, ``p``, ``q`` and
    ``noise_sd`` (the part of the sd the privacy noise adds); ``sigma`` (Q: each measure's residual sd),
    ``design_snr`` (the smallest eigenvalue of the within-site X'X over its noise's spectral norm; inf without
    noise) and ``floored`` (its directions below :data:`WEAK_DESIGN` times the noise: held there, their effects
    shrunk; 0 in a design the budget resolves).
    """
    N, C = float(stats_["n"]), design.n_covariates
    counts = np.asarray(stats_["counts"], np.float64)
    S = int((counts > 0).sum())
    Q = np.shape(stats_["XY"])[1]
    families = families or {"all": slice(0, Q)}
    df = N - S - C
    if df < 2:
        raise ValueError(f"{N:g} subjects cannot fit {S + C} coefficients")
    sd = stats_["sd"]
    A, B = _within_site(stats_, sd["x"])
    floor, spectral = 1e-9 * N, 0.0
    if sd["x"] > 0 or sd["xx"] > 0:  # the within-site X'X's noise: its typical spectral norm
        rng = np.random.default_rng(random_state)
        E = _within_site({"counts": counts, "Sx": stats_["Sx"] + rng.normal(0, sd["x"], (200, *np.shape(stats_["Sx"]))),
                          "Sy": np.zeros((200, *np.shape(stats_["Sy"]))),
                          "XX": stats_["XX"] + _moment_noise(rng, 200, design, sd["xx"]), "XY": stats_["XY"]},
                         sd["x"])[0] - A
        spectral = float(np.median(np.abs(np.linalg.eigvalsh(E)).max(axis=-1)))
        floor = max(floor, WEAK_DESIGN * spectral)
    w, V = np.linalg.eigh(A)
    snr = float(w.min() / spectral) if spectral > 0 else math.inf
    floored = int(np.sum(w < floor))
    # a contrast that loads on a direction the noise drowns is no finding: its errors are shared by every measure
    # (the design's noise moves them together), which no per-test interval can hold to the FDR
    unresolved = (V[:, w < floor] ** 2).sum(axis=1) > UNRESOLVED_LOADING
    beta = _solve(A, B, floor)
    A_inv = _solve(A, np.eye(C), floor)
    sigma2 = _residual_variance(stats_, beta, B, df, families)
    noise_var = np.einsum("ci,qij,cj->cq", A_inv, _noise_covariance(stats_, beta, design), A_inv)
    unit = np.array([u for _, _, u in design.contrasts()])[:, None]
    est = beta * unit
    se = np.sqrt(np.outer(np.diag(A_inv), sigma2) + noise_var) * unit
    half = stats.t.ppf(0.5 + level / 2, df=df) * se
    t = np.divide(est, se, out=np.zeros_like(est), where=se > 0)
    pval = 2 * stats.t.sf(np.abs(t), df=df)
    q = np.array([stats.false_discovery_control(row, method="bh") for row in pval])
    q[unresolved] = np.nan
    return {"estimate": est, "se": se, "ci_low": est - half, "ci_high": est + half, "p": pval, "q": q,
            "noise_sd": np.sqrt(noise_var) * unit, "sigma": np.sqrt(sigma2), "design_snr": snr,
            "floored": floored, "unresolved": unresolved, "df": df}


def _moment_noise(rng, size: int, design: Design, sd: float) -> np.ndarray:
    """Noise as the release puts it on the covariates' X'X: on the released entries, symmetric."""
    C = design.n_covariates
    E = np.zeros((size, C, C))
    i, j = design.private_pairs
    E[:, i, j] = rng.normal(0.0, sd, (size, len(i)))
    E[:, j, i] = E[:, i, j]
    return E


# -- what a design can detect, before the run -------------------------------------------------------

#: residual sd per family a plan assumes when the consortium gives none: between-subject sd of a measure after its
#: site's mean and the covariates (Fisher z for FNC edges at about 150 volumes, log amplitude, state fractions)
REFERENCE_SD = {"fnc": 0.15, "amplitude": 0.12, "states": 0.1, "networks": 0.1}
#: the sd of a site's mean offset per measure a plan assumes (scanner and population: the sites' intercepts absorb
#: it, but its size reaches the standard error through the noise on the sites' covariate sums)
REFERENCE_SITE_SD = 0.1


def _expected_covariates(design: Design, fractions: Sequence[Mapping[str, float]] | None, counts
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Each site's expected covariate sums (S x C) and the expected within-site X'X (C x C): the levels in the
    given fractions per site (default equal), a continuous covariate uniform over its range."""
    C = design.n_covariates
    Sx, A = np.zeros((len(counts), C)), np.zeros((C, C))
    for s, n in enumerate(counts):
        mean, cov, j = np.zeros(C), np.zeros((C, C)), 0
        for cov_ in design.covariates:
            k = len(cov_.columns())
            if cov_.categorical:
                given = (fractions[s] if fractions else {}).get(cov_.name)
                pi = np.full(len(cov_.levels), 1 / len(cov_.levels)) if given is None else np.array(
                    [float(given.get(lv, 0.0)) if isinstance(given, Mapping) else
                     (float(given) if i else 1 - float(given)) for i, lv in enumerate(cov_.levels)])
                p = pi[1:]
                mean[j:j + k] = 2 * p - 1
                second = 1 - 2 * (p[:, None] + p[None, :])
                np.fill_diagonal(second, 1.0)
                cov[j:j + k, j:j + k] = second - np.outer(mean[j:j + k], mean[j:j + k])
            else:
                cov[j, j] = 1 / 3
            j += k
        Sx[s], A = n * mean, A + n * cov
    return Sx, A


def contrast_errors(settings: GLMSettings, counts: Sequence[int], *, noise_sd: float,
                    residual_sd: Mapping[str, float] | None = None,
                    fractions: Sequence[Mapping[str, Any]] | None = None, effect: float = 0.0,
                    site_sd: float = REFERENCE_SITE_SD, draws: int = 24) -> np.ndarray:
    """The standard error the fit will report (median over ``draws`` releases; inf where most draws leave the
    contrast unresolved, :func:`fit_glm`) of every contrast (rows) on a
    measure of each family (columns, ``families`` order) carrying ``effect`` (per unit of the contrast), from
    public quantities only: the sites' ``counts``, the release's noise sd per entry of the consortium's sum
    (``noise_sd``, the plan's), each family's residual sd (default :data:`REFERENCE_SD`), the sd of the sites'
    offsets (``site_sd``) and the levels' fractions per site (``fractions``: one mapping per site, covariate ->
    fraction of its second level, or covariate -> {level: fraction}; default equal). It runs :func:`fit_glm`
    itself on the design's expected statistics plus draws of the release's noise, so the prediction is the fit's
    own."""
    design, families = settings.design, settings.families
    residual_sd = {**REFERENCE_SD, **(residual_sd or {})}
    n = np.asarray(counts, np.float64)
    N, S, C = float(n.sum()), len(n), design.n_covariates
    Sx, A = _expected_covariates(design, fractions, n)
    c = _scales(design, families)
    sd = {k: noise_sd / c[k] if c[k] else 0.0 for k in BLOCKS}
    Q = sum(sl.stop - sl.start for sl in families.values())
    units = [u for _, _, u in design.contrasts()]
    sizes = _sizes(design, families)
    rng = np.random.default_rng(0)
    out = np.zeros((C, len(families)))
    categorical = [j for cov in design.covariates for j in [cov.categorical] * len(cov.columns())]
    XX = A + np.einsum("sc,sd,s->cd", Sx, Sx, 1 / n)
    for j in range(C):
        beta = np.zeros((C, Q))
        beta[j] = effect / units[j]
        # a level's effect raises its members only (the reference stays): half of it is a mean shift, and each
        # site's measures sit at an offset of their own
        shift = effect / 2 if categorical[j] else 0.0
        fitted = np.einsum("cq,cq->q", beta, A @ beta)
        ses = []
        for _ in range(draws):
            Sy = np.einsum("sc,cq->sq", Sx, beta) + n[:, None] * (shift + rng.normal(0, site_sd, (S, Q)))
            XY = A @ beta + np.einsum("sc,sq,s->cq", Sx, Sy, 1 / n)
            YY = np.array([residual_sd.get(f, residual_sd[kind(f)]) ** 2 * (sl.stop - sl.start) * (N - S - C)
                           + fitted[sl].sum() + (Sy[:, sl] ** 2 / n[:, None]).sum() for f, sl in families.items()])
            st = {"counts": n, "n": N, "sd": sd,
                  "Sx": Sx + rng.normal(0, sd["x"], Sx.shape), "Sy": Sy + rng.normal(0, sd["y"], Sy.shape),
                  "XX": XX + _moment_noise(rng, 1, design, sd["xx"])[0],
                  "XY": XY + rng.normal(0, sd["xy"], XY.shape),
                  "YY": YY + (rng.normal(0, sd["yy"], YY.shape) if sizes["yy"] else 0.0)}
            fit = fit_glm(st, design, families, random_state=rng)
            ses.append(np.full(Q, np.inf) if fit["unresolved"][j] else fit["se"][j])  # no finding there
        se = np.median(ses, axis=0)
        out[j] = [se[sl.start] if sl.stop > sl.start else np.nan for sl in families.values()]
    return out


def bh_power(effect: float, se: float, n_measures: int, *, n_effects: int = 1, alpha: float = 0.05) -> float:
    """The chance that an effect of this size is found at q < ``alpha`` (Benjamini-Hochberg over ``n_measures``,
    ``n_effects`` of them carrying an effect of the size; normal approximation). BH rejects below
    p* = alpha R / Q, R the rejections expected at p*: the fixed point of that equation."""
    z = abs(effect) / se if se > 0 else math.inf

    def power(p: float) -> float:
        crit = stats.norm.isf(p / 2)
        return float(stats.norm.sf(crit - z) + stats.norm.cdf(-crit - z))

    m1 = min(max(n_effects, 1), n_measures)
    p = alpha * m1 / n_measures
    for _ in range(100):
        rejections = m1 * power(p) + (n_measures - m1) * p
        new = min(alpha, alpha * max(rejections, 1.0) / n_measures)
        if abs(new - p) < 1e-12:
            break
        p = new
    return power(p)


def detectable(se: float, n_measures: int, *, power: float = 0.8, n_effects: int = 1, alpha: float = 0.05
               ) -> float:
    """The smallest effect :func:`bh_power` finds with ``power``."""
    lo, hi = 0.0, se * 20
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if bh_power(mid, se, n_measures, n_effects=n_effects, alpha=alpha) < power else (lo, mid)
    return hi


# -- the CAPE release and the stage's settings ----------------------------------------------------

class CapeGLM(CapeSubjectMean):
    """The group GLM's one release per site: the mean of its subjects' packed sufficient statistics
    (:func:`pack_statistics`, each of norm at most 1: sensitivity 2 / M_s)."""

    name = "group-glm"
    key = "glm"
    tag = 49


@dataclass(frozen=True)
class GLMSettings:
    """The public settings of the group-statistics stage, identical at every party: the design and measures,
    ``epsilon``/``delta`` the stage's per site against the headline adversary (None with plan "none")."""

    design: Design
    measures: tuple[str, ...]
    n_components: int
    epsilon: float | None
    delta: float = 1e-5
    n_states: int = 0
    plan: Any = "cape"
    random_state: int | None = None
    level: float = 0.95
    #: each component's atlas network (the "networks" measures need them; every party computes the same)
    networks: tuple[str, ...] | None = None
    #: the measures the consortium tests, by name (:func:`measure_names`; "networks Vis-Default" by network):
    #: only these are released, each a family of its own with its own bound. Empty: every measure of ``measures``
    hypotheses: tuple[str, ...] = ()
    families: dict[str, slice] = field(init=False, compare=False)

    def __post_init__(self):
        families = ({h: slice(k, k + 1) for k, h in enumerate(self.hypotheses)} if self.hypotheses
                    else family_sizes(self.measures, self.n_components, self.n_states, self.networks))
        object.__setattr__(self, "families", families)

    @property
    def computed(self) -> tuple[str, ...]:
        """The measure families a site computes: those of the hypotheses, else ``measures``."""
        return tuple(dict.fromkeys(kind(h) for h in self.hypotheses)) if self.hypotheses else tuple(self.measures)

    @property
    def names(self) -> list[str]:
        """The released measures' names, in the release's order."""
        return list(self.hypotheses) if self.hypotheses else measure_names(self.measures, self.n_components,
                                                                           self.n_states, self.networks)

    def select(self, Y: np.ndarray, names: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        """The released measures' columns of a site's measures Y (columns ``names``, :func:`subject_measures` of
        :attr:`computed`), and the hypotheses the run did not measure (a network pair without components): their
        column is 0 for every subject, no information."""
        at = {n: k for k, n in enumerate(names)}
        out = np.zeros((len(Y), len(self.names)))
        absent = []
        for k, n in enumerate(self.names):
            if n in at:
                out[:, k] = Y[:, at[n]]
            else:
                absent.append(n)
        return out, absent

    @property
    def budget(self) -> privacy.GaussianBudget:
        """The (eps, delta) the stage is calibrated to (a planner scales the noise from it)."""
        return privacy.GaussianBudget(self.epsilon, self.delta)

    #: the ledger's name of the stage's one release
    ledger_stages = (CapeGLM.name,)

    @property
    def n_measures(self) -> int:
        return sum(sl.stop - sl.start for sl in self.families.values())

    @property
    def length(self) -> int:
        return statistics_length(self.design, self.families)

    def algorithm(self, *, n_sites: int) -> CapeGLM:
        z = noise_multipliers(self.epsilon, self.delta, {"glm": 1.0}, n_sites=n_sites, plan=self.plan)["glm"]
        return CapeGLM(1.0, z, random_state=self.random_state)

    def planned(self, n_subjects: Sequence[int]) -> list[PrivacyLedger]:
        """The ledgers the stage fills, from each site's count of subjects in the model alone."""
        alg = self.algorithm(n_sites=len(n_subjects))
        return planned_ledgers(alg, NoisePlan.coerce(self.plan), [alg.public_state(s, [0] * int(m), self.length)
                                                                  for s, m in enumerate(n_subjects)])

    def fit(self, mean, counts: Sequence[float], noise_var: float) -> dict[str, np.ndarray]:
        """The aggregator's post-processing of the release (``counts``: each site's subjects in the model, 0 for a
        site that is not in the sum): :func:`fit_glm`."""
        st = unpack_statistics(mean, counts, noise_var, self.design, self.families)
        seed = None if self.random_state is None else [self.random_state, 491]
        return fit_glm(st, self.design, self.families, level=self.level, random_state=seed)

    def run(self, sites: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
        """Every party in this process (tests, benchmarks): each site's (X, Y); the fit and the ledgers."""
        packed = [pack_statistics(X, Y, self.design, self.families)[0] for X, Y in sites]
        r = run_cape(self.algorithm(n_sites=len(sites)), packed, NoisePlan.coerce(self.plan))
        agg = r.aggregator
        return {**self.fit(agg["glm"], agg["counts"], agg["noise_var"]), "ledgers": cape_ledgers(r)}
