"""BIDS file names: their entities, and the name of the confounds table fMRIPrep writes beside a run.

Names only, no file is read: the data readers (:mod:`dpneuro.data.discovery`, :mod:`dpneuro.data.load`) and
the confounds (:mod:`dpneuro.data.cleaning`) both use them.
"""

from __future__ import annotations

from pathlib import Path

NIFTI_SUFFIXES = (".nii", ".nii.gz")

#: entities that name a version of a run (its space, resolution, processing), not which run it is: two kept
#: files that differ only in these are the same run twice
VERSION_KEYS = ("space", "res", "den", "cohort", "desc")


def split_name(path) -> tuple[list[str], str, str]:
    """A BIDS file name as (its key-value parts, its suffix, its extension): ``..._bold.nii.gz`` ->
    ``([...], "bold", ".nii.gz")``."""
    name = Path(path).name
    stem, dot, ext = name.partition(".")
    parts = stem.split("_")
    return parts[:-1], parts[-1], dot + ext


def confounds_name(bold, suffix: str = "timeseries") -> str:
    """File name of an fMRIPrep run's confounds table: the run's entities without space/res/desc."""
    parts, _, _ = split_name(bold)
    keep = [x for x in parts if x.partition("-")[0] not in VERSION_KEYS]
    return "_".join(keep + ["desc-confounds", suffix]) + ".tsv"


def bids_entities(path) -> dict[str, str]:
    """The ``key-value`` entities of a BIDS file name (``sub-01_ses-1_task-rest_run-2_bold.nii.gz``)."""
    name = Path(path).name
    for suffix in NIFTI_SUFFIXES[::-1]:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    out = {}
    for part in name.split("_"):
        key, sep, value = part.partition("-")
        if sep and key and value:
            out[key] = value
    return out
