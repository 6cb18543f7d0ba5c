"""Wall time of a whole analysis run as a COINSTAC computation, against the in-process simulation.

The COINSTAC run goes through real ``coinstac`` websocket services (one for
the four sites, one for the remote, on 127.0.0.1) driven by
:mod:`dpneuro.deploy.coinstac_sim`, which follows COINSTAC's message flow:
every iteration calls every site, moves the transfer files, calls the remote
and moves its files back. One iteration advances the protocol by one phase
(capePCA: 6 phases; capeDJICA: 6 + 3 per further round; summary: 1, plus
set-up and the final hand-over), so iterations grow like 3 x ICA rounds.
The COINSTAC time is the whole run (loading the subjects, capePCA, capeDJICA,
summary, maps and report); the in-process column is the simulation path (``dpneuro.run.pipeline``'s reduce
and unmix stages, every party a thread of one process) on the same data,
settings and seeds, which gives bitwise the same W.

Data: the consortium of ``site_templates/coinstac/inputspec.json`` (4 sites x
3 subjects x 60 volumes, 30 x 30 grid, 100 parcels, k = 4), with its settings
except the number of ICA rounds. COINSTAC's own per-iteration overhead
(Docker, network, its pipeline manager) is not included: these numbers are
the computation's share.

Usage::

    python benchmarks/coinstac_run.py [--quick] [--rounds 12 25 50]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from dpneuro.config import RunConfig
from dpneuro.deploy import coinstac as dcc
from dpneuro.run import pipeline

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE.parent / "site_templates" / "coinstac"


def inprocess(settings: dict, man: dict, out: Path) -> tuple[float, np.ndarray]:
    cfg = RunConfig.from_dict({**settings, "sites": [{"name": s["site"], "path": s["path"]} for s in man["sites"]],
                               "out": str(out)}).validate()
    (out / "work").mkdir(parents=True, exist_ok=True)
    cj = out / "work" / "config.json"
    cj.write_text(json.dumps(cfg.to_json(), default=str))
    space = pipeline.stage_space(str(cj))
    sites = [pipeline.stage_load(str(cj), s.name, space) for s in cfg.sites]
    t0 = time.perf_counter()
    red = pipeline.stage_release(str(cj), sites, "reduce", space)
    unmix = pipeline.stage_release(str(cj), sites, "unmix", red)
    return time.perf_counter() - t0, pipeline.public_results({"unmix": unmix})["unmix"]["W"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one short run (4 ICA rounds)")
    ap.add_argument("--rounds", type=int, nargs="+", default=[12, 25, 50])
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    try:
        from dpneuro.deploy import coinstac_sim as sim
    except ImportError:
        print("needs the coinstac extra: pip install 'dpneuro[coinstac]'")
        return 1
    from dpneuro.datasets.synth import make_consortium

    rounds = [4] if a.quick else a.rounds
    spec = json.loads((TEMPLATES / "inputspec.json").read_text())
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpneuro-coinstac-bench-") as tmp:
        tmp = Path(tmp)
        man = make_consortium(tmp / "data", n_sites=4, subjects_per_site=3, n_components=4, n_timepoints=60,
                              space="grid30", random_state=0)
        files = [[x["path"] for x in s["subjects"]] for s in man["sites"]]
        entry = TEMPLATES / "entry.py"
        for J in rounds:
            run_spec = [{**site, "ica": {"value": "temporal"}, "ica_rounds": {"value": J}} for site in spec]
            settings = dcc.settings_from_inputs(run_spec[0])
            t_sim, W_sim = inprocess(settings, man, tmp / f"ref-{J}")
            root = tmp / f"sim-{J}"
            sim.prepare_inputs(root, files)
            services = [sim.CoinstacService(entry, log=tmp / f"sites-{J}.log"),
                        sim.CoinstacService(entry, log=tmp / f"remote-{J}.log")]
            try:
                for svc in services:
                    svc.launch()
                for svc in services:
                    svc.wait_ready()
                t0 = time.perf_counter()
                run = sim.run_computation(run_spec, root, local_url=services[0].url, remote_url=services[1].url,
                                          call_timeout=300, deadline=3600)
                wall = time.perf_counter() - t0
            finally:
                for svc in services:
                    svc.stop()
            W = np.load(run.output_dir("remote") / run.output["W"])
            protocol_rounds = 1 + run.output["ica_rounds"]
            rows.append({"ica_rounds": J, "iterations": run.iterations, "message_files": run.messages,
                         "coinstac_seconds": round(wall, 3), "iterations_per_s": round(run.iterations / wall, 2),
                         "protocol_rounds_per_s": round(protocol_rounds / wall, 3),
                         "ms_per_iteration": round(1000 * wall / run.iterations, 1),
                         "inprocess_seconds": round(t_sim, 3), "same_W_as_inprocess": bool(np.array_equal(W, W_sim))})
            print(rows[-1], flush=True)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "coinstac_run_quick" if a.quick else "coinstac_run"
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average": os.getloadavg(),
            "note": "wall times on a shared machine; COINSTAC's own per-iteration overhead not included"}
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    print()
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    J = [r["ica_rounds"] for r in rows]
    ax.plot(J, [r["coinstac_seconds"] for r in rows], "o-", label="COINSTAC flow, whole run (real coinstac services)")
    ax.plot(J, [r["inprocess_seconds"] for r in rows], "s-", label="in-process, capePCA + capeDJICA stages")
    ax.set_xlabel("capeDJICA rounds")
    ax.set_ylabel("wall time [s]")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    print(f"\nwrote {out / (stem + '.csv')}, .json, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
