"""Finding a site's subjects and runs: folders, BIDS and fMRIPrep trees, the BIDS filters, the files fMRIPrep
writes beside a run, and each subject's number of time points from the headers alone."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

from dpneuro._utils.errors import DataValidationError
from dpneuro.data.bids import NIFTI_SUFFIXES, VERSION_KEYS, bids_entities, confounds_name, split_name
from dpneuro.data.cleaning import run_confounds
from dpneuro.data.images import load_image

__all__ = [
    "BIDS_FILTERS",
    "SubjectDiscovery",
    "companion_names",
    "find_nifti",
    "find_subjects",
    "is_mni_space",
    "subject_id_from_path",
    "subject_lengths",
]


def _is_nifti(p: Path) -> bool:
    return p.is_file() and not p.name.startswith(".") and p.name.endswith(NIFTI_SUFFIXES)


def find_nifti(paths_or_dir) -> list[Path]:
    """Resolve a folder, a file or a list of files to a list of NIfTI paths.

    A folder is searched for ``*.nii`` / ``*.nii.gz`` (hidden files skipped),
    sorted by name; a BIDS folder (``sub-*`` sub-folders) for the BOLD runs in
    ``sub-*/[ses-*/]func/``. Listed paths are kept in the given order and are
    checked later, when validated. :func:`find_subjects` groups them by person.
    """
    return [f for _, files in find_subjects(paths_or_dir).subjects for f in files]


#: BIDS entities a site may filter its runs by (config ``[bids]``); ``res`` and ``desc`` for fMRIPrep outputs
BIDS_FILTERS = ("task", "space", "session", "run", "res", "desc")
_BIDS_KEYS = {"task": "task", "space": "space", "session": "ses", "run": "run", "res": "res", "desc": "desc"}

_SURFACE_SUFFIXES = (".func.gii", ".surf.gii", ".shape.gii", ".dtseries.nii", ".dscalar.nii", ".ptseries.nii")


def is_mni_space(space: str) -> bool:
    """Whether a BIDS ``space`` label names an MNI template (MNI152NLin2009cAsym, MNI152NLin6Asym, ...)."""
    return space.upper().startswith("MNI")


def companion_names(bold) -> dict[str, str]:
    """The files fMRIPrep writes beside a run, by role: its brain mask, boldref, JSON sidecar, confounds table."""
    parts, _, ext = split_name(bold)
    nodesc = [x for x in parts if not x.startswith("desc-")]
    stem = Path(bold).name[: -len(ext)]
    return {"mask": "_".join(nodesc + ["desc-brain", "mask"]) + ext, "boldref": "_".join(nodesc + ["boldref"]) + ext,
            "sidecar": stem + ".json", "confounds": confounds_name(bold),
            "confounds_json": confounds_name(bold)[: -len(".tsv")] + ".json",
            "confounds_old": confounds_name(bold, "regressors"),
            "confounds_old_json": confounds_name(bold, "regressors")[: -len(".tsv")] + ".json"}


def _run_identity(path) -> tuple[str, ...]:
    parts, suffix, _ = split_name(path)
    return tuple(x for x in parts if x.partition("-")[0] not in VERSION_KEYS) + (suffix,)


def _outside_func_reason(f: Path, rel: Path) -> str:
    where = next((d for d in ("anat", "figures", "fmap", "dwi", "log") if d in rel.parts[:-1]), None)
    kind = {"anat": "anatomical output", "figures": "report figure", "fmap": "field map", "dwi": "diffusion data",
            "log": "log"}.get(where)
    return f"not a functional run (outside sub-*/[ses-*/]func/{': ' + where + '/, ' + kind if where else ''})"


def _same_label(have: str | None, want: str) -> bool:
    if have is None:
        return False
    if have.isdigit() and str(want).isdigit():
        return int(have) == int(want)  # run-01 and run-1 are the same run
    return have == str(want)


@dataclass
class SubjectDiscovery:
    """The subjects of a site: each person's files (runs and sessions, in order), and what was skipped."""

    subjects: list[tuple[str, list[Path]]]
    skipped: list[tuple[str, str]]  # (path, why)
    #: files fMRIPrep wrote beside each kept run, by role (mask, boldref, sidecar, confounds, confounds_json)
    companions: dict[str, dict[str, str]] = None
    #: subjects left out on purpose (``exclude``): (subject, why)
    excluded: list[tuple[str, str]] = None
    #: the filters applied, defaults included (e.g. desc=preproc in an fMRIPrep tree)
    filters: dict[str, str] = None


def _is_bids_folder(p: Path) -> bool:
    return any(c.is_dir() and c.name.startswith("sub-") for c in p.iterdir())


