"""A small fMRIPrep-like derivatives tree, generated (nothing is downloaded), for tests and benchmarks.

Per subject, as fMRIPrep lays it out (``sub-<l>/[ses-<l>/]func/``)::

    sub-01_ses-1_task-rest_run-1_space-MNI152NLin2009cAsym_res-2_desc-preproc_bold.nii.gz   (+ .json, TR)
    sub-01_ses-1_task-rest_run-1_space-MNI152NLin2009cAsym_res-2_desc-brain_mask.nii.gz
    sub-01_ses-1_task-rest_run-1_space-MNI152NLin2009cAsym_res-2_boldref.nii.gz
    sub-01_ses-1_task-rest_run-1_desc-confounds_timeseries.tsv (+ .json)
    sub-01_ses-1_task-rest_run-1_space-MNI152NLin2009cAsym_res-2_desc-smoothAROMAnonaggr_bold.nii.gz
    sub-01_ses-1_task-rest_run-1_space-T1w_desc-preproc_bold.nii.gz          (native space, its own grid)
    ..._hemi-L_space-fsaverage5_bold.func.gii, ..._space-fsLR_den-91k_bold.dtseries.nii  (placeholders)

plus ``anat/`` and ``figures/`` folders and the root's ``dataset_description.json``.

The BOLD runs sit on a 2 mm grid (20 x 24 x 20) that differs from the analysis
grid of :func:`analysis_mask` (4 mm, 10 x 12 x 10), so a site must resample.
Each run is ``maps @ sources + artefact + noise``: a few smooth blobs with
random time courses, and a planted motion artefact: one spatial pattern whose
time course is a fixed mix of the run's six motion parameters (``trans_x`` ..
``rot_z`` in the confounds table), large enough to lead the data's principal
components until the confounds are regressed out. Everything follows from
``random_state``.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

import nibabel as nib
import numpy as np

from dpneuro.privacy import default_rng

SPACE = "MNI152NLin2009cAsym"
#: the input (fMRIPrep) grid: 2 mm, and the analysis grid: 4 mm, over the same field of view (mm)
INPUT_SHAPE, INPUT_AFFINE = (20, 24, 20), np.array([[2.0, 0, 0, -20], [0, 2, 0, -24], [0, 0, 2, -20], [0, 0, 0, 1]])
ANALYSIS_SHAPE, ANALYSIS_AFFINE = (10, 12, 10), np.array([[4.0, 0, 0, -19], [0, 4, 0, -23], [0, 0, 4, -19],
                                                          [0, 0, 0, 1]])
MOTION = ("trans_x", "trans_y", "trans_z", "rot_x", "rot_y", "rot_z")
#: how the planted artefact's time course mixes the motion parameters
ARTEFACT_MIX = np.array([1.0, -0.6, 0.4, 0.8, -0.3, 0.5])


@dataclass
class FmriprepSite:
    """What :func:`write_fmriprep_site` wrote: the root, the runs read by default, and the truth."""

    root: Path
    runs: dict[str, list[Path]]  # subject -> its desc-preproc MNI runs, in BIDS order
    artefact: dict[str, np.ndarray] = field(default_factory=dict)  # run path -> the artefact's time course
    trs: dict[str, float] = field(default_factory=dict)  # run path -> TR


def _coords(shape, affine) -> np.ndarray:
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), -1).reshape(-1, 3)
    return ijk @ affine[:3, :3].T + affine[:3, 3]


def _brain(xyz: np.ndarray) -> np.ndarray:
    """An ellipsoid 'brain' in mm (the same in every grid)."""
    return ((xyz / np.array([17.0, 21.0, 17.0])) ** 2).sum(1) <= 1.0


def analysis_mask(path) -> Path:
    """Write the analysis grid's mask (4 mm, about 500 voxels) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    m = _brain(_coords(ANALYSIS_SHAPE, ANALYSIS_AFFINE)).reshape(ANALYSIS_SHAPE)
    img = nib.Nifti1Image(m.astype(np.uint8), ANALYSIS_AFFINE)
    img.header.set_sform(ANALYSIS_AFFINE, code="mni")
    img.header.set_qform(ANALYSIS_AFFINE, code="mni")
    img.to_filename(path)
    return path


def _smooth_walk(rng, n: int, k: int) -> np.ndarray:
    x = np.cumsum(rng.standard_normal((n, k)), axis=0)
    x -= x.mean(0)
    return x / x.std(0)


