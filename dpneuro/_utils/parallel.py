"""Threads for a site's per-run work: how many to use, and a map that keeps its results in order with bounded
memory."""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["ordered_map", "resolve_workers"]


def resolve_workers(workers: int | None = None) -> int:
    """The number of parallel workers: ``workers``, or the cores this process may use."""
    if workers is None:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover - not Linux
            return max(1, os.cpu_count() or 1)
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    return int(workers)


def ordered_map(fn, items, *, workers: int = 1):
    """Yield ``fn(item)`` in the order of ``items``, computed by ``workers`` threads.

    At most ``2 * workers`` results wait to be consumed, so memory stays bounded
    when ``fn`` returns large arrays. Closing the generator cancels the work not
    yet started.
    """
    items = list(items)
    if workers <= 1:
        for x in items:
            yield fn(x)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="dpneuro") as pool:
        pending: deque = deque()
        todo = iter(items)
        try:
            for x in todo:
                pending.append(pool.submit(fn, x))
                if len(pending) >= 2 * workers:
                    break
            while pending:
                result = pending.popleft().result()
                nxt = next(todo, pending)  # the deque itself marks the end
                if nxt is not pending:
                    pending.append(pool.submit(fn, nxt))
                yield result
                del result
        finally:
            for f in pending:
                f.cancel()
