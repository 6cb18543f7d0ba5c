"""A site's subjects' covariates for group statistics: its participants table, matched to the subjects it loaded.

BIDS keeps them in ``participants.tsv`` at the dataset's root (first column
``participant_id``, e.g. ``sub-01``). The table stays at its site: only the
model's bounded sufficient statistics leave it (:mod:`dpneuro.algorithms.glm`).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from dpneuro._utils.errors import DpneuroError

__all__ = ["CovariateError", "participants_path", "read_covariates"]

#: what a TSV cell may say for "no value" (BIDS: n/a)
MISSING = {"", "n/a", "na", "nan"}


class CovariateError(DpneuroError, ValueError):
    """A site's participants table cannot give the design's covariates."""


def participants_path(site_path: str, participants: str = "") -> Path:
    """The site's table: ``participants`` when given, else ``participants.tsv`` in its folder."""
    if participants:
        return Path(participants)
    root = Path(site_path)
    return (root if root.is_dir() else root.parent) / "participants.tsv"


def _key(subject: str) -> str:
    return subject.removeprefix("sub-")


def read_covariates(path: Path, subject_ids: Sequence[str], names: Sequence[str]
                    ) -> tuple[list[dict[str, str] | None], dict[str, str]]:
    """Each subject's values of ``names`` (None where the table has no row or a missing value), and why each such
    subject has none."""
    if not Path(path).is_file():
        raise CovariateError(f"no participants table at {path}: group statistics need each subject's covariates "
                             "(a TSV with participant_id and the design's columns; a site entry's participants "
                             "names another)")
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    header = list(rows[0]) if rows else []
    if not header or header[0] != "participant_id":
        raise CovariateError(f"{path}: the first column must be participant_id (BIDS), got {header[:1]}")
    absent = [n for n in names if n not in header]
    if absent:
        raise CovariateError(f"{path}: no column {absent} (columns: {header})")
    table: dict[str, dict[str, str]] = {}
    for row in rows:
        sid = _key((row["participant_id"] or "").strip())
        if sid in table:
            raise CovariateError(f"{path}: participant {row['participant_id']!r} has two rows")
        table[sid] = {n: (row[n] or "").strip() for n in names}
    values: list[dict[str, str] | None] = []
    why: dict[str, str] = {}
    for sid in subject_ids:
        row = table.get(_key(sid))
        empty = [] if row is None else [n for n in names if row[n].lower() in MISSING]
        if row is None or empty:
            why[sid] = "not in the participants table" if row is None else f"no value of {', '.join(empty)}"
            values.append(None)
        else:
            values.append(row)
    return values, why
