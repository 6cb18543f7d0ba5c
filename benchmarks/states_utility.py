"""dFNC brain states in the run, and PD-SVD as the reduction, on the demo's consortium with planted states.

Data: ``dpneuro synth``'s demo consortium (4 sites x 32 subjects x 120 volumes,
6 mm MNI grid, 8 networks), and the same with 128 subjects per site, with K = 4
planted dFNC connectivity states (``states=4``: the sources switch between four
correlation matrices, mean dwell 30 / 50 / 70 / 90 s), the run's defaults
otherwise (100 parcels, spatial ICA, the default PCA). For each
``states_epsilon`` (the whole states stage per site) and seed, the whole run up
to the maps through ``dpneuro.run.pipeline`` (the functions the workflow runs), then
the states against the planted ones: each state's components put in the
truth's order and sign by the maps' match, the states matched one to one, mean
r of the connectivity matrices; and the largest error of the consortium's
occupancy (fraction of windows per state). The non-private reference is
``plan = "none"`` (no noise anywhere). Reported per setting: the median over
seeds, the headline eps of the states stage alone and of the whole run (exact
GDP, against the aggregator and its colluders).

PD-SVD rows: the same run with ``reduction = "pdsvd"`` (secure sums, no noise)
and with the exact PCA (``reduction = "none"``, plan none): the maps' mean |r|
with the truth (they must agree: PD-SVD computes the pooled subspace).

    python benchmarks/states_utility.py            # full: 3 seeds, ~15 min on 2 cores
    python benchmarks/states_utility.py --quick    # smoke run on a small grid (writes *_quick.*)

Writes benchmarks/results/states_utility.{csv,json}.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
EPSILONS = (1.0, 2.0, 4.0, 8.0, 16.0)
SUBJECTS = (32, 128)  # per site: the demo's, and four times as many
K = 4


def run(cfg) -> dict:
    from dpneuro.privacy import gdp_epsilon
    from dpneuro.run import pipeline
    from dpneuro.run.factory import states_settings

    cfg, _ = pipeline.prepare(cfg, until="maps")
    out = pipeline.run_stages(cfg, until="maps")
    mp = json.loads(Path(out["maps"]).read_text())
    priv = json.loads(Path(mp["privacy"]).read_text())
    site = max(priv["sites"].values(), key=lambda s: s["epsilon"])
    names = states_settings(cfg).ledger_stages if cfg.brain_states else ()
    mu_states = sum(v ** 2 for k, v in site["by_stage_mu"].items() if k in names) ** 0.5
    truth = (mp.get("states") or {}).get("truth") or {}
    return {"states_r": truth.get("mean r with truth"), "occ_err": truth.get("occupancy error"),
            "maps_r": mp["truth"]["metrics"]["mean |r| with truth"],
            "eps_total": site["epsilon"], "eps_states": gdp_epsilon(cfg.delta, mu_states) if mu_states else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small grid, one seed, two budgets")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    from dpneuro.config import SYNTHETIC_CONSORTIUM as SC
    from dpneuro.config import RunConfig
    from dpneuro.datasets.synth import make_consortium

    t0 = time.perf_counter()
    rows = []
    for subjects in ([6] if args.quick else SUBJECTS):
        with tempfile.TemporaryDirectory(prefix="dpneuro-states-") as tmp:
            tmp = Path(tmp)
            if args.quick:
                shape = dict(n_sites=4, subjects_per_site=subjects, n_components=6, n_timepoints=60, space="grid30")
                epsilons, seeds, extra = (4.0,), [0], {"parcels": 60}
            else:
                shape = dict(n_sites=SC["sites"], subjects_per_site=subjects, n_components=SC["components"],
                             n_timepoints=SC["timepoints"], space=SC["space"], dtype=SC["dtype"])
                epsilons, seeds, extra = EPSILONS, list(range(args.seeds)), {}
            man = make_consortium(tmp / "data", random_state=0, states=K, **shape)
            base = dict(sites=[{"name": s["site"], "path": s["path"]} for s in man["sites"]],
                        out=str(tmp / "run"), space=shape["space"], n_components=shape["n_components"],
                        ica="spatial", brain_states=K, truth=str(tmp / "data"), simulation=True, **extra)

            def cfg(**kw):
                return RunConfig.from_dict({**base, **kw}).validate()

            for eps in ("none", *epsilons):
                res = [run(cfg(seed=s, **({"plan": "none"} if eps == "none" else {"states_epsilon": eps})))
                       for s in seeds]  # without noise the seed still picks the k-means' random starts
                row = {"method": "states", "subjects": subjects, "reduction": "capepca", "states_epsilon": eps,
                       "states_r_median": statistics.median(r["states_r"] for r in res),
                       "states_r_min": min(r["states_r"] for r in res),
                       "occ_err_median": statistics.median(r["occ_err"] for r in res),
                       "maps_r_median": statistics.median(r["maps_r"] for r in res),
                       "eps_states": res[0]["eps_states"], "eps_total": res[0]["eps_total"], "seeds": len(res)}
                rows.append(row)
                print(row, flush=True)
            if subjects == (6 if args.quick else SUBJECTS[0]):
                for red, plan in (("none", "none"), ("pdsvd", "cape")):
                    r = run(cfg(seed=0, reduction=red, plan=plan, brain_states=0))
                    row = {"method": "maps", "subjects": subjects, "reduction": red, "maps_r": r["maps_r"],
                           "eps_total": r["eps_total"], "seeds": 1}
                    rows.append(row)
                    print(row, flush=True)
    runtime = time.perf_counter() - t0
    suffix = "_quick" if args.quick else ""
    RESULTS.mkdir(exist_ok=True)
    keys = ["method", "subjects", "reduction", "states_epsilon", "states_r_median", "states_r_min", "occ_err_median",
            "maps_r_median", "eps_states", "eps_total", "maps_r", "seeds"]
    with open(RESULTS / f"states_utility{suffix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})
    meta = {"K": K, "consortium": shape, "subjects_per_site": [6] if args.quick else list(SUBJECTS),
            "seeds": len(seeds), "epsilons": list(epsilons), "runtime_s": runtime,
            "ica": "spatial", "delta": 1e-5}
    (RESULTS / f"states_utility{suffix}.json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {RESULTS / f'states_utility{suffix}.csv'} in {runtime:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
