"""A site's speed on fMRIPrep outputs at 2 mm: dpneuro's load, site voxel maps and whole run against the I/O floor,
nibabel, nilearn's NiftiLabelsMasker and CanICA.

Data (the default part, ``fmriprep``): an fMRIPrep-like derivatives tree, generated here (nothing downloaded):
3 sites x 5 subjects, one resting-state run each of 100-150 volumes (about 1,870 volumes), TR 2 s, on the
MNI152NLin2009cAsym ``res-2`` grid (97 x 115 x 97, 2 mm, as fMRIPrep writes it), float32 gzip NIfTI, with each
run's JSON sidecar, brain mask, boldref and confounds table (``dpneuro.datasets.fmriprep``'s columns: motion and
derivatives, WM/CSF/global, cosines, CompCor). ``dpneuro.datasets.fmriprep.write_fmriprep_site`` writes the same
names but on a 20 x 24 x 20 toy grid, hence this generator. Each run: a head (the nilearn MNI152 brain mask
dilated by 10 mm, intensity 300 + noise), the brain at 1000 + 8 planted networks + noise (sd 10); the networks are
the shipped Schaefer 2018 atlas's 7 networks and a cerebellar blob, smoothed (sd 3 mm), each with a smooth random
time course of amplitude 6 per run.

Setup: each measurement runs in a fresh process (its own peak RSS: Linux VmHWM, or the largest child's ru_maxrss
for a command it starts); the cheap rows (floor, nibabel) are the median of 2 repetitions, the others run once.
Every row reads the files warm from the page cache (they were just written). Rows:

1. ``gzip -dc`` of every run to /dev/null: the I/O floor (one process, one core); GNU gzip inflates more slowly
   than zlib, so also Python's ``gzip`` module reading every run through (zlib, nothing kept);
2. nibabel: every run loaded to float32 (``get_fdata(dtype=float32)``), one after the other;
3. nilearn ``NiftiLabelsMasker`` with the real-data settings (``dpneuro.config.REAL_DATA_SETTINGS``): the shipped
   Schaefer 200 atlas, 6 mm smoothing (on the 2 mm data), confounds from ``load_confounds_strategy("simple")``,
   z-scored, every run;
4. nilearn ``CanICA(n_components=8, smoothing_fwhm=6)``, its other settings at their defaults (10 FastICA starts,
   threshold "auto"), on every run with the same "simple" confounds; mask: dpneuro's analysis grid, nilearn's
   MNI152 brain mask at 6 mm (``--canica-mask default``: CanICA computes its own at 2 mm);
5. ``dpneuro run`` on a run TOML made from ``site_templates/fmriprep.toml`` (what a site copies: its atlas,
   smoothing, confounds, BIDS filter) for the 3 sites, ``n_components = 8``, ``epsilon = 4``, ``seed = 0``, once
   with ``site_voxel_maps = false`` and once with the defaults (each site's voxel maps). Pydra's ``serial``
   plugin (``--plugin``), so the stages' seconds (run.json ``timings_s``) add up to the wall time and the load of
   each site is its own (each site still decodes its subjects in parallel threads); wall time of the command
   (imports included), per-stage seconds, peak RSS and the ICA's convergence status (``ica_status``).

Ratios: dpneuro's load (sum over the sites) / the floor (and / the zlib floor), the sites' voxel maps / the load (the default run), and
dpneuro's default run / CanICA (process wall times). Agreement: mean matched |r| (Hungarian) over the analysis
mask's voxels between dpneuro's maps (the consortium's, and each site's own voxel maps averaged over sites) and
CanICA's (thresholded as it returns them; and dpneuro's thresholded the same way), and of each with the planted
networks; later changes should be no worse.

Part ``real``: the 33 real people of ``benchmarks/canica_agreement.py`` (connattractor's ds000140 series painted
into the MIST atlas on the 6 mm grid, one NIfTI per person, 4 site folders): ``dpneuro.DecentralizedICA()`` with
the product's defaults (private, report and site voxel maps included) against ``CanICA()`` with its defaults
(both 20 components) but for the mask (its own, "epi", is empty on z-scored series: dpneuro's default grid's,
nilearn's MNI152 mask at 6 mm), one after the other in the same process, wall seconds and their ratio.

    python benchmarks/site_speed.py                  # the fMRIPrep part: ~30 min on 2 cores
    python benchmarks/site_speed.py --quick          # 3 sites x 2 subjects x 40 volumes, one CanICA start: < 3 min
    python benchmarks/site_speed.py --part real      # the 33 real people (--quick: 8 of them, one CanICA start)
    python benchmarks/site_speed.py --data DIR --out DIR   # keep / reuse the generated tree; results elsewhere

(--quick: 3 sites, not 2, because CAPE needs at least 3.) Writes ``site_speed[_quick].{json,csv}`` (part real:
``site_speed_real[_quick].{json,csv}``) in benchmarks/results (or ``--out``); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
RESULTS = HERE.parent / "results"
sys.path.insert(0, str(HERE.parent))

SPACE = "MNI152NLin2009cAsym"
#: fMRIPrep's res-2 grid of MNI152NLin2009cAsym (TemplateFlow's tpl-MNI152NLin2009cAsym_res-02)
GRID_SHAPE = (97, 115, 97)
GRID_AFFINE = np.array([[2.0, 0, 0, -96], [0, 2, 0, -132], [0, 0, 2, -78], [0, 0, 0, 1]])
TR = 2.0
N_COMPONENTS, EPSILON, SEED = 8, 4.0, 0
#: (sites, subjects per site, lowest and highest volumes per run)
SIZES = {"full": (3, 5, 100, 150), "quick": (3, 2, 40, 40)}
TEMPLATE_TOML = ROOT / "site_templates" / "fmriprep.toml"
#: the measurements in table order: key -> (label, cheap: repeated)
ROWS = {
    "floor": ("gzip -dc of every run (I/O floor)", True),
    "floor_zlib": ("Python zlib: every run decompressed, nothing kept", True),
    "nibabel": ("nibabel: every run to float32", True),
    "masker": ("nilearn NiftiLabelsMasker (Schaefer 200, 6 mm, confounds simple)", False),
    "canica": ("nilearn CanICA (8 components, 6 mm)", False),
    "dpneuro_no_site_maps": ("dpneuro run, site_voxel_maps = false", False),
    "dpneuro_default": ("dpneuro run (defaults: each site's voxel maps)", False),
}
#: run.json's stage names (dpneuro.report.timings.label) -> the table's stages
STAGES = (("space", "space"), ("load", "load"), ("reduce", "reduce"), ("unmix", "unmix"), ("static FNC", "fnc"),
          ("maps and privacy", "maps"), ("time courses", "timecourses"), ("site voxel maps", "site_maps"),
          ("report", "report"))
STAGE_KEYS = [k for _, k in STAGES] + ["other"]


def log(msg: str) -> None:
    print(f"[site_speed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# the data
# ---------------------------------------------------------------------------------------------------------------

def _grid_xyz() -> np.ndarray:
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in GRID_SHAPE], indexing="ij"), -1).reshape(-1, 3)
    return (ijk @ GRID_AFFINE[:3, :3].T + GRID_AFFINE[:3, 3]).reshape(GRID_SHAPE + (3,))


def brain_and_networks() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The brain (nilearn's MNI152 mask on the grid), the head around it, and the planted networks (K x grid)."""
    import nibabel as nib
    from nilearn.datasets import load_mni152_brain_mask
    from nilearn.image import resample_img
    from scipy.ndimage import binary_dilation, gaussian_filter

    from dpneuro.data.atlases import FUNCTIONAL, fetch, shipped_networks

    def on_grid(img):
        return np.asarray(resample_img(img, target_affine=GRID_AFFINE, target_shape=GRID_SHAPE,
                                       interpolation="nearest", force_resample=True, copy_header=True).dataobj)

    brain = on_grid(load_mni152_brain_mask(resolution=2)) > 0
    head = binary_dilation(brain, iterations=5)
    labels = on_grid(nib.load(fetch(FUNCTIONAL))).astype(np.int64)
    nets = shipped_networks()
    maps = [np.isin(labels, [k for k, v in nets.items() if v[1] == name]).astype(np.float32)
            for name in sorted({v[1] for v in nets.values()})]
    maps.append(np.exp(-((_grid_xyz() - np.array([0.0, -62, -38])) ** 2).sum(-1) / (2 * 10.0 ** 2)))  # cerebellum
    maps = np.stack([gaussian_filter(np.asarray(m, np.float32), sigma=1.5) * brain for m in maps])
    return brain, head, maps / maps.reshape(len(maps), -1).max(1)[:, None, None, None]


