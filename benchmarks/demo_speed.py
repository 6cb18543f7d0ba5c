"""End-to-end demo: wall time and peak memory of `dpneuro demo` (fresh output folder each run).

    python benchmarks/demo_speed.py [--repeats 3] [--quick]

Writes benchmarks/results/demo_speed.json and prints a table. Each run is a
separate process, so imports and the Pydra start-up are counted as a user sees them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def run_once(out: Path) -> dict:
    env = {**os.environ, "NO_ET": "1", "MPLBACKEND": "Agg"}
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run([sys.executable, "-m", "dpneuro.cli", "demo", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr)
    m = re.search(r"mean \|r\| with truth = ([0-9.]+)", proc.stdout)
    q = re.search(r"qNGI = ([0-9.]+)", proc.stdout)
    e = re.findall(r"eps = ([0-9.]+) \(exact GDP\)", proc.stdout)  # the headline: vs aggregator + colluders
    return {"wall_s": wall, "peak_rss_mb": max(peak, before) / 1024, "mean_abs_r": float(m.group(1)) if m else None,
            "qngi": float(q.group(1)) if q else None, "epsilon": [float(x) for x in e], **described(proc.stdout),
            "stdout": proc.stdout}


def described(stdout: str) -> dict:
    """What the demo ran and the numbers it reports besides the headline, as fields (benchmarks/README.md and the
    project's README quote them)."""
    c = re.search(r"(\d+)-site consortium \((\d+) subjects per site, (\w+)\)", stdout)
    st = re.search(r"running the workflow \(([^)]*)\)", stdout)
    site = re.search(r"site voxel maps: mean \|r\| with truth = ([0-9.]+)", stdout)
    alone = re.findall(r"one site's releases alone: at most ([0-9.]+)", stdout)
    return {"sites": int(c.group(1)) if c else None, "subjects_per_site": int(c.group(2)) if c else None,
            "space": c.group(3) if c else None, "stages": st.group(1) if st else None,
            "site_maps_mean_abs_r": float(site.group(1)) if site else None,
            "epsilon_one_site_alone": [float(x) for x in alone]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one run (CI smoke)")
    a = ap.parse_args(argv)
    n = 1 if a.quick else a.repeats
    runs = []
    for i in range(n):
        out = Path(tempfile.mkdtemp(prefix="dpneuro_demo_"))
        try:
            runs.append(run_once(out))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        print(f"run {i + 1}: {runs[-1]['wall_s']:.1f} s, peak RSS {runs[-1]['peak_rss_mb']:.0f} MB")
    walls = sorted(r["wall_s"] for r in runs)
    res = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "python": platform.python_version(), "repeats": n, "median_wall_s": walls[len(walls) // 2],
           "wall_s": walls, "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
           "mean_abs_r": runs[0]["mean_abs_r"], "qngi": runs[0]["qngi"], "epsilon": runs[0]["epsilon"],
           **{k: runs[-1][k] for k in described("")}, "last_stdout": runs[-1]["stdout"]}
    RESULTS.mkdir(exist_ok=True)
    if not a.quick:
        (RESULTS / "demo_speed.json").write_text(json.dumps(res, indent=1))
    print(f"median wall time {res['median_wall_s']:.1f} s over {n} run(s); peak RSS {res['peak_rss_mb']:.0f} MB; "
          f"mean |r| with truth {res['mean_abs_r']}; qNGI {res['qngi']}; eps per site (vs aggregator + colluders) "
          f"{res['epsilon']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
