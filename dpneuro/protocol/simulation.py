"""Every party of a protocol in one process: a thread per site, the aggregator in the caller's thread.

What a simulation, the test suite and the Pydra workflow use to run a protocol
without separate processes. Each party runs the same loop it runs when
deployed (:func:`dpneuro.protocol.driver.run_site`,
:func:`~dpneuro.protocol.driver.run_aggregator`); only the exchange is
shared memory (:class:`~dpneuro.protocol.exchange.InProcessExchange`, the
default) or whatever the caller passes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from threadpoolctl import threadpool_limits

from dpneuro.protocol.driver import PhasedProtocol, RunOptions, SiteDropped, State, run_aggregator, run_site
from dpneuro.protocol.exchange import DirectoryCheckpoint, InProcessExchange
from dpneuro.protocol.exchange.base import Exchange, ExchangeError

__all__ = ["SimulatedDropout", "SimulationResult", "run_parties", "simulate"]


class SimulatedDropout(Exception):
    """Raised by a site step in tests and simulations to make that site vanish.

    :func:`simulate` treats it as the site's process dying: the site stops
    without an error and the others carry on.
    """


@dataclass
class SimulationResult:
    """What :func:`simulate` ends with: every party's final state and the exchange they used."""

    aggregator: State
    sites: list[State | None] = field(default_factory=list)  # None for a site that dropped
    exchange: Exchange | None = None


def run_parties(
    sites: Sequence[Callable[..., Any]],
    aggregator: Callable[[Exchange], Any],
    exchange: Exchange,
    *,
    timeout: float | None = None,
) -> tuple[Any, list[Any]]:
    """Every party of one exchange in this process: ``sites[s](exchange, timeout=...)`` in a thread per site,
    ``aggregator(exchange)`` here; returns the aggregator's result and each site's (None for a site that
    dropped). Any party's exception stops the run and is re-raised here.

    Pass each party's own step (a function, or a :func:`functools.partial` of one with its arguments bound): the
    thread calls it directly, so a party's call path is the same as when it runs alone.
    """
    n_sites = len(sites)
    results: list[Any] = [None] * n_sites
    errors: list[BaseException] = []

    def worker(s: int) -> None:
        try:
            # a site waits for the aggregator, which may itself wait out a slow site
            results[s] = sites[s](exchange, timeout=None if timeout is None else 3 * timeout)
        except (SimulatedDropout, SiteDropped):
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
            exchange.close()

    threads = [threading.Thread(target=worker, args=(s,), name=f"site-{s}", daemon=True) for s in range(n_sites)]
    # S site threads each running a multi-threaded BLAS oversubscribe the cores many times over
    limits = threadpool_limits(limits=1, user_api="blas") if n_sites > 1 else None
    for t in threads:
        t.start()
    try:
        agg = aggregator(exchange)
    except BaseException as exc:
        if limits is not None:
            limits.restore_original_limits()
        exchange.close()
        for t in threads:
            t.join(timeout=5)
        # whoever failed first closed the exchange; the others then fail with
        # ExchangeError, so the first error of another kind is the cause
        causes = [e for e in errors if not isinstance(e, ExchangeError)]
        if causes and isinstance(exc, ExchangeError):
            raise causes[0] from None
        raise
    for t in threads:
        t.join(timeout=5)
    if limits is not None:
        limits.restore_original_limits()
    if any(t.is_alive() for t in threads):
        # a site the aggregator no longer waits for: wake it so the run can end
        exchange.close()
        for t in threads:
            t.join(timeout=30)
        errors = [e for e in errors if not isinstance(e, ExchangeError)]
    if errors:
        raise errors[0]
    return agg, results


def simulate(
    protocol: PhasedProtocol,
    site_data: Sequence[Any],
    *,
    exchange: Exchange | None = None,
    options: RunOptions | None = None,
    checkpoint_dir=None,
) -> SimulationResult:
    """Run every party of ``protocol`` in this process: one thread per site (:func:`run_parties`).

    ``exchange`` defaults to a fresh :class:`~dpneuro.protocol.exchange.InProcessExchange`.
    With ``checkpoint_dir`` every party keeps a checkpoint there
    (``aggregator.npz``, ``site-XXX.npz``), so calling again with the same
    folder and a persistent exchange resumes without releasing anything twice.
    Any party's exception stops the run and is re-raised here.
    """

    def ckpt(name: str):
        return None if checkpoint_dir is None else DirectoryCheckpoint(Path(checkpoint_dir) / f"{name}.npz")

    n = len(site_data)
    ex = exchange if exchange is not None else InProcessExchange(n_sites=n)
    if ex.n_sites != n:
        raise ValueError(f"exchange is for {ex.n_sites} sites but {n} sites' data were given")
    opts = options or RunOptions()
    parties = [partial(run_site, protocol, s, site_data[s], checkpoint=ckpt(f"site-{s:03d}")) for s in range(n)]
    aggregator = partial(run_aggregator, protocol, options=opts, checkpoint=ckpt("aggregator"))
    agg, sites = run_parties(parties, aggregator, ex, timeout=opts.timeout)
    return SimulationResult(aggregator=agg, sites=sites, exchange=ex)