def _confounds(rng, motion: np.ndarray, tr: float, power2: bool = True) -> tuple[dict[str, np.ndarray], dict]:
    """An fMRIPrep confounds table (columns nilearn's strategies read) and its JSON sidecar; without ``power2``
    no ``*_power2`` columns, as some fMRIPrep versions write it (the same draws either way)."""
    n = motion.shape[0]
    cols: dict[str, np.ndarray] = {}

    def expand(name, x):
        d = np.r_[np.nan, np.diff(x)]
        cols[name], cols[f"{name}_derivative1"] = x, d
        if power2:
            cols[f"{name}_power2"], cols[f"{name}_derivative1_power2"] = x ** 2, d ** 2

    for name, x in zip(MOTION, (motion * 0.1).T):  # mm / rad scale
        expand(name, x)
    for name in ("csf", "white_matter", "global_signal"):
        expand(name, 100 + rng.standard_normal(n))
    fd = np.r_[np.nan, np.abs(np.diff(motion * 0.1, axis=0)).sum(1)]
    fd[rng.choice(np.arange(10, n - 10), 2, replace=False)] = 0.8  # two motion spikes for scrubbing to censor
    cols["framewise_displacement"] = fd
    cols["std_dvars"] = np.r_[np.nan, 1 + 0.1 * rng.standard_normal(n - 1)]
    cols["dvars"] = np.r_[np.nan, 20 + rng.standard_normal(n - 1)]
    # fMRIPrep's discrete cosine basis for a 128 s high-pass
    t = np.arange(n)
    for k in range(1, max(2, int(np.floor(2 * n * tr / 128))) + 1):
        cols[f"cosine{k - 1:02d}"] = np.sqrt(2 / n) * np.cos(np.pi * (2 * t + 1) * k / (2 * n))
    meta = {}
    for k in range(5):
        cols[f"a_comp_cor_{k:02d}"] = rng.standard_normal(n)
        meta[f"a_comp_cor_{k:02d}"] = {"Method": "aCompCor", "Mask": "combined", "Retained": True,
                                       "SingularValue": 10.0 - k, "VarianceExplained": 0.1,
                                       "CumulativeVarianceExplained": 0.1 * (k + 1)}
    for k in range(3):
        cols[f"t_comp_cor_{k:02d}"] = rng.standard_normal(n)
        meta[f"t_comp_cor_{k:02d}"] = {"Method": "tCompCor", "Retained": True, "SingularValue": 5.0 - k,
                                       "VarianceExplained": 0.1, "CumulativeVarianceExplained": 0.1 * (k + 1)}
    return cols, meta


def _write_tsv(path: Path, cols: dict[str, np.ndarray]) -> None:
    names = list(cols)
    rows = ["\t".join(names)]
    for i in range(len(next(iter(cols.values())))):
        rows.append("\t".join("n/a" if np.isnan(cols[c][i]) else repr(float(cols[c][i])) for c in names))
    path.write_text("\n".join(rows) + "\n")


def _nifti(path: Path, data: np.ndarray, affine, *, tr: float | None = None, mni: bool = True) -> Path:
    img = nib.Nifti1Image(data, affine)
    code = "mni" if mni else "scanner"
    img.header.set_sform(affine, code=code)
    img.header.set_qform(affine, code=code)
    img.header.set_xyzt_units("mm", "sec")
    if tr is not None:
        img.header.set_zooms(img.header.get_zooms()[:3] + (tr,))
    img.to_filename(path)
    return path


