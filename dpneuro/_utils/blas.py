"""One BLAS thread around small matrix products, safe to enter from several threads at once.

OpenBLAS splits even small products over its threads; next to other busy threads (a site's decoding pool,
Pydra's workers) that is up to 20 times slower, and the order of the sums, so the last bits of a float32
result, depends on the thread count. ``threadpoolctl`` sets a process-wide limit, so concurrent users share
one: the first to enter sets it and the last to leave restores the original.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from threadpoolctl import threadpool_limits

__all__ = ["one_blas_thread"]

_lock = threading.Lock()
_users = 0
_limits: threadpool_limits | None = None


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the block with BLAS limited to one thread (process-wide, for as long as any thread is inside)."""
    global _users, _limits
    with _lock:
        if _users == 0:
            _limits = threadpool_limits(limits=1, user_api="blas")
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _limits is not None:
                _limits.restore_original_limits()
                _limits = None