def _nifti(path: Path, data, *, tr: float | None = None) -> Path:
    import nibabel as nib

    img = nib.Nifti1Image(data, GRID_AFFINE)
    img.header.set_sform(GRID_AFFINE, code="mni")
    img.header.set_qform(GRID_AFFINE, code="mni")
    img.header.set_xyzt_units("mm", "sec")
    if tr is not None:
        img.header.set_zooms(img.header.get_zooms()[:3] + (tr,))
    img.to_filename(path)
    return path


def write_tree(root: Path, size: str) -> dict:
    """The fMRIPrep-like tree (module notes) under ``root``, or the one already there; its manifest."""
    manifest_path = root / "manifest.json"
    n_sites, n_sub, lo, hi = SIZES[size]
    if manifest_path.exists():
        m = json.loads(manifest_path.read_text())
        if m.get("size") == size and all(Path(r).exists() for r in m["runs"]):
            log(f"reusing the tree in {root} ({m['volumes']} volumes, {m['bytes'] / 2**30:.2f} GiB)")
            return m
    from dpneuro.datasets.fmriprep import _confounds, _smooth_walk, _write_tsv

    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    brain, head, maps = brain_and_networks()
    _nifti(root / "planted_networks.nii.gz", np.moveaxis(maps, 0, -1).astype(np.float32))
    shell = head & ~brain
    maps_in = maps[:, brain].T  # V x K
    rng = np.random.default_rng(0)
    lengths = rng.integers(lo, hi + 1, n_sites * n_sub)
    sites, runs = {}, []
    for s in range(n_sites):
        site = root / f"site-{s + 1:02d}"
        site.mkdir(exist_ok=True)
        sites[site.name] = str(site)
        (site / "dataset_description.json").write_text(json.dumps({
            "Name": "fMRIPrep - synthetic (benchmarks/site_speed.py)", "BIDSVersion": "1.8.0",
            "DatasetType": "derivative", "GeneratedBy": [{"Name": "fMRIPrep", "Version": "23.2.1"}]}))
        for j in range(n_sub):
            n = int(lengths[s * n_sub + j])
            sub = f"sub-{j + 1:02d}"
            func = site / sub / "func"
            func.mkdir(parents=True, exist_ok=True)
            stem = f"{sub}_task-rest"
            pre = f"{stem}_space-{SPACE}_res-2"
            # smooth random time courses (AR(1), 0.8), amplitude 6 (0.6 % of the brain's 1000)
            tc = np.zeros((N_COMPONENTS, n))
            e = rng.standard_normal((N_COMPONENTS, n))
            for t in range(n):
                tc[:, t] = (0.8 * tc[:, t - 1] if t else 0) + e[:, t]
            tc = 6.0 * (tc - tc.mean(1, keepdims=True)) / tc.std(1, keepdims=True)
            vol = np.zeros(GRID_SHAPE + (n,), np.float32)
            vol[brain] = (1000.0 + (maps_in @ tc).astype(np.float32)
                          + 10.0 * rng.standard_normal((maps_in.shape[0], n), dtype=np.float32))
            vol[shell] = 300.0 + 10.0 * rng.standard_normal((int(shell.sum()), n), dtype=np.float32)
            bold = _nifti(func / f"{pre}_desc-preproc_bold.nii.gz", vol, tr=TR)
            (func / f"{pre}_desc-preproc_bold.json").write_text(json.dumps(
                {"RepetitionTime": TR, "SkullStripped": False, "TaskName": "rest"}))
            _nifti(func / f"{pre}_desc-brain_mask.nii.gz", brain.astype(np.uint8))
            _nifti(func / f"{pre}_boldref.nii.gz", vol.mean(-1))
            del vol
            cols, meta = _confounds(rng, _smooth_walk(rng, n, 6), TR)
            _write_tsv(func / f"{stem}_desc-confounds_timeseries.tsv", cols)
            (func / f"{stem}_desc-confounds_timeseries.json").write_text(json.dumps(meta))
            runs.append(str(bold))
            log(f"wrote {site.name}/{sub}: {n} volumes, {bold.stat().st_size / 2**20:.0f} MiB")
    m = {"size": size, "sites": sites, "runs": runs, "volumes": int(lengths.sum()),
         "volumes_per_run": [int(x) for x in lengths], "grid": list(GRID_SHAPE), "voxel_mm": 2.0,
         "brain_voxels": int(brain.sum()), "head_voxels": int(head.sum()),
         "bytes": sum(Path(r).stat().st_size for r in runs), "planted": str(root / "planted_networks.nii.gz"),
         "write_s": time.perf_counter() - t0}
    manifest_path.write_text(json.dumps(m, indent=1))
    log(f"wrote {len(runs)} runs, {m['volumes']} volumes, {m['bytes'] / 2**30:.2f} GiB in {m['write_s']:.0f} s")
    return m


