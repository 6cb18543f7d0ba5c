"""CAPE as phases of the generic driver ([capeDJICA] Alg. 1-2).

An algorithm says, per round, what each site wants to release
(:meth:`CapeAlgorithm.site_compute`) and what the aggregator does with the
weighted average of the noisy releases (:meth:`CapeAlgorithm.aggregator_update`).
:func:`cape_protocol` wraps it into driver phases for a :class:`NoisePlan`:

round 0   ``cape-setup``       sites announce their public release parameters (weight, std per
                               quantity); the aggregator checks them, fixes the variance plan and
                               broadcasts it with the algorithm's first message
          secure-aggregation key set-up (``cape`` plan only)
each round ``zs-masked``,       sites compute f(x_s), draw e_hat_s and secure-sum mu_s e_hat_s;
          ``zs-unmask``         the aggregator learns only the sum and broadcasts it (``cape`` only)
          ``release``          sites release f(x_s) + e_s + g_s; the aggregator averages and updates

If a site disappears during the zero-sum step, the survivors' e_s would no
longer cancel: the aggregator sends everyone back to ``zs-masked`` with a plan
for the survivors and fresh draws, before anyone releases. A site that
disappears after the others released stops the run (:class:`DropoutAfterRelease`):
cancelling it would take second releases, which every site's guard refuses.
Every draw and release of a site passes its guard
(:class:`dpneuro.protocol.cape.guard.SiteGuard`); the aggregator checks each
release and the combined one (:meth:`_CapeProtocol._check_combined`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from typing import Protocol as TypingProtocol

import numpy as np

from dpneuro import privacy
from dpneuro._utils.errors import DpneuroError
from dpneuro.privacy import PrivacyLedger
from dpneuro.privacy.budget import SiteBudget
from dpneuro.protocol import secagg
from dpneuro.protocol.cape.guard import SiteGuard, plan_digest, record_release
from dpneuro.protocol.cape.packing import check_symmetric_noise, n_unique, noise_array
from dpneuro.protocol.cape.plans import NoisePlan, Variances, plan_variances
from dpneuro.protocol.driver import Phase, RunOptions, State
from dpneuro.protocol.exchange.base import MessageRejected, Payload, party
from dpneuro.protocol.simulation import SimulationResult, simulate

CARRIES = {"cape": "cape-noise", "conv": "gaussian-noise", "none": "NON-PRIVATE (plan none)"}
#: where a site's weighted zero-sum noise waits for the secure sum (transient: never checkpointed)
_ZERO_SUM_INPUT = "_cape_zero_sum"


@dataclass(frozen=True)
class ReleaseSpec:
    """One quantity a site releases every round.

    ``sensitivity`` is its L2 sensitivity at this site for the privacy unit
    ``unit``; ``noise_multiplier`` is the std per unit of sensitivity that the
    site's (eps, delta) target calls for (``noise_multiplier(eps, delta)``), so the
    release std is tau_s = noise_multiplier * sensitivity. A ``symmetric``
    release gets noise on its unique entries, shaped by ``symmetric_noise``
    (:data:`dpneuro.protocol.cape.packing.SYMMETRIC_NOISE`). ``rounds`` lists the
    rounds it is released in (None: every round); the protocol and the planner
    both read it, so they count the same releases. ``bound`` is public: the
    aggregator checks every release against it (:func:`release_problem`).
    """

    shape: tuple[int, ...]
    sensitivity: float
    noise_multiplier: float
    symmetric: bool = False
    unit: str = "subject"
    stage: str = ""
    neighbour: str = "replace"
    symmetric_noise: str = "symmetrized"
    rounds: tuple[int, ...] | None = None
    #: a public bound on ||f(x_s)||_F (from the clipping the sensitivity rests on): the aggregator refuses a
    #: release whose norm exceeds it plus its noise's tail bound (None: no norm check)
    bound: float | None = None

    def __post_init__(self):
        check_symmetric_noise(self.symmetric_noise)

    def count(self, n_rounds: int) -> int:
        """How many times it is released in rounds 0 .. n_rounds - 1."""
        return n_rounds if self.rounds is None else sum(1 for r in set(self.rounds) if 0 <= r < n_rounds)

    @property
    def tau(self) -> float:
        return self.noise_multiplier * self.sensitivity

    @property
    def size(self) -> int:
        return n_unique(tuple(self.shape), self.symmetric)


class CapeAlgorithm(TypingProtocol):
    """What an algorithm supplies to run under CAPE (or a baseline plan).

    Optional: ``site_postprocess(state, name, noisy) -> ndarray``. If the
    algorithm defines it, a site applies it to each noisy release
    f(x_s) + e_s + g_s before sending, and the aggregator averages the
    post-processed arrays (e.g. capeAGN sends (M3_s + noise)(W, W, W),
    K x K x K, instead of the D x D x D tensor). It must be a *linear* map,
    the *same* at every site (a function of public, broadcast values only):
    then sum_s mu_s L(e_s) = L(sum_s mu_s e_s) = 0 and CAPE's cancellation
    holds. Privacy is that of the noisy release (post-processing); the ledger
    records the release as declared in ``site_releases``.
    """

    name: str
    max_rounds: int

    def site_init(self, site: int, data: Any) -> State: ...

    def site_releases(self, state: State) -> dict[str, ReleaseSpec]: ...

    def site_weight(self, state: State) -> float: ...

    def site_compute(self, state: State, round: int, broadcast: Payload) -> dict[str, np.ndarray]: ...

    def aggregator_init(self) -> State: ...

    def aggregator_first(self, state: State) -> Payload: ...

    def aggregator_update(self, state: State, round: int, combined: dict[str, np.ndarray]) -> Payload: ...


def _plan_payload(plan: NoisePlan, specs: Mapping[str, Any], taus: dict[str, np.ndarray], weights: np.ndarray,
                  active: list[int], consortium: int) -> tuple[dict[str, np.ndarray], dict[str, Variances]]:
    """Variances for the active sites (survivors keep the ``consortium``'s guarantee); arrays to broadcast them."""
    w = weights[active] / weights[active].sum()
    arrays = {"cape/sites": np.asarray(active, np.int64), "cape/weights": w}
    plans = {}
    for name in specs:
        v = plan_variances(plan, taus[name][active], w, consortium=consortium)
        plans[name] = v
        arrays[f"cape/e_var/{name}"] = v.e_hat
        arrays[f"cape/g_var/{name}"] = v.g
    return arrays, plans


def _plan_held(state: State) -> str:
    """The noise plan a party holds for the zero-sum secure sum: a site's pinned plan, the aggregator's
    broadcast one. Bound into the pairwise masks, so an aggregator that sent two honest sites different plans
    learns nothing of their zero-sum draws (the masks do not cancel)."""
    cs = state["cape"]
    return cs["guard"]["digest"] if "guard" in cs else cs["plan_digest"]


class _CapeProtocol:
    """The driver-facing protocol built by :func:`cape_protocol`."""

    def __init__(self, algorithm: CapeAlgorithm, plan: NoisePlan, n_sites: int, secagg_config=None,
                 budget: SiteBudget | None = None):
        self.alg = algorithm
        self.budget = budget  # the site's total and earlier stages' spend (a site's own protocol only)
        self.plan = plan
        self.n_sites = int(n_sites)  # the configured consortium: what every site's promise is computed for
        self.name = f"{algorithm.name}[{plan.kind}]"
        self.max_rounds = algorithm.max_rounds
        self.secagg = secagg_config
        self._setup = [Phase("cape-setup", self._site_setup, self._agg_setup)]
        self._round: list[Phase] = []
        if plan.kind == "cape":
            self._setup += [self._wrap(p) for p in secagg.setup_phases(secagg_config)]
            masked, unmask = secagg.sum_phases(secagg_config, "zs", _ZERO_SUM_INPUT, self._agg_zero_sum,
                                               context=_plan_held)
            self._round += [self._wrap(masked, before=self._zero_sum_input), self._wrap(unmask)]
        self._round.append(Phase("release", self._site_release, self._agg_release, allow_dropout=True))

    # -- driver interface ------------------------------------------------------------
    def phases(self, round: int) -> Sequence[Phase]:
        return self._setup + self._round if round == 0 else self._round

    def site_init(self, site: int, data: Any) -> State:
        state = self.alg.site_init(site, data)
        state.setdefault("ledger", PrivacyLedger(owner=f"site-{site}"))
        state.setdefault("rng", privacy.default_rng())
        state.setdefault("site", site)
        # stochastic rounding in secure aggregation: not privacy noise, but
        # reproducible with the site's seed (and checkpointed) so backends and
        # restarted parties give identical sums
        state.setdefault("rounding_rng", np.random.default_rng(state["rng"].bit_generator.seed_seq.spawn(1)[0]))
        return state

    def aggregator_init(self) -> State:
        return self.alg.aggregator_init()

    def _restart_index(self, round: int) -> int:
        return (len(self._setup) if round == 0 else 0)

    def _wrap(self, phase: Phase, before=None) -> Phase:
        """A secure-aggregation phase whose site step first keeps the broadcast; with ``before`` (the masked
        phase), then puts ``before(state, round)`` where the sum takes its input: CAPE's own work is done before
        the sum's step, never called back from it."""
        site_fn = phase.site

        def site(state: State, rnd: int, incoming: Payload | None) -> Payload:
            self._absorb(state, incoming, phase.topic)
            if before is not None:
                state[_ZERO_SUM_INPUT] = before(state, rnd)
            return site_fn(state, rnd, incoming)

        return Phase(phase.topic, site, phase.aggregator, phase.site_spec, phase.broadcast_spec,
                     phase.allow_dropout)

    def _absorb(self, state: State, incoming: Payload | None, topic: str) -> None:
        """Keep the algorithm's broadcast from whatever phase brought it; a plan it carries goes to the guard."""
        if incoming is None:
            return
        if incoming.meta.get("cape_alg"):
            state["cape"]["alg_in"] = incoming
        plan = {k: v for k, v in incoming.arrays.items() if k.startswith("cape/") and k != "cape/esum"}
        if plan:
            self.guard(state).offer(plan, topic=topic, redo="goto" in incoming.meta)

    def guard(self, state: State) -> SiteGuard:
        """The site's guard for this stage (:class:`~dpneuro.protocol.cape.guard.SiteGuard`): every draw and
        release of the stage passes through it."""
        return SiteGuard(state, noise_plan=self.plan, n_sites=self.n_sites, stage=self.alg.name,
                         max_rounds=self.max_rounds, releases=self.alg.site_releases(state), budget=self.budget)

    # -- set-up ----------------------------------------------------------------------
    def _site_setup(self, state: State, rnd: int, incoming: Payload | None) -> Payload:
        specs = self.alg.site_releases(state)
        state["cape"] = {"specs": {k: {"shape": list(v.shape), "symmetric": v.symmetric,
                                       "symmetric_noise": v.symmetric_noise,
                                       "rounds": None if v.rounds is None else [int(r) for r in v.rounds],
                                       "bound": v.bound}
                                   for k, v in specs.items()},
                         "f_round": -1}
        arrays = {"weight": np.array([float(self.alg.site_weight(state))])}
        for name, spec in specs.items():
            if not (spec.sensitivity > 0 and spec.noise_multiplier > 0) and self.plan.kind != "none":
                raise ValueError(f"site {state['site']}: release {name!r} needs positive sensitivity and noise")
            arrays[f"tau/{name}"] = np.array([spec.tau])
        meta = {"releases": state["cape"]["specs"]}
        return Payload(arrays, meta, carries={k: "public" for k in arrays})

    def _agg_setup(self, state: State, rnd: int, msgs: dict[int, Payload]) -> Payload:
        sites = sorted(msgs)
        self.plan.check(len(sites))
        first = msgs[sites[0]].meta["releases"]
        for s in sites[1:]:
            if msgs[s].meta["releases"] != first:
                raise ValueError(f"site {s} declares releases {msgs[s].meta['releases']} but site {sites[0]} "
                                 f"declares {first}: all sites must run the same configuration")
        n = max(sites) + 1
        weights = np.zeros(n)
        taus = {name: np.zeros(n) for name in first}
        for s, m in msgs.items():
            weights[s] = float(m.arrays["weight"][0])
            for name in first:
                taus[name][s] = float(m.arrays[f"tau/{name}"][0])
        state["cape"] = {"specs": first, "weights": weights, "taus": taus, "summed": sites, "plan_sites": sites}
        plan_arrays, plans = _plan_payload(self.plan, first, taus, weights, sites, self.n_sites)
        self._keep_plan(state["cape"], plans, sites, plan_arrays)
        alg = self.alg.aggregator_first(state)
        return Payload({**alg.arrays, **plan_arrays}, {**alg.meta, "cape_alg": True, "active": sites})

    @staticmethod
    def _keep_plan(cs: dict, plans: dict[str, Variances], sites: list[int], arrays: dict[str, np.ndarray]) -> None:
        """What the aggregator keeps of a plan (``arrays``, as broadcast): the average's noise, each site's release
        noise (its bound), and the plan's digest, which the zero-sum secure sum binds (:func:`_plan_held`)."""
        cs["plan_digest"] = plan_digest(arrays)
        cs["noise_var"] = {name: v.combined_variance() for name, v in plans.items()}
        cs["release_var"] = {name: dict(zip(map(str, sites), map(float, v.release_variance())))
                             for name, v in plans.items()}

    def _check_releases(self, state: State, rnd: int, msgs: dict[int, Payload], active: list[int]) -> None:
        """Refuse, naming the site, a release that is missing, misshapen, not finite or beyond its public bound."""
        cs = state["cape"]
        post = getattr(self.alg, "site_postprocess", None)
        for s in active:
            who = party(s, state.get("site_names"))
            for name, spec in self._now(cs["specs"], rnd).items():
                if name not in msgs[s].arrays:
                    raise MessageRejected(f"rejected release {name!r} from {who}: it is missing")
                var = cs["release_var"][name][str(s)] if self.plan.kind != "none" else 0.0
                why = release_problem(np.asarray(msgs[s].arrays[name]), spec, var, check_shape=post is None)
                if why:
                    raise MessageRejected(f"rejected release {name!r} from {who}, round {rnd}: {why}; the run "
                                          "stops rather than use it")

    @staticmethod
    def _now(specs: dict[str, dict], rnd: int) -> dict[str, dict]:
        """The declared releases made in round ``rnd``, in declaration order (sites and aggregator agree)."""
        return {k: v for k, v in specs.items() if v.get("rounds") is None or rnd in v["rounds"]}

    # -- zero-sum noise ----------------------------------------------------------------
    def _compute(self, state: State, rnd: int) -> None:
        """f(x_s) once per round (kept across a redo after a dropout)."""
        cs = state["cape"]
        if cs["f_round"] != rnd:
            f = self.alg.site_compute(state, rnd, cs.get("alg_in"))
            for name, spec in self._now(cs["specs"], rnd).items():
                if name not in f or tuple(np.shape(f[name])) != tuple(spec["shape"]):
                    raise ValueError(f"site {state['site']}: {name!r} must have shape {tuple(spec['shape'])}")
            cs["f"] = {k: np.asarray(v, dtype=np.float64) for k, v in f.items()}
            cs["f_round"] = rnd

    def _zero_sum_input(self, state: State, rnd: int) -> np.ndarray:
        """Draw this round's zero-sum noise e_hat_s through the guard; the secure sum adds mu_s e_hat_s."""
        self._compute(state, rnd)
        cs, guard = state["cape"], self.guard(state)
        w = guard.plan["cape/weights"][guard.me]
        parts, e_hat = [], {}
        for name, spec in self._now(cs["specs"], rnd).items():
            e_hat[name] = guard.zero_sum(rnd, name, n_unique(tuple(spec["shape"]), spec["symmetric"]))
            parts.append(w * e_hat[name])
        cs["e_hat"] = e_hat
        return np.concatenate(parts) if parts else np.zeros(0)

    def _agg_zero_sum(self, state: State, rnd: int, total: np.ndarray) -> Payload:
        cs = state["cape"]
        cs["summed"] = sorted(int(s) for s in state["secagg"]["last"]["included"])
        active = sorted(state["active"])
        if cs["summed"] != active or cs["plan_sites"] != active:
            return self._redo(state, rnd, active)
        return Payload({"cape/esum": np.asarray(total, np.float64)}, {"active": active})

    def _redo(self, state: State, rnd: int, active: list[int]) -> Payload:
        """Send the survivors back to the zero-sum step with a plan for them."""
        cs = state["cape"]
        self.plan.check(len(active))
        plan_arrays, plans = _plan_payload(self.plan, cs["specs"], cs["taus"], cs["weights"], active, self.n_sites)
        self._keep_plan(cs, plans, active, plan_arrays)
        cs["plan_sites"] = active
        cs["redos"] = cs.get("redos", 0) + 1
        return Payload(plan_arrays, {"active": active, "goto": self._restart_index(rnd)})

    # -- release ---------------------------------------------------------------------
    def _site_release(self, state: State, rnd: int, incoming: Payload | None) -> Payload:
        self._absorb(state, incoming, "release")
        self._compute(state, rnd)
        cs, guard = state["cape"], self.guard(state)
        kind = self.plan.kind
        me, plan = guard.me, guard.plan
        S, w = len(plan["cape/sites"]), plan["cape/weights"]
        arrays, carries, kept = {}, {}, {}
        post = getattr(self.alg, "site_postprocess", None)
        offset = 0
        for name, spec in self._now(cs["specs"], rnd).items():
            shape, sym = tuple(spec["shape"]), spec["symmetric"]
            size = n_unique(shape, sym)
            e = np.zeros(size)
            if kind == "cape":
                if incoming is None or "cape/esum" not in incoming.arrays:
                    raise guard.refuse_missing_sum(rnd, name)
                esum = incoming.arrays["cape/esum"][offset:offset + size]
                e = cs["e_hat"][name] - esum / (w[me] * S)
            g = guard.local(rnd, name, size)  # the release: counted, within the total, recorded
            noise = e + g
            kept[name] = (e, g)
            offset += size
            arrays[name] = cs["f"][name] + noise_array(noise, shape, sym, spec["symmetric_noise"])
            if post is not None:
                # linear map applied identically at every site (see CapeAlgorithm): the
                # zero-sum parts still cancel, sum_s mu_s L(e_s) = L(sum_s mu_s e_s) = 0
                arrays[name] = np.asarray(post(state, name, arrays[name]), dtype=np.float64)
            carries[name] = CARRIES[kind]
        cs.pop("e_hat", None)
        state["_last_noise"] = kept  # packed (e_s, g_s) of the last release; stays on the site
        return Payload(arrays, {}, carries)

    def _agg_release(self, state: State, rnd: int, msgs: dict[int, Payload]) -> Payload:
        cs = state["cape"]
        active = sorted(state["active"])
        planned = cs["plan_sites"]
        if self.plan.kind == "cape" and active != planned:
            lost = [party(s, state.get("site_names")) for s in sorted(set(planned) - set(active))]
            raise DropoutAfterRelease(
                f"{', '.join(lost)} dropped out after the other sites released round {rnd} of {self.alg.name!r}: "
                "their zero-sum noise no longer cancels, and removing it would take a second release of the round "
                "from every survivor, beyond the releases each site's guard allows; the run stops (the survivors' "
                "ledgers hold the one release each made)")
        self._check_releases(state, rnd, msgs, active)
        w = cs["weights"][active] / cs["weights"][active].sum()
        combined = {name: sum(wi * msgs[s].arrays[name] for wi, s in zip(w, active))
                    for name in self._now(cs["specs"], rnd)}
        if getattr(self.alg, "site_postprocess", None) is None:
            self._check_combined(state, rnd, combined, dict(zip(map(str, active), map(float, w))))
        alg = self.alg.aggregator_update(state, rnd, combined)
        if self.plan.kind != "cape" and active != planned:
            cs["plan_sites"] = active
            plan_arrays, plans = _plan_payload(self.plan, cs["specs"], cs["taus"], cs["weights"], active,
                                               self.n_sites)
            self._keep_plan(cs, plans, active, plan_arrays)
            alg = Payload({**alg.arrays, **plan_arrays}, alg.meta)
        return Payload(alg.arrays, {**alg.meta, "cape_alg": True, "active": active})

    def _check_combined(self, state: State, rnd: int, combined: dict[str, np.ndarray],
                        weights: dict[str, float]) -> None:
        """Refuse a combined release no honest consortium could have made.

        One site's release hides behind its zero-sum noise, so its own norm
        check is loose; in the weighted average the zero-sum parts cancel and
        what is left is sum_s mu_s f(x_s) (norm at most the common public bound,
        the weights summing to 1) plus the local noise, whose variance the plan
        fixes. Past that, some site deviates. Also keeps, per release, the
        largest influence one site can have on the average undetected
        (:func:`site_influence`).
        """
        cs = state["cape"]
        kept = cs.setdefault("influence", {})
        for name, spec in self._now(cs["specs"], rnd).items():
            if spec.get("bound") is None:
                continue
            var = cs["noise_var"][name] if self.plan.kind != "none" else 0.0
            limit = float(spec["bound"]) + noise_tail(spec, var)
            norm = float(np.linalg.norm(combined[name]))
            if norm > limit:
                raise MessageRejected(
                    f"rejected the sites' combined release {name!r} of round {rnd}: its norm {norm:.4g} exceeds the "
                    f"{limit:.4g} that honest sites allow once the zero-sum noise cancels (the clipped statistics' "
                    f"common bound {float(spec['bound']):.4g} plus the remaining noise's tail bound): at least one "
                    "site deviates from the protocol; the run stops rather than use it")
            release_var = cs["release_var"][name] if self.plan.kind != "none" else {}
            kept[name] = site_influence(spec, weights, release_var, var)


class DropoutAfterRelease(DpneuroError, RuntimeError):
    """A site dropped out after the others released a CAPE round: finishing it would take second releases."""


#: the tail probability a release's noise may exceed its bound with (Laurent & Massart's chi-square bound)
_NOISE_TAIL = 50.0  # e^-50, about 2e-22 per release


def noise_tail(spec: dict, noise_var: float) -> float:
    """A bound on the Frobenius norm of a release's noise of per-entry variance ``noise_var``, exceeded with
    probability e^-50: ||noise||^2 <= var (n + 2 sqrt(n t) + 2 t) (Laurent & Massart; n draws, a symmetric
    array's entry mirrored at most ndim! times)."""
    shape = tuple(spec["shape"])
    n, t = n_unique(shape, bool(spec["symmetric"])), _NOISE_TAIL
    mirrored = math.sqrt(math.factorial(len(shape))) if spec["symmetric"] else 1.0
    return mirrored * math.sqrt(noise_var * (n + 2 * math.sqrt(n * t) + 2 * t))


def site_influence(spec: dict, weights: dict[str, float], release_var: dict[str, float],
                   combined_var: float) -> dict[str, float]:
    """How far one deviating site can move the weighted average of a release without being refused.

    Two checks bound it: its own release (norm at most B + its noise's tail
    t_s, so it moves the average by at most 2 mu_s (B + t_s)) and the
    combined statistic (norm at most B + t, so at most 2 (B + t) from where
    the honest sites would have put it). ``largest`` is the smaller of the two
    for the most influential site, ``relative`` the same over the statistic's
    own bound B; ``honest`` is how far one honest site's data alone can move
    the average (2 mu_s B for the heaviest site).
    """
    B = float(spec["bound"])
    combined = 2 * (B + noise_tail(spec, combined_var))
    per_site = [min(2 * w * (B + noise_tail(spec, release_var.get(s, 0.0))), combined) for s, w in weights.items()]
    largest = max(per_site, default=combined)
    return {"bound": B, "largest": largest, "relative": largest / B if B > 0 else math.inf,
            "honest": 2 * max(weights.values(), default=0.0) * B}


def release_problem(a: np.ndarray, spec: dict, noise_var: float, *, check_shape: bool = True) -> str | None:
    """Why the aggregator must refuse release ``a`` of a site (None: nothing wrong).

    ``spec`` is the release as every site declared it at set-up (shape, symmetric, public ``bound``);
    ``noise_var`` the per-entry variance of that site's noise under the plan. An honest release is
    f(x_s) + noise with ||f(x_s)||_F <= bound and ||noise||^2 <= var (n + 2 sqrt(n t) + 2 t) except with
    probability e^-t (n draws; a symmetric array's entry is mirrored at most ndim! times).
    """
    shape = tuple(spec["shape"])
    if a.dtype.kind != "f":
        return f"dtype {a.dtype}, expected floating point"
    if check_shape and a.shape != shape:
        return f"shape {a.shape}, expected {shape}"
    if not np.all(np.isfinite(a)):
        return "it contains NaN or infinite values"
    if spec.get("bound") is None:
        return None
    limit = float(spec["bound"]) + noise_tail(spec, noise_var)
    norm = float(np.linalg.norm(a))
    if norm > limit:
        return (f"its norm {norm:.4g} exceeds the public bound {limit:.4g} (the clipped statistic's "
                f"{float(spec['bound']):.4g} plus its noise's tail bound)")
    return None


def noise_variance(state: State, name: str) -> float:
    """Per-entry variance of the noise in the aggregator's combined release ``name`` under the run's plan (the
    zero-sum part cancels): public, so an algorithm's aggregator step may weigh a noisy release by it."""
    return float(state["cape"]["noise_var"][name])


def planned_ledgers(algorithm: CapeAlgorithm, plan: NoisePlan | str, states: Sequence[State], *,
                    rounds: int | None = None) -> list[PrivacyLedger]:
    """The ledgers a run of ``algorithm`` under ``plan`` would fill, from the sites' public states alone.

    ``states`` are the algorithm's ``public_state`` of every site (counts and
    lengths, no data). The variance plan, the release std and the guarantee
    against the aggregator come from the same functions the protocol uses;
    every release is counted once per round it is made in among the first ``rounds``
    (default: the algorithm's ``max_rounds``, an upper bound when a run stops early).
    """
    plan = NoisePlan.coerce(plan)
    plan.check(len(states))
    specs = [algorithm.site_releases(st) for st in states]
    names = list(specs[0])
    weights = np.array([float(algorithm.site_weight(st)) for st in states])
    taus = {n: np.array([sp[n].tau for sp in specs]) for n in names}
    plan_arrays, _ = _plan_payload(plan, {n: None for n in names}, taus, weights, list(range(len(states))),
                                   len(states))
    count = int(algorithm.max_rounds if rounds is None else rounds)
    out = []
    for me, (st, sp) in enumerate(zip(states, specs)):
        led = st.get("ledger") or PrivacyLedger(owner=f"site-{me}")
        for n in names:
            made = sp[n].count(count)
            if made:
                record_release(led, plan, n, sp[n], plan_arrays, me, stage=algorithm.name, count=made)
        out.append(led)
    return out


def cape_protocol(algorithm: CapeAlgorithm, plan: NoisePlan | str = "cape", *, n_sites: int,
                  secagg_config=None, budget: SiteBudget | None = None):
    """Wrap ``algorithm`` into a driver protocol under ``plan``.

    Refuses a plan outside CAPE's assumptions (fewer than 3 sites, too many
    colluders) before anything runs. ``budget``: the total and earlier spend of
    the one site that runs this protocol object (a deployed site's, or a site
    thread's in a simulation): its guard refuses any release beyond it.
    """
    plan = NoisePlan.coerce(plan)
    plan.check(n_sites)
    if plan.kind == "cape":
        # the collusion assumption is the configured consortium's, also after dropouts (what each site promised)
        plan = replace(plan, n_colluding=plan.colluders(n_sites))
        if secagg_config is None:
            secagg_config = secagg.SecAggConfig(n_sites=n_sites)
    return _CapeProtocol(algorithm, plan, n_sites, secagg_config, budget)


def run_cape(algorithm: CapeAlgorithm, site_data: Sequence[Any], plan: NoisePlan | str = "cape", *,
             exchange=None, options: RunOptions | None = None, secagg_config=None) -> SimulationResult:
    """Simulate ``algorithm`` under ``plan`` with every party in this process."""
    proto = cape_protocol(algorithm, plan, n_sites=len(site_data), secagg_config=secagg_config)
    return simulate(proto, site_data, exchange=exchange, options=options)


def ledgers(result: SimulationResult) -> list[PrivacyLedger | None]:
    """Each site's ledger from a simulation (None for a site that dropped out)."""
    return [s["ledger"] if s is not None else None for s in result.sites]


