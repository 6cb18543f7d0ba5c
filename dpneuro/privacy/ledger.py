"""Privacy ledger: every Gaussian release a party makes, and what it adds up to."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dpneuro.privacy.gaussian import gdp_epsilon

UNITS = ("subject", "sample")
#: neighbouring datasets: "replace" swaps one unit for another (counts public; dpneuro's relation),
#: "add-remove" adds or deletes one (only to reproduce papers that use it)
NEIGHBOURS = ("replace", "add-remove")
METHODS = ("exact", "rdp", "pld")


@dataclass(frozen=True)
class Release:
    """One Gaussian release, repeated ``count`` times with the same calibration."""

    name: str
    sensitivity: float
    sigma: float
    count: int = 1
    unit: str = "subject"
    stage: str = ""
    note: str = ""
    # GDP mu of one release against the aggregator colluding with the assumed
    # number of sites (CAPE, [capeDJICA] Thm. 1); 0 when that adversary sees no more
    # than the release itself
    mu_collusion: float = 0.0
    neighbour: str = "replace"

    @property
    def noise_multiplier(self) -> float:
        return self.sigma / self.sensitivity if self.sensitivity > 0 else math.inf

    @property
    def mu_squared(self) -> float:
        if self.sensitivity == 0:
            return 0.0
        if self.sigma == 0:
            return math.inf
        return self.count * (self.sensitivity / self.sigma) ** 2

    @property
    def mu_squared_collusion(self) -> float:
        if self.mu_collusion <= 0:
            return self.mu_squared
        return self.count * self.mu_collusion**2


@dataclass
class PrivacyLedger:
    """The releases of one party (one site) over a run, and their composition.

    ``epsilon(delta, "exact")`` composes the Gaussians exactly as mu-GDP with
    mu^2 = sum count * (sensitivity/sigma)^2 and converts with the analytic
    Gaussian curve; ``"rdp"`` and ``"pld"`` use Google's dp-accounting.
    ``notes`` carries statements the report must show (e.g. what is public).
    """

    owner: str = ""
    releases: list[Release] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    draws: int = 0  # number of noise arrays drawn (see dpneuro.privacy.noise)
    # set when the party released something without DP noise: epsilon is then infinite
    not_private: str = ""

    def record(
        self, name: str, sensitivity: float, sigma: float, count: int = 1, *,
        unit: str = "subject", stage: str = "", note: str = "", mu_collusion: float = 0.0,
        neighbour: str = "replace",
    ) -> Release:
        """Add a Gaussian release of L2 ``sensitivity`` with noise std ``sigma``."""
        if not (sensitivity >= 0 and math.isfinite(sensitivity)):
            raise ValueError(f"release {name!r}: sensitivity must be finite and >= 0, got {sensitivity}")
        if not (sigma >= 0) or math.isnan(sigma):
            raise ValueError(f"release {name!r}: sigma must be >= 0, got {sigma}")
        if int(count) != count or count < 1:
            raise ValueError(f"release {name!r}: count must be a positive integer, got {count}")
        if unit not in UNITS:
            raise ValueError(f"release {name!r}: unit must be one of {UNITS}, got {unit!r}")
        if neighbour not in NEIGHBOURS:
            raise ValueError(f"release {name!r}: neighbour must be one of {NEIGHBOURS}, got {neighbour!r}")
        rel = Release(name, float(sensitivity), float(sigma), int(count), unit, stage, note, float(mu_collusion),
                      neighbour)
        for i, r in enumerate(self.releases):
            if replace(r, count=rel.count) == rel:
                # repeated rounds with one calibration: one entry with a count keeps ledgers small
                self.releases[i] = rel = replace(r, count=r.count + rel.count)
                return rel
        self.releases.append(rel)
        return rel

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def mark_not_private(self, reason: str) -> None:
        """Record that this party released data without DP noise (its epsilon is infinite)."""
        self.not_private = reason
        self.note(reason)

    # -- composition ---------------------------------------------------------------
    @property
    def mu(self) -> float:
        """GDP parameter of everything released so far, against one observer of the releases."""
        return math.sqrt(sum(r.mu_squared for r in self.releases))

    @property
    def mu_collusion(self) -> float:
        """GDP parameter against the aggregator with the assumed colluding sites (CAPE)."""
        return math.sqrt(sum(r.mu_squared_collusion for r in self.releases))

    def epsilon(self, delta: float, method: str = "exact", *, collusion: bool = False) -> float:
        """Total eps at ``delta`` for the whole ledger.

        ``collusion=True`` accounts against the aggregator colluding with the
        assumed number of sites (exact GDP only: each CAPE release is a
        Gaussian mechanism with mu = ``mu_collusion`` against that adversary).
        """
        if method not in METHODS:
            raise ValueError(f"unknown accounting method {method!r}; use one of {METHODS}")
        if self.not_private:
            return math.inf
        mu = self.mu_collusion if collusion else self.mu
        if not self.releases or mu == 0:
            return 0.0
        if math.isinf(mu):
            return math.inf
        if method == "exact":
            return gdp_epsilon(delta, mu)
        if collusion:
            return self._dp_accounting(method, collusion=True).get_epsilon(delta)
        return self._dp_accounting(method).get_epsilon(delta)

    def _dp_accounting(self, method: str, collusion: bool = False):
        import dp_accounting  # deferred: a large library; only this cross-check needs it

        if method == "rdp":
            acc = dp_accounting.rdp.RdpAccountant()
        else:
            acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
        for r in self.releases:
            if r.mu_squared == 0:
                continue
            z = 1 / r.mu_collusion if collusion and r.mu_collusion > 0 else r.noise_multiplier
            acc.compose(dp_accounting.GaussianDpEvent(z), int(r.count))
        return acc

    def by_stage(self, *, collusion: bool = True) -> dict[str, float]:
        """mu of each stage alone (stages compose: total mu^2 is the sum), against the aggregator by default."""
        out: dict[str, float] = {}
        for r in self.releases:
            out[r.stage] = out.get(r.stage, 0.0) + (r.mu_squared_collusion if collusion else r.mu_squared)
        return {k: math.sqrt(v) for k, v in out.items()}

    def summary(self, delta: float) -> dict[str, Any]:
        """The totals a report shows.

        ``epsilon`` is the headline: the guarantee against the aggregator
        colluding with the assumed number of sites (it sees every release and
        the zero-sum total), exact GDP composition; ``epsilon_rdp`` is the same
        adversary by the RDP accountant. ``epsilon_single_release`` bounds the
        weaker view of someone who sees this party's releases alone (from each
        release's calibrated std; CAPE releases carry more, see
        :data:`dpneuro.protocol.cape.plans.ZERO_SUM_VARIANCE`); that view is part of the
        coalition's, so it is never above the headline (a site of an unequal
        consortium can be well below its calibrated std's figure).
        """
        headline = self.epsilon(delta, "exact", collusion=True)
        return {
            "owner": self.owner,
            "delta": delta,
            "epsilon": headline,
            "epsilon_rdp": self.epsilon(delta, "rdp", collusion=True),
            "mu": self.mu_collusion,
            "epsilon_single_release": min(self.epsilon(delta, "exact"), headline),
            "mu_single_release": min(self.mu, self.mu_collusion),
            "releases": sum(r.count for r in self.releases),
            "units": sorted({r.unit for r in self.releases}),
            "neighbours": sorted({r.neighbour for r in self.releases}),
        }

    # -- persistence ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "releases": [asdict(r) for r in self.releases],
            "notes": list(self.notes),
            "draws": self.draws,
            "not_private": self.not_private,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrivacyLedger:
        led = cls(owner=d.get("owner", ""), notes=list(d.get("notes", [])), draws=int(d.get("draws", 0)),
                  not_private=d.get("not_private", ""))
        for r in d.get("releases", []):
            led.releases.append(Release(**r))
        return led

    def merge(self, *others: PrivacyLedger) -> PrivacyLedger:
        """A new ledger holding this ledger's releases followed by the others'."""
        out = PrivacyLedger.from_dict(self.to_dict())
        for o in others:
            if o.owner and self.owner and o.owner != self.owner:
                raise ValueError(f"cannot merge ledgers of different parties ({self.owner!r}, {o.owner!r})")
            out.releases.extend(o.releases)
            for n in o.notes:
                out.note(n)
            out.draws += o.draws
            out.not_private = out.not_private or o.not_private
        return out

    @staticmethod
    def merge_all(ledgers: Iterable[PrivacyLedger]) -> PrivacyLedger:
        ledgers = list(ledgers)
        if not ledgers:
            return PrivacyLedger()
        return ledgers[0].merge(*ledgers[1:])