def _read_subject_map(path) -> dict[str, str]:
    """file -> subject id from a TSV with columns ``file`` and ``subject``."""
    path = Path(path)
    if not path.is_file():
        raise DataValidationError(f"{path}: subject mapping file not found")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows or not {"file", "subject"} <= set(rows[0]):
        raise DataValidationError(f"{path}: a subject mapping needs a header with the columns 'file' and 'subject'")
    out = {}
    for i, r in enumerate(rows, start=2):
        if not r["file"] or not r["subject"]:
            raise DataValidationError(f"{path}, line {i}: empty file or subject")
        out[r["file"]] = r["subject"]
    return out


def find_subjects(source, *, filters: dict | None = None, subjects_tsv=None, exclude=(),
                  default_desc: str | None = "preproc") -> SubjectDiscovery:
    """The subjects (people) of a site and the files of each: the privacy unit is the person.

    ``source`` is a folder, a file or a list of files. In a BIDS folder (a BIDS
    root, an fMRIPrep derivatives root, or a site folder of
    ``sub-*/[ses-*/]func/*_bold.nii[.gz]``) every run and session of one
    ``sub-`` label forms one subject. Every other file under ``sub-*/`` is
    skipped and listed with the reason: ``anat/``, ``figures/``, surface and
    CIFTI outputs, non-BOLD files, and the files fMRIPrep writes beside a run
    (brain mask, boldref, JSON sidecar, confounds table), which are returned
    in ``companions`` for the runs that are read and listed as skipped for the
    others. ``filters`` keeps only runs whose BIDS entities match (``task``,
    ``space``, ``session``, ``run``, ``res``, ``desc``); when it names no
    ``desc`` and runs carry one (fMRIPrep), only ``desc-<default_desc>`` runs
    are read. Runs in a native space (``space-T1w``, any space not MNI) are
    left out and listed when the same run is kept in an MNI space, and refused
    otherwise; the same run kept twice (two spaces, resolutions or descs) is
    refused. ``exclude``: subject ids to leave out (listed in ``excluded``).
    Elsewhere, files named ``sub-<label>_...`` belong to subject
    ``sub-<label>``; other files are one subject each, unless ``subjects_tsv``
    (columns ``file``, ``subject``; paths relative to the folder) maps files to
    subjects.
    """
    filters = {k: v for k, v in (filters or {}).items() if v not in (None, "")}
    unknown = set(filters) - set(BIDS_FILTERS)
    if unknown:
        raise DataValidationError(f"unknown BIDS filter(s) {sorted(unknown)}; use {list(BIDS_FILTERS)}")
    explicit = dict(filters)
    skipped: list[tuple[str, str]] = []
    others: list[Path] = []  # files in func/ that are not runs: companions of a kept run, or skipped
    base: Path | None = None
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_dir():
            base = p
            if _is_bids_folder(p):
                files = []
                for f in sorted(p.rglob("*")):
                    rel = f.relative_to(p)
                    if not f.is_file() or any(part.startswith(".") for part in rel.parts):
                        continue
                    if len(rel.parts) < 2 or not rel.parts[0].startswith("sub-"):
                        continue  # dataset_description.json, sub-01.html, logs/: not a subject's data
                    if f.name.endswith(_SURFACE_SUFFIXES):
                        kind = "CIFTI" if f.name.endswith(".nii") else "surface (GIFTI)"
                        skipped.append((str(f), f"{kind} output: not a volume on the analysis grid"))
                    elif f.parent.name != "func":
                        skipped.append((str(f), _outside_func_reason(f, rel)))
                    elif (f.name.endswith(NIFTI_SUFFIXES) and bids_entities(f)
                          and f.name.split(".")[0].endswith("_bold")):
                        files.append(f)
                    else:
                        others.append(f)
            else:
                files = sorted(f for f in p.iterdir() if _is_nifti(f))
            if not files:
                raise DataValidationError(f"{p}: no NIfTI files (*.nii, *.nii.gz) found"
                                          + (f"; skipped {len(skipped)} file(s), e.g. {skipped[0][0]}: "
                                             f"{skipped[0][1]}" if skipped else ""))
        elif not p.exists():
            raise DataValidationError(f"{p}: file or folder not found")
        else:
            files = [p]
    else:
        files = [Path(f) for f in source]
        if not files:
            raise DataValidationError("no input files given")
        seen: set[Path] = set()
        for f in files:
            if f.absolute() in seen:
                raise DataValidationError(f"{f}: listed twice")
            seen.add(f.absolute())

    # fMRIPrep writes several versions of a run (desc-preproc, desc-smoothAROMAnonaggr): read one of them
    why_default: dict[str, str] = {}
    if "desc" not in filters and default_desc and base is not None and any("desc" in bids_entities(f) for f in files):
        filters["desc"] = default_desc
        why_default["desc"] = " (the default for fMRIPrep outputs)"
    kept = []
    for f in files:
        ent = bids_entities(f)
        miss = [k for k, v in filters.items() if not _same_label(ent.get(_BIDS_KEYS[k]), v)]
        if miss:
            skipped.append((str(f), "BIDS filter " + ", ".join(f"{k}={filters[k]}{why_default.get(k, '')}"
                                                               for k in miss)))
        else:
            kept.append(f)
    if not kept:
        raise DataValidationError(f"{source}: no file matches the BIDS filters {filters}")

    # native space: the consortium grid is an MNI template; a T1w-space run cannot be resampled onto it
    mni = {_run_identity(f) for f in kept if is_mni_space(bids_entities(f).get("space", ""))}
    out = []
    for f in kept:
        space = bids_entities(f).get("space")
        if space is None or is_mni_space(space):
            out.append(f)
        elif "space" not in explicit and _run_identity(f) in mni:
            skipped.append((str(f), f"native space (space-{space}): not on the MNI analysis grid; the run's MNI "
                                    "version is read"))
        else:
            raise DataValidationError(
                f"{f}: native space (space-{space}) cannot be put on the consortium's MNI analysis grid; read the "
                "run's MNI-space output (fMRIPrep --output-spaces MNI152NLin2009cAsym, config bids.space)")
    kept = out
    # the same run twice (two spaces, resolutions or descs) would count one person's data twice
    by_run: dict[tuple, Path] = {}
    for f in kept:
        key = (str(f.parent), _run_identity(f))
        if key in by_run:
            raise DataValidationError(
                f"{f}: the same run as {by_run[key].name} in another space, resolution or desc; choose one with "
                "the config's bids filters (space, res, desc)")
        by_run[key] = f

    mapping = _read_subject_map(subjects_tsv) if subjects_tsv else None
    groups: dict[str, list[Path]] = {}
    for f in kept:
        if mapping is not None:
            names = [str(f), f.name] + ([str(f.relative_to(base))] if base and f.is_relative_to(base) else [])
            key = next((k for k in names if k in mapping), None)
            if key is None:
                raise DataValidationError(f"{f}: not listed in the subject mapping {subjects_tsv}")
            sid = mapping[key]
        else:
            sid = subject_id_from_path(f)
        groups.setdefault(sid, []).append(f)

    excluded = []
    unknown_ex = [x for x in exclude if x not in groups]
    if unknown_ex:
        raise DataValidationError(f"{source}: exclude names {unknown_ex}, not subject(s) of this site "
                                  f"(subjects: {sorted(groups)})")
    for sid in exclude:
        for f in groups.pop(sid):
            skipped.append((str(f), f"subject {sid} left out by the configuration (exclude)"))
        excluded.append((sid, "left out by the configuration (exclude)"))
    if not groups:
        raise DataValidationError(f"{source}: every subject is excluded")

    # the files fMRIPrep wrote beside each run that is read; the rest of func/ is listed as not used
    by_name = {(f.parent, f.name): f for f in others}
    companions: dict[str, dict[str, str]] = {}
    claimed: set[Path] = set()
    for fs in groups.values():
        for f in fs:
            comp = {}
            for role, name in companion_names(f).items():
                c = by_name.get((f.parent, name))
                if c is not None:
                    comp[role.replace("_old", "")] = str(c)
                    claimed.add(c)
            companions[str(f)] = comp
    for f in others:
        if f in claimed:
            continue
        n = f.name
        why = ("brain mask of a run not read" if n.endswith(("_mask.nii.gz", "_mask.nii"))
               else "boldref of a run not read" if "_boldref." in n
               else "confounds of a run not read" if "_desc-confounds_" in n
               else "sidecar of a run not read" if n.endswith("_bold.json")
               else "not a BOLD run (*_bold.nii[.gz])")
        skipped.append((str(f), why))
    return SubjectDiscovery(list(groups.items()), skipped, companions, excluded, filters)



