"""Pluggable exchange layer: one interface, several backends."""

from .base import (
    AGGREGATOR,
    ArraySpec,
    Exchange,
    ExchangeError,
    MessageRejected,
    MessageSpec,
    PartyFailed,
    Payload,
    SiteTimeout,
    Suspend,
)
from ..privacy import PrivacyLedger
from .codec import register_state_type
from .coinstac import CoinstacExchange
from .directory import DirectoryCheckpoint, DirectoryExchange
from .inprocess import InProcessExchange

# ledgers live in checkpointed party state
register_state_type(PrivacyLedger)

__all__ = [
    "AGGREGATOR",
    "ArraySpec",
    "CoinstacExchange",
    "DirectoryCheckpoint",
    "DirectoryExchange",
    "Exchange",
    "ExchangeError",
    "InProcessExchange",
    "MessageRejected",
    "MessageSpec",
    "PartyFailed",
    "Payload",
    "SiteTimeout",
    "Suspend",
]
