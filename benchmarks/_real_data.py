"""Real region-level fMRI for the benchmarks, installed offline from PyPI.

What: regional BOLD time series of the 33 healthy volunteers of the heat-pain
self-regulation study of Woo et al. (2015), OpenNeuro ds000140, TR = 2 s. These
are task runs, not rest: in every run the participant receives repeated 12.5 s
painful heat stimuli. Run 1 is passive, run 3 down-regulation, run 7
up-regulation. 122 regions of the MIST/BASC 122-parcel functional atlas, with
the atlas image in MNI152 space (1 mm, 182 x 218 x 182, FSL grid).

Where from: the pip package ``connattractor`` (PyPI, version 0.1.0, wheel
about 24 MB, Englert, Spisak et al., pni-lab). It ships these series as example
data for its paper. The data sit in a top-level package directory called
``resources/`` next to ``connattractor/`` in site-packages. They are read as
files through the distribution's file list: ``connattractor`` is never
imported, because importing it pulls in seaborn, pingouin and statsmodels. Pip
requirement: ``connattractor==0.1.0``.

Preprocessing (by the package authors, RPN-signature / PUMI pipeline): FSL
mcflirt realignment, AFNI despike, regression of 6 aCompCor components, the
Friston-24 motion terms and a linear trend, and a 0.008-0.08 Hz band-pass. The
BASC-122 atlas is individualised to native space and masked by grey matter,
then voxels are averaged per region. The series are NOT scrubbed. The authors
drop frames with Power framewise displacement (FD) > 0.15 mm and exclude
subjects who lose more than 50 % of frames, so FD comes back with the data.
Values are in arbitrary scanner units, roughly zero mean per run. A few
cerebellar regions (CER7b_l in 16 of the 33 subjects in runs 3/7, CER9_v,
CER7b_m) are identically zero in some runs: they fall outside that subject's
field of view or mask. A global-signal column in the files is dropped here.

File quirk (found while writing this loader): the run-1 files are numbered one
above the participant. ``sub-(k+1)_ts.txt`` holds participant k's run 1
(k = 1..32) and participant 33 has no run-1 file. Connectivity fingerprinting
confirms this: 28 of 32 files match participant k best, against 82 % run-3 to
run-7 identification. Each participant's zero-variance regions also match
across runs. connattractor's own loader reads them with the same offset. Runs
3 and 7 are named correctly. The default here (runs 3 and 7) avoids the issue.
Asking for run 1 applies the correction.

Labels: the package's MIST122_relabeled.tsv names, in series order. Row i of
each series is atlas value i + 1, which is how connattractor paints vectors
into the image. Four names occur twice in that table (PCcor, L_IPlob, PRC_d,
SPlob); the second occurrence gets a "_2" suffix here. Two left/right pairs
look swapped in the names themselves, judged by centroid x (L_FP_l/R_FP_l,
l_PCsul/R_PCsul). The region indices are still right.

Licences: the connattractor package is GPL-3.0-or-later. This module copies
none of its code and only reads its data files at run time. The underlying
data are the public OpenNeuro dataset ds000140 (OpenNeuro publishes under
CC0). The MIST/BASC atlas is by Urchs et al. / Bellec et al. Cite as in
``source["citation"]``.

    from _real_data import load_real_regions   # benchmarks/ on sys.path
    d = load_real_regions()             # 33 subjects x 122 regions x 382 TRs
    d = load_real_regions(runs=(1, 3, 7))
"""

from __future__ import annotations

import importlib.metadata as _md
from pathlib import Path

import numpy as np

PIP_REQUIREMENT = "connattractor==0.1.0"
_DIST = "connattractor"
_TR = 2.0
_N_SUBJECTS = 33
_TASK = "heatpainwithregulationandratings"

CITATION = (
    "Data: Woo C-W, Roy M, Buhle JT, Wager TD (2015). Distinct brain systems mediate the effects of "
    "nociceptive input and self-regulation on pain. PLoS Biology 13(1):e1002036. "
    "doi:10.1371/journal.pbio.1002036 (OpenNeuro ds000140). "
    "Regional series as shared in the connattractor package: Englert R, Kincses B, Kotikalapudi R, "
    "Gallitto G, Li J, Hoffschlag K, Woo C-W, Wager TD, Timmann D, Bingel U, Spisak T. Connectome-based "
    "attractor dynamics underlie brain activity in rest, task, and disease. eLife (reviewed preprint) "
    "98725, doi:10.7554/eLife.98725. "
    "Atlas: Urchs S et al. (2019). MIST: A multi-resolution parcellation of functional brain networks. "
    "MNI Open Research 1:3, doi:10.12688/mniopenres.12767.2; Bellec P et al. (2010). Multi-level "
    "bootstrap analysis of stable clusters in resting-state fMRI. NeuroImage 51(3):1126-1139."
)


def _resource_dir() -> tuple[Path, str]:
    try:
        dist = _md.distribution(_DIST)
    except _md.PackageNotFoundError as exc:
        raise ImportError(
            f"benchmarks.real_data needs the pip package {_DIST!r} (its wheel ships the data): "
            f"pip install '{PIP_REQUIREMENT}'"
        ) from exc
    base = Path(dist.locate_file("resources"))
    if not (base / "MIST122_relabeled.nii.gz").is_file() or not (base / "ex_timeseries_task").is_dir():
        raise ImportError(
            f"{_DIST} {dist.version} is installed but its data files are not at {base}; "
            f"reinstall with: pip install --force-reinstall '{PIP_REQUIREMENT}'"
        )
    return base, dist.version


