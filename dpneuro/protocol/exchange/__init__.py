"""Pluggable exchange layer: one interface, several backends."""

from dpneuro.privacy import PrivacyLedger
from dpneuro.protocol.exchange.base import (
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
from dpneuro.protocol.exchange.codec import register_state_type
from dpneuro.protocol.exchange.coinstac import CoinstacExchange
from dpneuro.protocol.exchange.directory import DirectoryCheckpoint, DirectoryExchange
from dpneuro.protocol.exchange.inprocess import InProcessExchange

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