def run_toml(path: Path, sites: dict[str, str], out: Path, site_voxel_maps: bool) -> Path:
    """site_templates/fmriprep.toml's settings for these sites, n_components 8, epsilon 4, seed 0."""
    from dpneuro.config import toml_value

    cfg = {k: v for k, v in tomllib.loads(TEMPLATE_TOML.read_text()).items()
           if k not in ("sites", "out", "exchange_dir")}
    # a speed measure: the small consortia it times would stop before their first release (no component)
    cfg.update(out=str(out), n_components=N_COMPONENTS, epsilon=EPSILON, seed=SEED, allow_noise_maps=True)
    if not site_voxel_maps:
        cfg["site_voxel_maps"] = False
    lines = [f"# benchmarks/site_speed.py: {TEMPLATE_TOML.name}'s settings"] + \
        [f"{k} = {toml_value(v)}" for k, v in cfg.items()]
    for name, p in sites.items():
        lines += ["", "[[sites]]", f"name = {toml_value(name)}", f"path = {toml_value(p)}"]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------------
# the measurements, each in its own process (--child)
# ---------------------------------------------------------------------------------------------------------------

def _status_kib(key: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{key}:")[1].split()[0])


def _self_peak_mb() -> float:
    try:
        return _status_kib("VmHWM") / 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _children_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def row_floor(spec: dict) -> dict:
    t0 = time.perf_counter()
    subprocess.run(["gzip", "-dc", *spec["runs"]], stdout=subprocess.DEVNULL, check=True)
    return {"work_s": time.perf_counter() - t0, "peak_rss_mb": _children_peak_mb(), "rss_of": "gzip"}


def row_floor_zlib(spec: dict) -> dict:
    import gzip

    t0 = time.perf_counter()
    for f in spec["runs"]:
        with gzip.open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    return {"work_s": time.perf_counter() - t0}


def row_nibabel(spec: dict) -> dict:
    import nibabel as nib

    t0 = time.perf_counter()
    n = 0
    for f in spec["runs"]:
        a = nib.load(f).get_fdata(dtype=np.float32)
        n += a.shape[3]
        del a
    return {"work_s": time.perf_counter() - t0, "volumes": n}


def _confounds_simple(f: str):
    from nilearn.interfaces.fmriprep import load_confounds_strategy

    return load_confounds_strategy(f, denoise_strategy=spec_settings()["confounds"])


def spec_settings() -> dict:
    from dpneuro.config import REAL_DATA_SETTINGS

    return REAL_DATA_SETTINGS


def row_masker(spec: dict) -> dict:
    from nilearn.maskers import NiftiLabelsMasker

    from dpneuro.data.atlases import fetch

    s = spec_settings()
    t0 = time.perf_counter()
    masker = NiftiLabelsMasker(labels_img=fetch(s["atlas"]), smoothing_fwhm=s["smoothing_fwhm"],
                               standardize="zscore_sample", t_r=TR).fit(spec["runs"][0])  # every run's grid
    n = 0
    for f in spec["runs"]:
        conf, sample_mask = _confounds_simple(f)
        n += masker.transform(f, confounds=conf, sample_mask=sample_mask).shape[0]
    return {"work_s": time.perf_counter() - t0, "volumes": n}


def row_canica(spec: dict) -> dict:
    from nilearn.decomposition import CanICA

    t0 = time.perf_counter()
    confounds = [_confounds_simple(f)[0] for f in spec["runs"]]
    ica = CanICA(n_components=N_COMPONENTS, smoothing_fwhm=spec_settings()["smoothing_fwhm"],
                 mask=spec["canica_mask"] or None, n_init=spec["canica_n_init"], random_state=0, n_jobs=1)
    ica.fit(spec["runs"], confounds=confounds)
    seconds = time.perf_counter() - t0
    ica.components_img_.to_filename(spec["canica_maps"])
    return {"work_s": seconds, "n_init": spec["canica_n_init"]}


def ica_status(run: dict) -> str:
    """The consortium's spatial ICA and each site's guided ICA (its voxel maps), as run.json records them."""
    sites = {k: v for k, v in (run.get("site_maps_ica") or {}).items() if v}
    if not sites:
        return run.get("ica_status", "")
    done = [v["n_iter"] for v in sites.values() if v["status"] == "converged"]
    return (f"{run.get('ica_status', '')}; site maps {len(done)} of {len(sites)} converged"
            + (f" (at most {max(done)} of {next(iter(sites.values()))['max_iter']} iterations)" if done else ""))


def _dpneuro_row(spec: dict, key: str) -> dict:
    toml, out = spec["toml"][key], Path(spec["dpneuro_out"][key])
    shutil.rmtree(out, ignore_errors=True)  # a fresh output folder: no cached stages
    cmd = [sys.executable, "-m", "dpneuro.cli", "run", toml, "--plugin", spec["plugin"], "-q"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    run = json.loads((out / "dpneuro" / "run.json").read_text())
    return {"work_s": seconds, "peak_rss_mb": _children_peak_mb(), "rss_of": "dpneuro run",
            "timings_s": run["timings_s"], "ica_status": ica_status(run),
            "ica_rounds_run": run.get("ica_rounds_run"), "run_dir": str(out / "dpneuro"),
            "warnings": run.get("warnings", [])}


CHILD = {"floor": row_floor, "floor_zlib": row_floor_zlib, "nibabel": row_nibabel, "masker": row_masker, "canica": row_canica,
         "dpneuro_no_site_maps": lambda s: _dpneuro_row(s, "dpneuro_no_site_maps"),
         "dpneuro_default": lambda s: _dpneuro_row(s, "dpneuro_default")}


def child(row: str, spec_path: str, out_path: str) -> None:
    import warnings

    warnings.simplefilter("ignore")  # nilearn's notes on resampling, once per run
    spec = json.loads(Path(spec_path).read_text())
    res = CHILD[row](spec)
    res.setdefault("peak_rss_mb", _self_peak_mb())
    res.setdefault("rss_of", "this process")
    Path(out_path).write_text(json.dumps(res, default=str))


def measure(row: str, spec_path: Path, tmp: Path, reps: int) -> dict:
    """``reps`` fresh processes of one row: the median of the times, the largest peak RSS."""
    got = []
    for i in range(reps):
        out = tmp / f"{row}_{i}.json"
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(HERE), "--child", row, str(spec_path), str(out)], check=True)
        wall = time.perf_counter() - t0
        got.append({**json.loads(out.read_text()), "process_s": wall, "loadavg_before": load})
        log(f"{row} {i + 1}/{reps}: {wall:.1f} s (work {got[-1]['work_s']:.1f} s), "
            f"peak RSS {got[-1]['peak_rss_mb']:.0f} MB ({got[-1]['rss_of']})")
    res = dict(got[-1])
    res.update(label=ROWS[row][0], reps=reps, process_s=statistics.median(g["process_s"] for g in got),
               work_s=statistics.median(g["work_s"] for g in got), peak_rss_mb=max(g["peak_rss_mb"] for g in got),
               process_s_each=[g["process_s"] for g in got], work_s_each=[g["work_s"] for g in got],
               loadavg_before=[g["loadavg_before"] for g in got])
    if "timings_s" in res:
        res["stages_s"] = stage_seconds(res["timings_s"])
    return res


