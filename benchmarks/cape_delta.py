"""CAPE's delta vs the noise level and vs the fraction of colluding sites ([capeDJICA] Fig. 5 / App. F set-up).

    python benchmarks/cape_delta.py [--quick]

For a per-site sensitivity Delta = 1/N_s and a site noise std tau, compares at
a fixed epsilon:
  delta_cape   the CAPE bound ([capeDJICA] Thm. 1, corrected mu_z, see docs/privacy.md)
  delta_paper  the same bound with the printed eq. (1) (for reference)
  delta_conv   conventional scheme with the same aggregator noise (site std tau/sqrt(S))
  delta_pool   pooled data with the same aggregator noise (exact Gaussian curve)
Writes benchmarks/results/cape_delta.csv and .png.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import numpy as np

from dpneuro.privacy import cape_mu_z, delta_from_mu_z, gdp_delta, max_colluding
from dpneuro.privacy.cape_delta import cape_mu_z_paper

RESULTS = Path(__file__).parent / "results"


def deltas(eps: float, tau: float, S: int, n_per_site: int, S_C: int) -> dict:
    sens = 1.0 / n_per_site
    out = {}
    for name, mu_z in (("cape", cape_mu_z(tau, sens, S, S_C)),
                       ("paper", cape_mu_z_paper(tau, S * n_per_site, S, S_C))):
        out[name] = delta_from_mu_z(eps, mu_z) if eps > mu_z else 1.0
    out["conv"] = gdp_delta(eps, sens / (tau / math.sqrt(S)))
    out["pool"] = gdp_delta(eps, sens / tau)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--eps", type=float, default=0.5)
    a = ap.parse_args(argv)
    n_s = 100
    taus = np.geomspace(0.01, 0.2, 6 if a.quick else 25)
    rows = []
    for S in (5, 10, 20):
        for tau in taus:
            d = deltas(a.eps, tau, S, n_s, max_colluding(S))
            rows.append({"sweep": "tau", "S": S, "S_C": max_colluding(S), "tau": tau, **d})
    S = 30
    for S_C in range(0, max_colluding(S) + 1):
        d = deltas(a.eps, 0.05, S, n_s, S_C)
        rows.append({"sweep": "colluders", "S": S, "S_C": S_C, "tau": 0.05, **d})
    RESULTS.mkdir(exist_ok=True)
    suffix = "_quick" if a.quick else ""
    with open(RESULTS / f"cape_delta{suffix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows[:: max(1, len(rows) // 12)]:
        print(f"{r['sweep']:9s} S={r['S']:2d} S_C={r['S_C']:2d} tau={r['tau']:.3f}  cape {r['cape']:.2e}  "
              f"paper {r['paper']:.2e}  conv {r['conv']:.2e}  pool {r['pool']:.2e}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for S, c in zip((5, 10, 20), ("C0", "C1", "C2")):
        rr = [r for r in rows if r["sweep"] == "tau" and r["S"] == S]
        t = [r["tau"] for r in rr]
        ax[0].semilogy(t, [r["cape"] for r in rr], c, label=f"CAPE S={S}")
        ax[0].semilogy(t, [r["conv"] for r in rr], c + "--", label=f"conv S={S}")
    rr = [r for r in rows if r["sweep"] == "tau" and r["S"] == 10]
    ax[0].semilogy([r["tau"] for r in rr], [r["pool"] for r in rr], "k:", label="pooled")
    ax[0].set(xlabel="site noise std tau", ylabel="delta", title=f"eps = {a.eps}, N_s = {n_s}", ylim=(1e-30, 2))
    ax[0].legend(fontsize=7)
    rr = [r for r in rows if r["sweep"] == "colluders"]
    frac = [r["S_C"] / r["S"] for r in rr]
    ax[1].semilogy(frac, [r["cape"] for r in rr], "o-", label="CAPE (corrected)")
    ax[1].semilogy(frac, [r["paper"] for r in rr], "s--", label="CAPE, [capeDJICA] eq. (1) as printed")
    ax[1].semilogy(frac, [r["conv"] for r in rr], "k:", label="conv")
    ax[1].set(xlabel="fraction of colluding sites", ylabel="delta", title="S = 30, tau = 0.05")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"cape_delta{suffix}.png", dpi=90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
