"""Exceptions and warnings raised by secure aggregation."""

from __future__ import annotations

from dpneuro._utils.errors import DpneuroError
from dpneuro.protocol.driver import SiteDropped


class SecAggError(DpneuroError, ValueError):
    """Secure aggregation cannot proceed safely or correctly.

    Raised for too few surviving sites, requests a site must refuse (they
    would unmask an individual input), shares that do not reconstruct the
    committed secret, and inconsistent messages. The message always says
    which sites and which secure sum are concerned.
    """


class SecAggDropped(SecAggError, SiteDropped):
    """This site was dropped from the run (its message arrived too late) and must stop.

    Also a :class:`dpneuro.protocol.driver.SiteDropped`, so the driver ends the site
    quietly instead of failing the whole run.
    """


class SecAggWarning(UserWarning):
    """Something was wrong but recoverable, e.g. a wrong Shamir share outvoted by correct ones."""