def stage_seconds(timings: dict[str, float]) -> dict[str, float]:
    """run.json's timings grouped into the table's stages (a site's stages summed over the sites)."""
    out = dict.fromkeys(STAGE_KEYS, 0.0)
    for name, s in timings.items():
        key = next((k for prefix, k in STAGES if name.startswith(prefix)), "other")
        out[key] += float(s)
    return out


# ---------------------------------------------------------------------------------------------------------------
# agreement of the maps
# ---------------------------------------------------------------------------------------------------------------

def agreement(run_dir: Path, canica_maps: Path, planted: Path, other_run: Path | None = None) -> dict:
    """Mean matched |r| over the analysis mask's voxels: dpneuro's maps (consortium, each site's) against CanICA's
    and against the planted networks."""
    import nibabel as nib
    from canica_agreement import canica_threshold
    from frontier import mean_r
    from nilearn.image import resample_to_img

    from dpneuro.data.images import load_space

    dp_img = nib.load(run_dir / "components.nii.gz")
    mask, affine = load_space("mni6mm")
    if dp_img.shape[:3] != mask.shape or not np.allclose(dp_img.affine, affine):
        mask = np.any(np.asarray(dp_img.dataobj) != 0, axis=-1)

    def on_grid(path) -> np.ndarray:
        img = resample_to_img(nib.load(path), dp_img, interpolation="continuous", force_resample=True,
                              copy_header=True)
        return np.asarray(img.dataobj, np.float64)[mask]

    dp, can, truth = np.asarray(dp_img.dataobj, np.float64)[mask], on_grid(canica_maps), on_grid(planted)
    sites = sorted((run_dir / "site_maps").glob("*.nii.gz")) if (run_dir / "site_maps").exists() else []
    out = {"voxels": int(mask.sum()), "dpneuro_vs_canica": mean_r(dp, can),
           "dpneuro_thresholded_vs_canica": mean_r(canica_threshold(dp), can),
           "dpneuro_vs_planted": mean_r(dp, truth), "canica_vs_planted": mean_r(can, truth)}
    if sites:
        per = {p.name.split(".")[0]: on_grid(p) for p in sites}
        out["site_maps_vs_canica"] = float(np.mean([mean_r(v, can) for v in per.values()]))
        out["site_maps_vs_planted"] = float(np.mean([mean_r(v, truth) for v in per.values()]))
    if other_run is not None and (other_run / "components.nii.gz").exists():
        other = np.asarray(nib.load(other_run / "components.nii.gz").dataobj, np.float64)[mask]
        out["consortium_maps_without_vs_with_site_maps"] = mean_r(other, dp)
    return out


