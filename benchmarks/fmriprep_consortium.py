"""A consortium of fMRIPrep derivatives, end to end: discovery, resampling, nilearn cleaning, the report.

Data: ``dpneuro.datasets.fmriprep.write_fmriprep_site`` per site (generated, nothing
downloaded): BOLD on a 2 mm grid resampled to the 4 mm analysis grid, confounds
tables nilearn reads, brain masks, boldrefs, anat/, figures/, AROMA copies,
space-T1w runs, surface/CIFTI placeholders, and a planted motion artefact.
Site 3 scans at TR 0.8 s (the others 2 s) and has one truncated gzip subject,
left out with ``on_bad_subject = "skip"``. The run: ``pipeline.run_stages``
as ``dpneuro run`` does, voxels (``parcels = 0``), spatial ICA, capePCA,
seed 0, cleaning ``confounds = "simple"`` with a 0.01 Hz high-pass.

Reported per site: load seconds, subjects, runs, files not used, subjects
left out, and the largest |correlation| between the planted artefact's time
course and the site's 2 leading principal components, without cleaning and
with it (below 0.1 means the artefact is gone).

    python benchmarks/fmriprep_consortium.py            # 3 sites x 8 subjects x 150 volumes
    python benchmarks/fmriprep_consortium.py --quick    # 3 sites x 3 subjects x 60 volumes

Writes benchmarks/results/fmriprep_consortium[_quick].json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from dpneuro.config import RunConfig
from dpneuro.data.load import load_site
from dpneuro.datasets.fmriprep import analysis_mask, write_fmriprep_site
from dpneuro.run.pipeline import prepare, run_stages


def artefact_corr(X, tc, k: int = 2) -> float:
    _, _, vt = np.linalg.svd(np.asarray(X, np.float64), full_matrices=False)
    return float(max(abs(np.corrcoef(vt[i], tc)[0, 1]) for i in range(k)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_sub, n_vol = (3, 60) if args.quick else (8, 150)
    with tempfile.TemporaryDirectory(prefix="dpneuro-fmriprep-") as tmp:
        tmp = Path(tmp)
        mask = analysis_mask(tmp / "mask.nii.gz")
        sites = {}
        for i, tr in enumerate((2.0, 2.0, 0.8), start=1):
            sites[f"site-0{i}"] = write_fmriprep_site(tmp / f"site-0{i}", n_subjects=n_sub, n_volumes=n_vol, tr=tr,
                                                      random_state=i, corrupt=("sub-02",) if i == 3 else ())
        cfg = RunConfig.from_dict({
            "sites": [{"name": n, "path": str(s.root)} for n, s in sites.items()], "out": str(tmp / "out"),
            "mask": str(mask), "parcels": 0, "n_components": 3, "ica": "spatial", "site_voxel_maps": False,
            "bids": {"task": "rest"}, "confounds": "simple", "high_pass": 0.01, "on_bad_subject": "skip",
            "seed": 0, "simulation": True})
        rows = {}
        for name, s in sites.items():
            row = {}
            for label, cleaning in (("raw", None), ("simple", cfg.cleaning())):
                t0 = time.perf_counter()
                sd = load_site(s.root, mask, bids=cfg.bids, cleaning=cleaning, on_bad_subject="skip")
                row[f"load_s_{label}"] = round(time.perf_counter() - t0, 3)
                tc = np.concatenate([s.artefact[p] for p in sd.paths])
                row[f"artefact_corr_{label}"] = round(artefact_corr(sd.X, tc), 4)
            row.update(subjects=sd.n_subjects, runs=len(sd.paths), tr=sd.tr, files_not_used=len(sd.skipped),
                       left_out=[x[0] for x in sd.excluded])
            rows[name] = row
        t0 = time.perf_counter()
        cfg, _ = prepare(cfg)
        out = run_stages(cfg)
        seconds = time.perf_counter() - t0
        report = Path(out["report"]).read_text()
        run = json.loads((cfg.run_dir / "run.json").read_text())
        result = {"quick": args.quick, "subjects_per_site": n_sub, "volumes": n_vol, "sites": rows,
                  "pipeline_seconds": round(seconds, 2), "report_has_data_section": "<h2>Data</h2>" in report,
                  "run_json_cleaning": run["cleaning"]["description"], "run_json_data": run["data"]}
    for name, row in rows.items():
        print(f"{name}: {row}")
    print(f"pipeline {seconds:.1f} s; cleaning: {result['run_json_cleaning']}")
    res = Path(__file__).parent / "results" / f"fmriprep_consortium{'_quick' if args.quick else ''}.json"
    res.parent.mkdir(exist_ok=True)
    res.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {res}")


if __name__ == "__main__":
    main()
