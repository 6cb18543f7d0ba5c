"""What the two noise levers buy on real fMRI: symmetrized noise and the zero-sum variance, one at a time.

Data: the pseudo-consortium of ``benchmarks/real_frontier.py`` at 4 sites x 100
subjects (its bootstrap of the 33 real people, seed 1), 20 components, 122
regions, spatial ICA of the private PCA basis with subject subspaces (the
defaults). For each total eps (headline: against the aggregator colluding with
one site, delta 1e-5) the PCA gets the largest noise multiplier z that keeps
the headline at eps under the variant's plan (``dpneuro.privacy.cape_mu_z``),
and its maps are compared with the same data's maps without noise (mean
matched |r|; median of the same 3 noise seeds for every variant):

- ``papers``: every unique covariance entry at the release std ("mirrored")
  and zero-sum draws of variance tau^2 (``NoisePlan(zero_sum_variance=1)``);
- ``symmetrized``: off-diagonal noise std tau / sqrt(2), zero-sum variance tau^2;
- ``symmetrized + zero-sum 100``: the defaults (what ``dpneuro run`` does).

The defaults' cells use the planner's setting (its z agrees with the formula to
1e-6), so they are ``real_frontier.csv``'s. Spatial FastICA on a noisy basis
does not always converge, and then a change of z in the sixth digit moves its
result: medians over 3 seeds can differ by ~0.02 for that reason alone.

    python benchmarks/noise_ablation.py            # ~2 minutes on 2 cores
    python benchmarks/noise_ablation.py --quick    # smoke run (writes *_quick.*)

Writes benchmarks/results/noise_ablation.{csv,json}.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import base_config, mean_r, planned, run_maps  # noqa: E402
from real_frontier import N_SITES, WINDOW, pseudo_consortium, real_subjects  # noqa: E402

from dpneuro.protocol.cape.plans import ZERO_SUM_VARIANCE  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DELTA = 1e-5
#: name -> (symmetric_noise, zero_sum_variance)
VARIANTS = {"papers": ("mirrored", 1.0), "symmetrized": ("symmetrized", 1.0),
            "symmetrized + zero-sum 100": ("symmetrized", ZERO_SUM_VARIANCE)}


def private_maps(cfg, X_sites, lengths, z: float, how: str, c: float, pca_epsilon: float | None = None):
    """The run's reduction with noise multiplier ``z`` (or ``pca_epsilon``), symmetric noise ``how`` and zero-sum
    variance ``c``."""
    from dpneuro.algorithms.djica import spatial_maps
    from dpneuro.algorithms.spatial_ica import spatial_ica
    from dpneuro.privacy import epsilon_for_multiplier
    from dpneuro.protocol.cape import NoisePlan, run_cape
    from dpneuro.run.factory import pca_algorithm
    from dpneuro.run.roles import pca_source

    D = X_sites[0].shape[0]
    if pca_epsilon is None:
        pca_epsilon = epsilon_for_multiplier(z, cfg.pca_delta)
    alg = pca_algorithm(replace(cfg, pca_epsilon=pca_epsilon), D)
    assert abs(alg.z / z - 1) < 1e-6, (alg.z, z)
    alg.symmetric_noise = how
    srcs = [pca_source(X, n) for X, n in zip(X_sites, lengths)]
    agg = run_cape(alg, srcs, NoisePlan("cape", zero_sum_variance=c)).aggregator
    V, lam = np.asarray(agg["basis"]), np.asarray(agg["eigenvalues"])
    return spatial_maps(V, lam, spatial_ica(V, lam).W)


def multiplier_for(eps: float, c: float, n_sites: int) -> float:
    """z = tau / Delta whose one release gives the headline ``eps`` against the aggregator and ceil(S/3) - 1 sites."""
    from dpneuro.privacy import cape_mu_z, gdp_mu, max_colluding

    mu = gdp_mu(eps, DELTA)
    return math.sqrt(2 * cape_mu_z(1.0, 1.0, n_sites, max_colluding(n_sites), c)) / mu


def main(argv=None) -> int:
    from dpneuro.privacy import noise_multiplier

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12 subjects per site, one budget, one seed")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    subjects, epsilons, seeds = (12, (8.0,), [0]) if args.quick else (100, (4.0, 8.0), [0, 1, 2])
    _, runs = real_subjects()
    X_all, len_all = pseudo_consortium(runs, 12 if args.quick else 500, N_SITES, WINDOW, seed=1)
    X_sites = [X[:, :subjects * WINDOW] for X in X_all]
    lengths = [ln[:subjects] for ln in len_all]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpneuro-ablation-") as tmp:
        cfg = base_config(Path(tmp), N_SITES, ica="spatial", parcels=0)
        D = X_sites[0].shape[0]
        ref = run_maps(replace(cfg, plan="none", seed=0), X_sites, lengths)
        for eps in epsilons:
            run_cfg = planned(cfg, lengths, eps, dim=D)
            for name, (how, c) in VARIANTS.items():
                z = multiplier_for(eps, c, N_SITES)
                pca_eps = None
                if c == ZERO_SUM_VARIANCE:  # the defaults: exactly what the planner gives the run
                    pca_eps = run_cfg.pca_epsilon
                    assert abs(noise_multiplier(pca_eps, run_cfg.pca_delta) / z - 1) < 1e-6
                r = [mean_r(private_maps(replace(cfg, seed=s), X_sites, lengths, z, how, c, pca_eps), ref)
                     for s in seeds]
                rows.append({"subjects": subjects, "epsilon": eps, "variant": name, "symmetric_noise": how,
                             "zero_sum_variance": c, "noise_multiplier": round(z, 5), "r_median": statistics.median(r),
                             "r_min": min(r), "seeds": len(seeds)})
                print(rows[-1], flush=True)
    runtime = time.perf_counter() - t0
    suffix = "_quick" if args.quick else ""
    RESULTS.mkdir(exist_ok=True)
    keys = list(rows[0])
    with open(RESULTS / f"noise_ablation{suffix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keys})
    meta = {"n_sites": N_SITES, "subjects_per_site": subjects, "window": WINDOW, "n_components": cfg.n_components,
            "delta": DELTA, "seeds": len(seeds), "variants": VARIANTS, "runtime_s": runtime}
    (RESULTS / f"noise_ablation{suffix}.json").write_text(json.dumps(meta, indent=1, default=str))
    print(f"wrote {RESULTS / f'noise_ablation{suffix}.csv'} in {runtime:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