# ---------------------------------------------------------------------------------------------------------------
# the parts
# ---------------------------------------------------------------------------------------------------------------

def git_state() -> dict:
    def git(*a):
        p = subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD"), "diff_stat": git("diff", "--stat")}


def machine() -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(), "loadavg_start": os.getloadavg()[0]}


def ratio(a, b) -> float:
    return float(a) / float(b) if a is not None and b else float("nan")


def part_fmriprep(args, tmp: Path) -> tuple[list[dict], dict]:
    size = "quick" if args.quick else "full"
    data = Path(args.data) if args.data else tmp / "data"
    m = write_tree(data, size)
    import nibabel as nib

    from dpneuro.data.images import load_space

    mask6 = tmp / "mni6mm_mask.nii.gz"
    mask, affine = load_space("mni6mm")
    nib.Nifti1Image(mask.astype(np.uint8), affine).to_filename(mask6)
    spec = {"runs": m["runs"], "canica_mask": "" if args.canica_mask == "default" else str(mask6),
            "canica_n_init": 1 if args.quick else 10, "canica_maps": str(tmp / "canica_maps.nii.gz"),
            "plugin": args.plugin, "toml": {}, "dpneuro_out": {}}
    for key, maps in (("dpneuro_no_site_maps", False), ("dpneuro_default", True)):
        spec["dpneuro_out"][key] = str(tmp / key)
        spec["toml"][key] = str(run_toml(tmp / f"{key}.toml", m["sites"], tmp / key, maps))
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    rows = {}
    for row in args.rows:
        rows[row] = measure(row, spec_path, tmp, args.reps if ROWS[row][1] else 1)
    floor, can = rows.get("floor", {}), rows.get("canica", {})
    dflt, nomaps = rows.get("dpneuro_default", {}), rows.get("dpneuro_no_site_maps", {})
    st = dflt.get("stages_s", {})
    ratios = {"load_over_floor": ratio(st.get("load"), floor.get("work_s")),
              "site_maps_over_load": ratio(st.get("site_maps"), st.get("load")),
              "dpneuro_default_over_canica": ratio(dflt.get("process_s"), can.get("process_s")),
              "dpneuro_no_site_maps_over_canica": ratio(nomaps.get("process_s"), can.get("process_s")),
              "load_over_zlib_floor": ratio(st.get("load"), rows.get("floor_zlib", {}).get("work_s")),
              "nibabel_over_floor": ratio(rows.get("nibabel", {}).get("work_s"), floor.get("work_s")),
              "masker_over_floor": ratio(rows.get("masker", {}).get("work_s"), floor.get("work_s")),
              "load_no_site_maps_over_floor": ratio(nomaps.get("stages_s", {}).get("load"), floor.get("work_s"))}
    agree = {}
    if dflt and can:
        agree = agreement(Path(dflt["run_dir"]), Path(spec["canica_maps"]), Path(m["planted"]),
                          Path(nomaps["run_dir"]) if nomaps else None)
    meta = {"part": "fmriprep", "quick": args.quick, "data": {k: v for k, v in m.items() if k != "runs"},
            "n_sites": len(m["sites"]), "subjects_per_site": SIZES[size][1], "runs": len(m["runs"]),
            "n_components": N_COMPONENTS, "epsilon": EPSILON, "seed": SEED, "plugin": args.plugin,
            "canica_mask": args.canica_mask, "canica_n_init": spec["canica_n_init"],
            "settings": spec_settings(), "run_toml": Path(spec["toml"]["dpneuro_default"]).read_text(),
            "rows": rows, "ratios": ratios, "agreement": agree}
    return [table_row(k, r) for k, r in rows.items()], meta


