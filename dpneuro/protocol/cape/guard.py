"""The one gate of a site: every noise draw and every release of a CAPE stage passes through its guard.

Checking each broadcast alone is not enough: a deviating aggregator can hand a
site one plan for its zero-sum draw and another for its local draw, or send it
back to the zero-sum step to release the same round again. :class:`SiteGuard`
holds the site's promise for the whole stage (and, with a
:class:`~dpneuro.privacy.budget.SiteBudget`, for the whole run):

- the noise plan is pinned when the stage sets it up (:func:`verify_plan`
  checks it against the site's own configuration first); it changes only to a
  plan for strictly fewer sites (the survivors of a dropout), checked again,
  and any zero-sum draw made under the old plan is discarded;
- a zero-sum draw and the local draw of one release come from the same pinned
  plan, and every std is read from that plan here, nowhere else;
- each quantity is released at most once per round, only in the rounds the
  stage planned, so never more often than the planned count;
- no release (and no plan) is accepted after which the site's ledger would
  exceed its configured total.

Every refusal is an :class:`~dpneuro._utils.errors.UnsafeRelease` naming the
site, the stage, the field and the aggregator, raised before anything is drawn
or sent.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from dpneuro import privacy
from dpneuro._utils.errors import UnsafeRelease
from dpneuro.privacy import PrivacyLedger, max_colluding
from dpneuro.privacy.budget import SiteBudget
from dpneuro.protocol.cape.plans import NoisePlan, Variances, symmetric_guarantee

if TYPE_CHECKING:
    from dpneuro.protocol.cape.phases import ReleaseSpec

#: relative slack for rounding when a site compares the broadcast plan with its own promise
_PLAN_RTOL = 1e-6


def _plan_field(plan: dict[str, np.ndarray], key: str, n: int, refuse) -> np.ndarray:
    if key not in plan:
        raise refuse(key, "is missing")
    a = np.asarray(plan[key], dtype=np.float64)
    if a.shape != (n,) or not np.all(np.isfinite(a)) or np.any(a < 0):
        raise refuse(key, f"must be {n} finite non-negative numbers, got {np.array2string(a, precision=4)}")
    return a


def verify_plan(plan: dict[str, np.ndarray], releases: dict[str, ReleaseSpec], site: int, noise_plan: NoisePlan,
                n_sites: int, *, who: str | None = None) -> int:
    """Check a broadcast variance plan against this site's own promise before it draws any noise for it.

    The plan comes from the aggregator; what a site promised comes from its own
    configuration: each release's std tau_s = noise multiplier x sensitivity
    (:class:`ReleaseSpec`, computed from the site's own counts), the collusion
    assumption and zero-sum scale of its :class:`NoisePlan`, and the configured
    number of sites. The site refuses (:class:`~dpneuro._utils.errors.UnsafeRelease`)
    unless

    - the plan lists it, with positive weights that sum to 1 and finite variances;
    - every release alone carries at least tau_s^2 (its single-release guarantee);
    - under ``cape`` (plans for unequal sites ``"guarantee"``, the default), the
      guarantee against the aggregator and the assumed colluders, computed from the
      plan exactly as the ledger computes it, is at most what an equal consortium of
      ``n_sites`` gives at the site's noise multiplier: the guarantee the planner
      promised. Honest sites draw exactly the plan's variances, and whichever sites
      collude are conditioned out, so this bound holds whatever the plan claims.

    Returns the site's position in the plan.
    """
    name = who or f"site {site}"

    def refuse(field: str, why: str) -> UnsafeRelease:
        return UnsafeRelease(f"{name} refuses to release: the aggregator's noise plan field {field!r} {why}; "
                             "nothing was released")

    sites = np.asarray(plan.get("cape/sites", []))
    if sites.ndim != 1 or site not in sites.tolist() or len(set(sites.tolist())) != len(sites) \
            or not all(0 <= int(s) < n_sites for s in sites):
        raise refuse("cape/sites", f"lists sites {sites.tolist()}, not this site among at most {n_sites}")
    S, me = len(sites), sites.tolist().index(site)
    w = _plan_field(plan, "cape/weights", S, refuse)
    if np.any(w <= 0) or not math.isclose(float(w.sum()), 1.0, rel_tol=1e-9):
        raise refuse("cape/weights", f"must be positive and sum to 1, got {w.tolist()}")
    kind = noise_plan.kind
    if kind == "none":
        return me
    n_c = noise_plan.colluders(n_sites)
    # the promised guarantee per unit noise multiplier (conv has no coalition beyond the release itself)
    promised = symmetric_guarantee(n_sites, n_c, noise_plan.zero_sum_variance) if kind == "cape" else 0.0
    for rel, spec in releases.items():
        e = _plan_field(plan, f"cape/e_var/{rel}", S, refuse)
        g = _plan_field(plan, f"cape/g_var/{rel}", S, refuse)
        tau2 = spec.tau**2
        alone = Variances(e, g, w).release_variance()[me] if kind == "cape" else g[me]  # conv adds no zero-sum
        if not alone >= tau2 * (1 - _PLAN_RTOL):
            raise refuse(f"cape/g_var/{rel}", f"gives release {rel!r} noise of variance {alone:.4g} alone, below the "
                         f"{tau2:.4g} this site's own privacy setting requires")
        if kind == "cape" and noise_plan.unequal == "guarantee":
            # every coalition, however many: a site checks each plan once
            mu = privacy.cape_release_mu(spec.sensitivity, e, g, w, me, n_c, closed_form=False, max_subsets=math.inf)
            limit = promised * spec.sensitivity / spec.tau
            if not mu <= limit * (1 + _PLAN_RTOL):
                raise refuse(f"cape/e_var/{rel}", f"would give release {rel!r} a guarantee of mu = {mu:.4g} against "
                             f"the aggregator and {n_c} colluding site(s), above the {limit:.4g} this site's "
                             f"configuration promises ({n_sites} sites)")
    return me


def release_noise(plan: NoisePlan, name: str, spec: ReleaseSpec, plan_arrays: dict[str, np.ndarray], me: int,
                  cache: dict | None = None) -> tuple[float, float]:
    """(sigma, mu against the aggregator) of one release of ``name`` by the site at position ``me`` of the plan:
    what :func:`record_release` records and what the guard adds up before it lets the release go."""
    # the site's calibrated std: exactly what one release carries under the papers' plan, a lower bound on it
    # when the zero-sum part is scaled up (the single-release figure is then an upper bound on its eps)
    var = min(_release_variance(plan_arrays, name, me), spec.tau**2)
    mu_c = 0.0
    if plan.kind == "cape":
        cache = {} if cache is None else cache
        sites = np.asarray(plan_arrays["cape/sites"]).tolist()
        key = f"{name}:{spec.sensitivity!r}:{sites}:{plan_digest(plan_arrays)}"
        if key not in cache:
            n_c = max_colluding(len(sites)) if plan.n_colluding is None else plan.n_colluding
            cache[key] = privacy.cape_release_mu(spec.sensitivity, plan_arrays[f"cape/e_var/{name}"],
                                                 plan_arrays[f"cape/g_var/{name}"], plan_arrays["cape/weights"],
                                                 me, n_c)
        mu_c = cache[key]
    return float(np.sqrt(var)), float(mu_c)


def _mu2(spec: ReleaseSpec, sigma: float, mu_c: float) -> float:
    """One release's mu^2 against the aggregator, as the ledger composes it (Release.mu_squared_collusion)."""
    if mu_c > 0:
        return mu_c**2
    if spec.sensitivity == 0:
        return 0.0
    return math.inf if sigma == 0 else (spec.sensitivity / sigma) ** 2


def record_release(ledger: PrivacyLedger, plan: NoisePlan, name: str, spec: ReleaseSpec,
                   plan_arrays: dict[str, np.ndarray], me: int, *, stage: str, count: int = 1,
                   cache: dict | None = None) -> None:
    """Record one release of ``name`` by the site at position ``me`` of the variance plan.

    The one place a CAPE release enters a ledger: the guard calls it after
    every release, the budget planner (:func:`dpneuro.protocol.cape.phases.planned_ledgers`)
    with the number of rounds, so the two always agree.
    """
    if plan.kind == "none":
        ledger.mark_not_private("plan 'none': releases carry no noise and are not private")
        return
    sigma, mu_c = release_noise(plan, name, spec, plan_arrays, me, cache)
    ledger.record(name, spec.sensitivity, sigma, count, unit=spec.unit, stage=spec.stage or stage,
                  neighbour=spec.neighbour, mu_collusion=mu_c)


def _release_variance(plan: dict[str, np.ndarray], name: str, me: int) -> float:
    v = Variances(plan[f"cape/e_var/{name}"], plan[f"cape/g_var/{name}"], plan["cape/weights"])
    return float(v.release_variance()[me])


def plan_digest(arrays: dict[str, Any]) -> str:
    """A plan's identity: its arrays, names and values (what a site pins; what the zero-sum sum binds)."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(np.asarray(arrays[k]))
        h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _field_changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The first plan field in which ``new`` differs from ``old``."""
    for k in sorted(set(old) | set(new)):
        if k not in old or k not in new or not np.array_equal(np.asarray(old[k]), np.asarray(new[k])):
            return k
    return ""


class SiteGuard:
    """The guard of one site for one CAPE stage: a view over the stage's checkpointed state (``state["cape"]``).

    Parameters
    ----------
    state : dict
        The site's state of the stage; the guard keeps the pinned plan in
        ``state["cape"]["plan"]`` and what it let through in ``state["cape"]["guard"]``,
        so a restarted site resumes with the same promise.
    noise_plan : NoisePlan
        The run's plan kind and collusion assumption (the site's own configuration).
    n_sites : int
        The configured consortium.
    stage : str
        The stage's name, for the ledger and the messages.
    max_rounds : int
        The stage's rounds: a release is planned in the rounds its spec lists below this.
    releases : dict of ReleaseSpec
        The site's releases, computed from its own configuration and counts.
    budget : SiteBudget or None
        The run's total and the finished stages' spend (None: this stage's planned releases alone).
    """

    def __init__(self, state: dict[str, Any], *, noise_plan: NoisePlan, n_sites: int, stage: str, max_rounds: int,
                 releases: dict[str, ReleaseSpec], budget: SiteBudget | None = None):
        self.state, self.cs = state, state["cape"]
        self.noise_plan, self.n_sites, self.stage, self.max_rounds = noise_plan, int(n_sites), stage, int(max_rounds)
        self.releases = releases
        self.budget = budget
        self.rec = self.cs.setdefault("guard", {"digest": "", "me": -1, "released": [], "drawn": {}})

    @property
    def who(self) -> str:
        return self.state.get("site_name") or f"site {self.state['site']}"

    def _refuse(self, why: str) -> UnsafeRelease:
        return UnsafeRelease(f"{self.who} refuses to release in stage {self.stage!r}: {why}; nothing was released")

    # -- the plan --------------------------------------------------------------------------
    @property
    def plan(self) -> dict[str, np.ndarray]:
        if "plan" not in self.cs:
            raise self._refuse("no noise plan was set up (the aggregator's 'cape-setup' broadcast carried none)")
        return self.cs["plan"]

    @property
    def me(self) -> int:
        return int(self.rec["me"])

    def offer(self, arrays: dict[str, np.ndarray], *, topic: str, redo: bool) -> None:
        """A broadcast carried a plan (``arrays``, the ``cape/`` fields): pin it, keep it, or refuse it.

        The first plan of the stage is checked and pinned. Afterwards a plan
        may only be the pinned one again, or one for strictly fewer of the
        pinned sites (survivors), sent back to the zero-sum step (``redo``) or,
        without zero-sum noise, with the next round; it is checked like the first.
        """
        new = {k: np.asarray(v) for k, v in arrays.items()}
        digest = plan_digest(new)
        if digest == self.rec["digest"]:
            return
        if self.rec["digest"]:
            old = self.cs["plan"]
            field = _field_changed(old, new)
            sites_old = set(np.asarray(old["cape/sites"]).tolist())
            sites_new = set(np.asarray(new.get("cape/sites", [])).tolist())
            survivors = sites_new < sites_old
            if not survivors or (self.noise_plan.kind == "cape" and not redo):
                how = ", sent back to the zero-sum step" if self.noise_plan.kind == "cape" else ""
                raise self._refuse(
                    f"the aggregator's broadcast before step {topic!r} changes field {field!r} of the noise plan "
                    "pinned at set-up; a plan may change only to one for the survivors of a dropout (strictly fewer "
                    f"of the pinned sites{how})")
        me = self._verify(new)
        self._check_budget(new, me, what=f"the plan broadcast before step {topic!r}")
        self.cs["plan"] = new
        self.rec.update(digest=digest, me=me, drawn={})  # zero-sum draws of an older plan are void

    def _verify(self, plan: dict[str, np.ndarray]) -> int:
        """:func:`verify_plan` against the site's releases as they are now (kept, so a change of its own stds is
        checked again)."""
        me = verify_plan(plan, self.releases, int(self.state["site"]), self.noise_plan, self.n_sites, who=self.who)
        self.rec["specs"] = self._specs_key()
        return me

    def _specs_key(self) -> str:
        return repr(sorted((n, float(s.tau), float(s.sensitivity)) for n, s in self.releases.items()))

    def _done(self, name: str) -> int:
        return sum(1 for _, n in self.rec["released"] if n == name)

    def _check_budget(self, plan: dict[str, np.ndarray], me: int, *, what: str) -> None:
        """The stage's spend so far plus every release it still plans, under ``plan``, within the run's total."""
        if self.budget is None or self.noise_plan.kind == "none":
            return
        mu2 = self.state["ledger"].mu_collusion ** 2
        for name, spec in self.releases.items():
            left = spec.count(self.max_rounds) - self._done(name)
            if left > 0:
                mu2 += left * _mu2(spec, *release_noise(self.noise_plan, name, spec, plan, me))
        self.budget.check(mu2, what=f"{what} (every release stage {self.stage!r} still plans)")

    # -- draws and releases ------------------------------------------------------------------
    def _may_release(self, rnd: int, name: str) -> None:
        spec = self.releases.get(name)
        if spec is None:
            raise self._refuse(f"{name!r} is not one of the releases this site declared")
        if self.rec.get("specs") != self._specs_key():  # the site's own stds changed since the plan was checked
            self._verify(self.plan)
        planned = spec.rounds is None or rnd in spec.rounds
        if not (0 <= rnd < self.max_rounds and planned):
            raise self._refuse(f"the stage plans no release of {name!r} in round {rnd}")
        if [rnd, name] in self.rec["released"]:
            raise self.refuse_again(rnd, name)

    def refuse_again(self, rnd: int, name: str) -> UnsafeRelease:
        spec = self.releases[name]
        return self._refuse(
            f"the aggregator asks again for {name!r} of round {rnd}, which this site released already; its "
            f"configuration plans {spec.count(self.max_rounds)} release(s) of {name!r} in this stage, one per "
            "round, and a repeat would let the noise be averaged away")

    def refuse_missing_sum(self, rnd: int, name: str) -> UnsafeRelease:
        return self._refuse(f"the broadcast before releasing {name!r} of round {rnd} carries no zero-sum total "
                            "'cape/esum', without which this site's zero-sum noise would not be removed")

    def zero_sum(self, rnd: int, name: str, size: int) -> np.ndarray:
        """This round's zero-sum draw e_hat_s of ``name``, from the pinned plan."""
        self._may_release(rnd, name)
        std = float(np.sqrt(self.plan[f"cape/e_var/{name}"][self.me]))
        draw = privacy.gaussian(self.state["rng"], (size,), std, self.state["ledger"])
        self.rec["drawn"][name] = rnd
        return draw

    def local(self, rnd: int, name: str, size: int) -> np.ndarray:
        """The local draw g_s of ``name`` for round ``rnd`` and the release's ledger entry: the release itself.

        Under ``cape`` the zero-sum draw of the same round must have come from
        the same pinned plan (a plan change voids it).
        """
        self._may_release(rnd, name)
        kind = self.noise_plan.kind
        if kind == "cape" and self.rec["drawn"].get(name) != rnd:
            raise self._refuse(f"{name!r} of round {rnd} has no zero-sum draw under the noise plan in force (the "
                               "plan changed after the draw, or the zero-sum step was skipped)")
        spec, plan, me = self.releases[name], self.plan, self.me
        cache = self.cs.setdefault("mu_collusion", {})
        if self.budget is not None and kind != "none":
            mu2 = self.state["ledger"].mu_collusion ** 2 + _mu2(spec, *release_noise(self.noise_plan, name, spec,
                                                                                     plan, me, cache))
            self.budget.check(mu2, what=f"releasing {name!r} of round {rnd}")
        g_std = float(np.sqrt(plan[f"cape/g_var/{name}"][me]))
        g = privacy.gaussian(self.state["rng"], (size,), g_std, self.state["ledger"]) if kind != "none" \
            else np.zeros(size)
        record_release(self.state["ledger"], self.noise_plan, name, spec, plan, me, stage=self.stage, cache=cache)
        self.rec["released"].append([int(rnd), name])
        self.rec["drawn"].pop(name, None)
        return g
