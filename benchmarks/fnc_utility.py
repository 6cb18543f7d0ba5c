"""Static FNC, privately: how close the consortium's private FNC is to the exact one, and what its share costs the maps.

Data: the realistic generator (``network_model``, 20 networks on the 6 mm MNI
grid, 100 coordinate parcels, 150 volumes at TR 2 s), 4 sites x {50, 100}
subjects. For a total eps (headline, against the aggregator and its colluders,
delta 1e-5) the planner splits the budget between the PCA and the FNC release
in the ratio of their settings (pca_epsilon 6, fnc_epsilon 1, 2 or 4: the FNC's
share of mu^2 is in the table). Per run:

- the maps (spatial ICA of the private basis) against the true maps (mean
  matched |r|), and the same run without the FNC stage (the whole budget to the
  PCA), so the FNC's cost to the maps shows;
- the consortium's private FNC against the exact pooled mean of every subject's
  FNC from the same time courses (no bound, no noise): RMS error per pair (Fisher
  z) and correlation over pairs; the noise's sd the plan announces; the fraction
  of subjects whose FNC the bound (0.3 sqrt(P)) scaled.

    python benchmarks/fnc_utility.py            # full: ~10 min on 2 cores
    python benchmarks/fnc_utility.py --quick    # smoke run (writes fnc_utility_quick.*)

Writes benchmarks/results/fnc_utility.{csv,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import N_SITES, N_TIMEPOINTS, PARCELS, SPACE, base_config, consortium, mean_r, write_results  # noqa: E402

SUBJECTS = (50, 100)
EPSILONS = (2.0, 4.0, 8.0)
FNC_EPSILONS = (1.0, 2.0, 4.0)  # with pca_epsilon 6: the FNC's share of mu^2
N_COMPONENTS = 20


def one_run(cfg, X_sites, lengths, parcels, truth) -> dict:
    """Maps against the truth; with the FNC stage, the private FNC against the exact pooled mean."""
    from dpneuro.algorithms.djica import spatial_maps, time_courses
    from dpneuro.algorithms.fnc import clip_subjects, site_fnc
    from dpneuro.run.factory import fnc_settings
    from dpneuro.run.roles import unmixing_input
    from dpneuro.run.stages import reduce_inprocess, release, run_inprocess, unmix_inprocess

    red = reduce_inprocess(cfg, X_sites, lengths)
    unm = unmix_inprocess(cfg, X_sites, lengths, red.basis, red.eigenvalues)
    out = {"maps vs truth": mean_r(parcels.expand(spatial_maps(red.basis, red.eigenvalues, unm.W)), truth)}
    if not cfg.fnc:
        return out
    S = [time_courses(unm.W, unmixing_input(cfg, X, red.basis, red.eigenvalues), unm.b) for X in X_sites]
    res, _ = run_inprocess(release("fnc"), cfg, S, lengths, dim=0, public={})
    every = np.vstack([site_fnc(s, ln) for s, ln in zip(S, lengths)])
    exact = every.mean(axis=0)
    bound = fnc_settings(cfg).scale(every.shape[1])
    err = res["fnc"] - exact
    return {**out, "fnc rms error": float(np.sqrt(np.mean(err**2))),
            "fnc r with exact": float(np.corrcoef(res["fnc"], exact)[0, 1]),
            "noise sd": float(np.sqrt(res["noise_var"])),
            "bounded subjects": float(np.mean(clip_subjects(every, bound)[1])),
            "exact rms": float(np.sqrt(np.mean(exact**2)))}


def main(argv=None) -> int:
    from dpneuro.data.images import load_space
    from dpneuro.data.parcellation import Parcellation, coordinate_parcels
    from dpneuro.datasets.synth import network_model
    from dpneuro.privacy import gdp_mu
    from dpneuro.run.planner import SiteShape, plan_for_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12 subjects per site, one budget, one seed")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    subjects_grid, epsilons, fnc_eps, seeds = SUBJECTS, EPSILONS, FNC_EPSILONS, list(range(args.seeds))
    if args.quick:
        subjects_grid, epsilons, fnc_eps, seeds = (12,), (8.0,), (2.0,), [0]
    mask, _ = load_space(SPACE)
    model = network_model(SPACE, N_COMPONENTS, random_state=0)
    truth = model.A.astype(np.float64)
    parcels = Parcellation(coordinate_parcels(mask, PARCELS, seed=0))
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpneuro-fnc-") as tmp:
        tmp = Path(tmp)
        for M in subjects_grid:
            X_sites, lengths = consortium(model, {"p": parcels}, M, N_SITES, N_TIMEPOINTS)["p"]
            shapes = [SiteShape(f"site-{i + 1:02d}", tuple(ln)) for i, ln in enumerate(lengths)]
            for eps in epsilons:
                for fe in (None, *fnc_eps):  # None: no FNC stage, the whole budget to the maps
                    base = base_config(tmp, N_SITES, n_components=N_COMPONENTS, pca_epsilon=6.0,
                                       fnc=fe is not None, fnc_epsilon=fe or 2.0)
                    share = 0.0 if fe is None else gdp_mu(fe, 5e-6) ** 2 / (gdp_mu(fe, 5e-6) ** 2
                                                                          + gdp_mu(6.0, 5e-6) ** 2)
                    got = []
                    for seed in seeds:
                        cfg = plan_for_target(replace(base, seed=seed), shapes, PARCELS, eps).config
                        got.append(one_run(cfg, X_sites, lengths, parcels, truth))
                    row = {"subjects": M, "epsilon": eps, "fnc_epsilon_setting": fe or "off",
                           "fnc share of mu^2": round(share, 3)}
                    for key in got[0]:
                        row[key] = statistics.median(g[key] for g in got)
                    rows.append(row)
                    print(row, flush=True)
    keys = ["subjects", "epsilon", "fnc_epsilon_setting", "fnc share of mu^2", "maps vs truth", "fnc rms error",
            "fnc r with exact", "noise sd", "bounded subjects", "exact rms"]
    rows = [{k: r.get(k, "") for k in keys} for r in rows]
    meta = {"data": f"dpneuro.datasets.synth.network_model('{SPACE}', {N_COMPONENTS}, seed=0)", "n_sites": N_SITES,
            "timepoints": N_TIMEPOINTS, "parcels": PARCELS, "subjects": list(subjects_grid),
            "epsilons": list(epsilons), "fnc_epsilons": list(fnc_eps), "pca_epsilon": 6.0, "seeds": seeds,
            "runtime_s": time.perf_counter() - t0}
    write_results("fnc_utility" + ("_quick" if args.quick else ""), rows, meta, keys=keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