def table_row(key: str, r: dict) -> dict:
    return {"row": key, "label": r["label"], "reps": r["reps"], "process_s": r["process_s"], "work_s": r["work_s"],
            "peak_rss_mb": r["peak_rss_mb"], "ica_status": r.get("ica_status", ""),
            **{f"{k}_s": r.get("stages_s", {}).get(k, "") for k in STAGE_KEYS}}


def part_real(args, tmp: Path) -> tuple[list[dict], dict]:
    import warnings

    import nibabel as nib
    from canica_agreement import write_consortium
    from frontier import mean_r
    from nilearn.decomposition import CanICA
    from real_frontier import atlas_on_grid, real_subjects

    import dpneuro
    from dpneuro.data.images import load_space

    d, runs = real_subjects()
    if args.quick:
        runs = runs[:8]
    labels, affine = atlas_on_grid(d["atlas"])
    sites, _ = write_consortium(tmp / "real", runs, labels, affine, 4)
    files = [f for fs in sites.values() for f in fs]
    log(f"real: {len(runs)} people in {len(sites)} site folders")
    t = time.perf_counter()
    ica = dpneuro.DecentralizedICA(out=str(tmp / "real_run")).fit(sites)
    dp_s = time.perf_counter() - t
    log(f"real: DecentralizedICA() {dp_s:.1f} s")
    # CanICA's own mask ("epi") is empty on these z-scored series: it gets dpneuro's default grid's mask
    space_mask, space_affine = load_space(ica.config_.space)
    mask_img = nib.Nifti1Image(space_mask.astype(np.uint8), space_affine)
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        can = CanICA(mask=mask_img, random_state=0, **({"n_init": 1} if args.quick else {})).fit(files)
    can_s = time.perf_counter() - t
    log(f"real: CanICA() {can_s:.1f} s")
    run = json.loads((Path(ica.output_dir_) / "run.json").read_text())
    mask = space_mask
    agree = float("nan")
    if ica.components_.shape[1] == int(mask.sum()):
        agree = mean_r(ica.components_.T, np.asarray(can.components_img_.dataobj, np.float64)[mask])
    rows = [{"method": "dpneuro DecentralizedICA() (defaults)", "seconds": dp_s,
             "n_components": int(ica.components_.shape[0]), "ica_status": ica_status(run)},
            {"method": "nilearn CanICA() (defaults)", "seconds": can_s, "n_components": int(can.n_components),
             "ica_status": ""}]
    meta = {"part": "real", "quick": args.quick, "data": d["source"], "people": len(runs), "n_sites": len(sites),
            "canica_n_init": 1 if args.quick else 10, "canica_mask": f"{ica.config_.space} (dpneuro's default grid)",
            "rows": rows, "dpneuro_timings_s": run["timings_s"],
            "dpneuro_stages_s": stage_seconds(run["timings_s"]),
            "ratios": {"dpneuro_default_over_canica": dp_s / can_s}, "agreement": {"dpneuro_vs_canica": agree}}
    return rows, meta


