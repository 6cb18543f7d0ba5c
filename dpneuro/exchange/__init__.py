"""Pluggable exchange layer: one interface, several backends."""

from .base import (
    AGGREGATOR,
    ArraySpec,
    Exchange,
    ExchangeError,
    MessageRejected,
    MessageSpec,
    Payload,
    SiteTimeout,
)
from .inprocess import InProcessExchange
from .directory import DirectoryExchange, DirectoryCheckpoint

__all__ = [
    "AGGREGATOR",
    "ArraySpec",
    "DirectoryCheckpoint",
    "DirectoryExchange",
    "Exchange",
    "ExchangeError",
    "InProcessExchange",
    "MessageRejected",
    "MessageSpec",
    "Payload",
    "SiteTimeout",
]
