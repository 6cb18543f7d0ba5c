"""Progress bars, one policy for every long loop: shown only when asked for and only on a terminal.

In a log (CI, a batch job, a COINSTAC container) a bar's carriage returns make one unreadable line, so
there tqdm is told to stay silent (its ``disable=None``: off when the stream is not a TTY).
"""

from __future__ import annotations

from tqdm.auto import tqdm

__all__ = ["progress_bar"]


def progress_bar(iterable=None, *, enabled: bool, **options) -> tqdm:
    """A tqdm bar over ``iterable`` (or with ``total=``) when ``enabled`` and stderr is a terminal."""
    return tqdm(iterable, disable=None if enabled else True, **options)