def subject_lengths(source, cleaning, *, filters: dict | None = None, subjects_tsv=None, exclude=()) -> list[int]:
    """Each subject's number of time points at a site, as its loader will count them, from headers alone.

    The same discovery as :func:`find_subjects` (BIDS filters, fMRIPrep's default desc, ``exclude``); each
    run's volumes from its header (a 3-D image refused by :func:`load_image`) and, when ``cleaning`` scrubs,
    the volumes its confounds table keeps. No image data are read.
    """
    def columns(f) -> int:
        n = int(load_image(f).shape[3])
        if not cleaning.confounds:
            return n
        _, kept = run_confounds(f, cleaning, n)
        return n if kept is None else len(kept)

    found = find_subjects(source, filters=filters, subjects_tsv=subjects_tsv, exclude=tuple(exclude),
                          default_desc=cleaning.desc)
    return [sum(columns(f) for f in files) for _, files in found.subjects]


def subject_id_from_path(path) -> str:
    """The person a file belongs to: ``sub-<label>`` for BIDS names, else the name without ``_bold``."""
    ent = bids_entities(path)
    if "sub" in ent and Path(path).name.startswith("sub-"):
        return f"sub-{ent['sub']}"
    name = Path(path).name
    for suffix in (".nii.gz", ".nii"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    if name.endswith("_bold") and len(name) > len("_bold"):
        name = name[: -len("_bold")]
    return name