def print_tables(rows: list[dict], meta: dict) -> None:
    if meta["part"] == "real":
        print("| method | seconds | components | ICA status |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['method']} | {r['seconds']:.1f} | {r['n_components']} | {r['ica_status']} |")
        print(f"\ndpneuro / CanICA: {meta['ratios']['dpneuro_default_over_canica']:.2f}; "
              f"agreement (mean matched |r|): {meta['agreement']['dpneuro_vs_canica']:.3f}")
        return
    print("| measurement | repetitions | wall s (process) | work s | peak RSS MB | ICA status |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['reps']} | {r['process_s']:.1f} | {r['work_s']:.1f} | {r['peak_rss_mb']:.0f} | "
              f"{r['ica_status']} |")
    dp = [r for r in rows if r["row"].startswith("dpneuro")]
    if dp:
        print("\n| stage s | " + " | ".join(r["row"] for r in dp) + " |\n|---|" + "---|" * len(dp))
        for k in STAGE_KEYS:
            if any(r[f"{k}_s"] for r in dp):
                print(f"| {k} | " + " | ".join(f"{r[f'{k}_s']:.1f}" for r in dp) + " |")
    print("\n" + "; ".join(f"{k} {v:.2f}" for k, v in meta["ratios"].items()))
    if meta["agreement"]:
        print("agreement (mean matched |r|): " + "; ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in meta["agreement"].items()))


def write(stem: str, rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    (out / f"{stem}.json").write_text(json.dumps(meta, indent=1, default=str))
    log(f"wrote {out / stem}.csv and .json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 sites x 2 subjects x 40 volumes, one CanICA start")
    ap.add_argument("--part", choices=("fmriprep", "real", "all"), default="fmriprep")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="measure only these rows")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of the cheap rows (floor, nibabel)")
    ap.add_argument("--plugin", choices=("serial", "cf"), default="serial", help="dpneuro run's Pydra plugin")
    ap.add_argument("--canica-mask", choices=("mni6mm", "default"), default="mni6mm",
                    help="CanICA's mask: dpneuro's 6 mm analysis mask, or CanICA's own (computed at 2 mm)")
    ap.add_argument("--data", help="folder of the generated tree: written if absent, reused if there")
    ap.add_argument("--out", help=f"results folder (default {RESULTS})")
    ap.add_argument("--child", nargs=3, metavar=("ROW", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    out = Path(args.out) if args.out else RESULTS
    parts = ("fmriprep", "real") if args.part == "all" else (args.part,)
    for part in parts:
        t0 = time.perf_counter()
        env = {**machine(), "git": git_state()}
        log(f"part {part}; git {env['git']['commit'][:10]}, "
            f"{len(env['git']['diff_stat'].splitlines()[:-1])} files changed in the work tree")
        with tempfile.TemporaryDirectory(prefix="dpneuro-site-speed-") as tmp:
            rows, meta = (part_fmriprep if part == "fmriprep" else part_real)(args, Path(tmp))
        meta.update(env, runtime_s=time.perf_counter() - t0)
        print_tables(rows, meta)
        write("site_speed" + ("_real" if part == "real" else "") + ("_quick" if args.quick else ""), rows, meta,
              out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
