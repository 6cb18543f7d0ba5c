"""A site's subjects' covariates for group statistics: its participants table, matched to the subjects it loaded.

BIDS keeps them in ``participants.tsv`` at the dataset's root (first column
``participant_id``, e.g. ``sub-01``). The table stays at its site: only the
model's bounded sufficient statistics leave it (:mod:`dpneuro.algorithms.glm`).
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dpneuro._utils.errors import DpneuroError

__all__ = ["CovariateError", "check_covariates", "covariate_rows", "participants_path", "read_covariates"]

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
    try:  # utf-8-sig: a table saved by a spreadsheet may start with a byte-order mark
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f, delimiter="\t")
            rows = list(reader)
            header = list(reader.fieldnames or [])  # a table of no subject still has its columns
    except (OSError, UnicodeDecodeError) as exc:
        raise CovariateError(f"{path}: the participants table cannot be read ({exc})") from None
    if not header or header[0] != "participant_id":
        raise CovariateError(f"{path}: the first column must be participant_id (BIDS), got {header[:1]}")
    absent = [n for n in names if n not in header]
    if absent:
        raise CovariateError(f"{path}: no column {absent} (columns: {header})")
    table: dict[str, dict[str, str]] = {}
    for line in rows:
        sid = _key((line["participant_id"] or "").strip())
        if sid in table:
            raise CovariateError(f"{path}: participant {line['participant_id']!r} has two rows")
        table[sid] = {n: (line[n] or "").strip() for n in names}
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


def _why_not(design: Any, values: Mapping[str, str], exc: ValueError) -> str:
    """Why the design cannot encode a subject's values: a continuous covariate's value that is not a number is
    named (float() alone would not say which covariate), else the design's own reason (an unagreed level)."""
    for cov in design.covariates:
        if not cov.categorical:
            try:
                float(values[cov.name])
            except ValueError:
                return f"{cov.name} = {values[cov.name]!r} is not a number"
    return str(exc)


def covariate_rows(path: Path, subject_ids: Sequence[str], design: Any, site: int
                   ) -> tuple[dict[str, Any], int, dict[str, str]]:
    """Each usable subject's design row (by id), how many continuous values were clipped to the agreed range, and
    why each other subject has none (not in the table, a missing value, a level the consortium did not agree on,
    a value that is not a number).

    ``design``: the consortium's :class:`dpneuro.algorithms.glm.Design` (its ``covariates`` and ``rows``);
    ``site``: this site's index in it. A table without the design's columns raises :class:`CovariateError`.
    """
    values, why = read_covariates(path, subject_ids, [c.name for c in design.covariates])
    rows: dict[str, Any] = {}
    clipped = 0
    for sid, v in zip(subject_ids, values):
        if v is None:
            continue
        try:
            x, cut = design.rows([v], site)
        except ValueError as exc:
            why[sid] = _why_not(design, v, exc)
            continue
        rows[sid], clipped = x[0], clipped + cut
    return rows, clipped, why


def check_covariates(path: Path, subject_ids: Sequence[str], design: Any, site: int, name: str,
                     on_bad_subject: str = "stop") -> tuple[dict[str, Any], int, dict[str, str]]:
    """:func:`covariate_rows`, refusing (:class:`CovariateError`, naming site ``name``, the table and each
    subject with its reason) a table that cannot give them or, unless ``on_bad_subject = "skip"``, any subject
    without usable covariates. A run's pre-flight calls it on the subjects the site's files name, before
    anything is loaded or released; the group-statistics stage on the subjects it loaded."""
    try:
        rows, clipped, why = covariate_rows(path, subject_ids, design, site)
    except CovariateError as exc:
        raise CovariateError(f"site {name!r}: {exc}") from None
    if why and on_bad_subject != "skip":
        raise CovariateError(f"site {name!r}: {len(why)} subject(s) without usable covariates in {path}: "
                             + "; ".join(f"{k} ({v})" for k, v in why.items())
                             + ". Correct the table, or set on_bad_subject = \"skip\" to leave them out of the model")
    return rows, clipped, why