def _read_table(path: Path) -> tuple[list[str], np.ndarray]:
    with open(path, encoding="utf-8") as fh:
        header = fh.readline().rstrip("\n").split("\t")
    data = np.loadtxt(path, delimiter="\t", skiprows=1, dtype=np.float64, ndmin=2)
    return header, data


def _read_fd(path: Path, n_frames: int) -> np.ndarray:
    # one header line, then FD of frames 2..T (Power); frame 1 gets FD 0, as connattractor does
    vals = np.loadtxt(path, skiprows=1, dtype=np.float64, ndmin=1).ravel()
    fd = np.concatenate(([0.0], vals))
    if fd.size != n_frames:
        raise ValueError(f"{path.name}: {fd.size} FD values for {n_frames} frames")
    return fd


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n]}")
    return out


def _run_files(base: Path, subject: int, run: int) -> tuple[Path, Path] | None:
    d = base / "ex_timeseries_task"
    if run == 1:
        if subject >= _N_SUBJECTS:  # file numbering is shifted by one; participant 33 has no run 1
            return None
        tag = f"sub-{subject + 1:02d}"
        return d / f"{tag}_ts.txt", d / f"{tag}_FD.txt"
    tag = f"sub-{subject:02d}"
    return d / f"{tag}_ts_run_{run:02d}.tsv", d / f"{tag}_FD_run_{run:02d}.txt"


def load_real_regions(runs: tuple[int, ...] = (3, 7), *, standardize_runs: bool = False,
                      load_atlas: bool = True) -> dict:
    """Regional fMRI of the 33 ds000140 participants as shipped by ``connattractor``.

    Parameters
    ----------
    runs : runs to concatenate in time per subject, any of 1, 3, 7 (191 TRs for runs 3
        and 7, 209 for run 1). The default (3, 7) gives every subject 382 TRs.
        With run 1, participant 33 has 209 fewer TRs than the others; with run 1
        alone, participant 33 is left out (32 subjects).
    standardize_runs : z-score each region within each run before concatenation
        (zero-variance regions stay zero). Default False: values as shipped.
    load_atlas : return the MIST-122 label image (nibabel, lazily loaded), else None.

    Returns
    -------
    dict with
        ``series``   list of 33 (32 for runs=(1,)) float64 arrays, regions x time (122 x T_m);
        ``tr``       2.0 (seconds);
        ``labels``   122 region names (duplicates suffixed ``_2``), row order of the series;
        ``atlas``    nibabel Nifti1Image of the labels (value i + 1 = row i), MNI152 1 mm, or None;
        ``source``   dict: package, version, pip requirement, dataset, citation, licence;
        ``subjects`` participant ids ("sub-01" ... "sub-33");
        ``fd``       list of per-subject framewise displacement (mm, Power), length T_m,
                     for scrubbing (the authors drop FD > 0.15 mm);
        ``atlas_values`` integer atlas value of each row (1..122);
        ``runs``     the runs used.
    """
    runs = tuple(int(r) for r in runs)
    if not runs or any(r not in (1, 3, 7) for r in runs) or len(set(runs)) != len(runs):
        raise ValueError(f"runs must be distinct values from (1, 3, 7), got {runs}")
    base, version = _resource_dir()

    with open(base / "MIST122_relabeled.tsv", encoding="utf-8") as fh:
        rows = [line.rstrip("\n").split("\t") for line in fh]
    col = rows[0].index("labels")
    raw_labels = [r[col] for r in rows[1:]]
    n_regions = len(raw_labels)

    series, fds, subjects = [], [], []
    for s in range(1, _N_SUBJECTS + 1):
        parts, fd_parts = [], []
        for run in runs:
            files = _run_files(base, s, run)
            if files is None:
                continue
            header, table = _read_table(files[0])
            if header[0] != "GlobSig" or header[1:] != raw_labels:
                raise ValueError(f"{files[0].name}: columns differ from MIST122_relabeled.tsv")
            x = table[:, 1:].T.copy()  # regions x time, global signal dropped
            if standardize_runs:
                x -= x.mean(axis=1, keepdims=True)
                sd = x.std(axis=1, keepdims=True)
                x = np.divide(x, sd, out=np.zeros_like(x), where=sd > 0)
            parts.append(x)
            fd_parts.append(_read_fd(files[1], x.shape[1]))
        if not parts:  # runs=(1,) and participant 33, who has no run-1 file
            continue
        series.append(np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.float64))
        fds.append(np.concatenate(fd_parts))
        subjects.append(f"sub-{s:02d}")

    atlas = None
    if load_atlas:
        import nibabel as nib

        atlas = nib.load(str(base / "MIST122_relabeled.nii.gz"))

    return {
        "series": series,
        "tr": _TR,
        "labels": _unique(raw_labels),
        "atlas": atlas,
        "source": {
            "package": _DIST,
            "version": version,
            "pip": PIP_REQUIREMENT,
            "dataset": f"OpenNeuro ds000140, task-{_TASK}, runs {', '.join(map(str, runs))}; "
                       f"{n_regions} MIST/BASC regions; TR {_TR} s",
            "citation": CITATION,
            "licence": "package GPL-3.0-or-later (data files read, no code used); "
                       "source data OpenNeuro ds000140 (CC0)",
        },
        "subjects": subjects,
        "fd": fds,
        "atlas_values": list(range(1, n_regions + 1)),
        "runs": runs,
    }
