"""A site's configured total for the whole run, and what it has spent before the current stage.

A run's stages each run their own protocol, but a site's promise is one: its
configured total (eps, delta) against the aggregator and the assumed colluders
(the ledger's headline). :class:`SiteBudget` carries that total and the ledger
of the stages the site has finished into the next stage, whose guard
(:class:`dpneuro.protocol.cape.guard.SiteGuard`) refuses any release after
which the whole run's ledger would exceed the total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dpneuro._utils.errors import UnsafeRelease
from dpneuro.privacy.gaussian import gdp_epsilon, gdp_mu
from dpneuro.privacy.ledger import PrivacyLedger

#: relative slack for rounding when a spend is compared with the total
BUDGET_RTOL = 1e-9


@dataclass(frozen=True)
class SiteBudget:
    """A site's configured total and its spend in the stages it has finished.

    ``epsilon`` None: no total was configured (per-stage settings); the guard
    then holds each stage to its planned releases, each at most its promised
    guarantee, which is the configuration's total by construction.
    """

    owner: str = ""
    epsilon: float | None = None
    delta: float = 1e-5
    prior: PrivacyLedger = field(default_factory=PrivacyLedger)

    @property
    def mu(self) -> float:
        """The GDP mu the total allows (inf without a total)."""
        return math.inf if self.epsilon is None else gdp_mu(self.epsilon, self.delta)

    def after(self, ledger: PrivacyLedger) -> SiteBudget:
        """This budget once ``ledger`` (a finished stage's) is spent too."""
        return SiteBudget(self.owner, self.epsilon, self.delta, self.prior.merge(ledger))

    def check(self, stage_mu2: float, *, what: str) -> None:
        """Refuse (:class:`UnsafeRelease`) when the finished stages plus ``stage_mu2`` (the current stage's mu^2,
        against the aggregator) exceed the total; ``what`` says which releases, for the message."""
        if self.epsilon is None:
            return
        if self.prior.not_private:
            raise UnsafeRelease(f"{self.owner or 'this site'} refuses to release: an earlier stage released without "
                                f"noise ({self.prior.not_private}), which no total epsilon = {self.epsilon:g} covers")
        mu2 = self.prior.mu_collusion ** 2 + stage_mu2
        if mu2 > self.mu ** 2 * (1 + BUDGET_RTOL):
            spent = gdp_epsilon(self.delta, math.sqrt(mu2)) if math.isfinite(mu2) else math.inf
            raise UnsafeRelease(
                f"{self.owner or 'this site'} refuses to release: {what} would bring this site's ledger to "
                f"eps = {spent:.4g} at delta = {self.delta:g} (the stages before spent "
                f"{self.prior.epsilon(self.delta, collusion=True):.4g}), above its configured total "
                f"epsilon = {self.epsilon:g}; nothing more was released")