def write_fmriprep_site(root, *, n_subjects: int = 3, n_volumes: int = 80, tr: float = 2.0, random_state=0,
                        multi_run: bool = True, trs: dict[str, float] | None = None, extra_res: bool = False,
                        n_sources: int = 3, artefact_amplitude: float = 4.0, noise: float = 1.0,
                        corrupt: tuple[str, ...] = (), power2: bool = True) -> FmriprepSite:
    """Write a site's fMRIPrep derivatives (see the module notes) under ``root``; returns what it wrote.

    multi_run : sub-01 gets two runs in ses-1 and one in ses-2 (one person, three runs)
    trs : per-subject TR overriding ``tr`` (e.g. ``{"sub-02": 1.5}``)
    extra_res : also write each MNI run at ``res-3`` (a 3 mm copy: the same run twice unless filtered by res)
    corrupt : subjects whose desc-preproc runs are truncated gzip files
    power2 : False: confounds tables without the ``*_power2`` columns (as some fMRIPrep versions write them; the
        data are the same)
    random_state : None, int or numpy Generator (used as it is)
    """
    root = Path(root)
    rng = default_rng(random_state)
    root.mkdir(parents=True, exist_ok=True)
    (root / "dataset_description.json").write_text(json.dumps({
        "Name": "fMRIPrep - synthetic", "BIDSVersion": "1.8.0", "DatasetType": "derivative",
        "GeneratedBy": [{"Name": "fMRIPrep", "Version": "23.2.1"}]}))
    xyz = _coords(INPUT_SHAPE, INPUT_AFFINE)
    brain = _brain(xyz)
    centres = rng.uniform(-10, 10, (n_sources, 3))
    maps = np.exp(-((xyz[:, None, :] - centres[None]) ** 2).sum(-1) / (2 * 5.0 ** 2)) * brain[:, None]
    # the artefact: a ramp across the brain (as head motion gives at edges and along the motion axis)
    art_map = (xyz[:, 0] / 17.0 + 0.5 * xyz[:, 2] / 17.0) * brain
    site = FmriprepSite(root=root, runs={})
    for s in range(1, n_subjects + 1):
        sub = f"sub-{s:02d}"
        run_tr = (trs or {}).get(sub, tr)
        layout = ([("ses-1", "run-1"), ("ses-1", "run-2"), ("ses-2", "run-1")] if multi_run and s == 1
                  else [(None, None)])
        (root / f"{sub}.html").write_text("<html>fMRIPrep report</html>")
        anat = root / sub / "anat"
        anat.mkdir(parents=True, exist_ok=True)
        _nifti(anat / f"{sub}_desc-preproc_T1w.nii.gz", rng.random((10, 12, 10)).astype(np.float32), np.eye(4),
               mni=False)
        _nifti(anat / f"{sub}_desc-brain_mask.nii.gz", np.ones((10, 12, 10), np.uint8), np.eye(4), mni=False)
        (anat / f"{sub}_from-{SPACE}_to-T1w_mode-image_xfm.h5").write_bytes(b"\x89HDF\r\n")
        figs = root / sub / "figures"
        figs.mkdir(parents=True, exist_ok=True)
        (figs / f"{sub}_task-rest_desc-carpetplot_bold.svg").write_text("<svg/>")
        site.runs[sub] = []
        tasks = ["rest", "motor"] if s == 2 else ["rest"]
        for ses, run in layout:
            for task in tasks:
                func = root / sub / (ses or "") / "func"
                func.mkdir(parents=True, exist_ok=True)
                stem = "_".join(x for x in (sub, ses, f"task-{task}", run) if x)
                n = n_volumes
                motion = _smooth_walk(rng, n, 6)
                sources = rng.standard_normal((n_sources, n))
                art_tc = motion @ ARTEFACT_MIX
                art_tc = art_tc / art_tc.std()
                vol = (maps @ sources + artefact_amplitude * np.outer(art_map, art_tc)
                       + noise * rng.standard_normal((xyz.shape[0], n)))
                vol = (100.0 * brain[:, None] + vol * brain[:, None]).astype(np.float32).reshape(INPUT_SHAPE + (n,))
                cols, meta = _confounds(rng, motion, run_tr, power2)
                _write_tsv(func / f"{stem}_desc-confounds_timeseries.tsv", cols)
                (func / f"{stem}_desc-confounds_timeseries.json").write_text(json.dumps(meta))
                ress = ["2", "3"] if extra_res else ["2"]
                for res in ress:
                    pre = f"{stem}_space-{SPACE}_res-{res}"
                    data, aff = vol, INPUT_AFFINE
                    if res == "3":  # a coarser copy: every other voxel along each axis
                        data, aff = vol[::2, ::2, ::2], INPUT_AFFINE @ np.diag([2, 2, 2, 1])
                    bold = _nifti(func / f"{pre}_desc-preproc_bold.nii.gz", data, aff, tr=run_tr)
                    (func / f"{pre}_desc-preproc_bold.json").write_text(json.dumps(
                        {"RepetitionTime": run_tr, "SkullStripped": False, "TaskName": task}))
                    _nifti(func / f"{pre}_desc-brain_mask.nii.gz", (data[..., 0] > 0).astype(np.uint8), aff)
                    _nifti(func / f"{pre}_boldref.nii.gz", data.mean(-1), aff)
                    if res == "2":
                        if task == "rest":
                            site.runs[sub].append(bold)
                        site.artefact[str(bold)] = art_tc
                        site.trs[str(bold)] = run_tr
                        # ICA-AROMA's copy of the same run: the same person's data a second time if counted
                        _nifti(func / f"{pre}_desc-smoothAROMAnonaggr_bold.nii.gz", data, aff, tr=run_tr)
                    if sub in corrupt:
                        raw = bold.read_bytes()
                        bold.write_bytes(raw[: len(raw) // 2])
                # native space: fMRIPrep's T1w output of the same run, on the subject's own grid
                t1 = vol[2:-2:2, 2:-2:2, 2:-2:2]
                _nifti(func / f"{stem}_space-T1w_desc-preproc_bold.nii.gz", t1, np.eye(4), tr=run_tr, mni=False)
                _nifti(func / f"{stem}_space-T1w_desc-brain_mask.nii.gz", (t1[..., 0] > 0).astype(np.uint8),
                       np.eye(4), mni=False)
                (func / f"{stem}_hemi-L_space-fsaverage5_bold.func.gii").write_text("<GIFTI/>")
                with gzip.open(func / f"{stem}_space-fsLR_den-91k_bold.dtseries.nii", "wb") as f:
                    f.write(b"not read")
    return site
