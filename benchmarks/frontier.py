"""The privacy-utility frontier on realistic data: spatial vs temporal group ICA, with and without a subject bound.

Data: ``dpneuro.datasets.synth.network_model`` (the "networks" model: distributed,
partly bilateral, overlapping network maps; low-frequency, near-Gaussian,
correlated time courses; global signal, structured and white noise), 20
networks on the 6 mm MNI grid, 4 sites, 150 volumes per subject at TR 2 s.
Every subject is prepared as a site prepares it (``dpneuro.data.load.preprocess``:
each voxel z-scored) and averaged into data-independent parcels of the mask
(``coordinate_parcels(mask, P, seed=0)``, what the pipeline's space stage
computes; P = 100, the default, and 400). Consortia of different sizes are
nested: subject (s, m) is the same person in every size. The parcel ceiling is
the mean |r| of the true maps averaged into the parcels and painted back: no
parcel-level result can exceed it.

Per cell (subjects per site x total eps x ICA model x parcels x subject bound
x noise seed) the run's own stage functions run in memory
(``dpneuro.run.stages.reduce_inprocess`` and ``unmix_inprocess``, the functions
the pipeline and the deployed parties call), with the budget planner choosing
the per-stage settings for the total eps (headline sense: against the
aggregator and its colluders, every stage, delta 1e-5). The maps (painted back
to voxels) are matched one to one with the true network maps (mean |r|) and
with the same method's non-private maps (``plan = "none"``, same bound).

Also measured: the distribution of the subjects' normalised second-moment
Frobenius norms ``||X_m X_m^T / n_m||_F`` at the parcel level (what a subject
bound clips).

    python benchmarks/frontier.py            # full: ~25 min on 2 cores
    python benchmarks/frontier.py --quick    # smoke run (writes *_quick.*)

Writes benchmarks/results/frontier.{csv,json} and frontier.png.
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

import numpy as np

from dpneuro.config import ConfigError

RESULTS = Path(__file__).resolve().parent / "results"
SUBJECTS = (50, 100, 250)
EPSILONS = (1.0, 2.0, 4.0, 8.0, 16.0)
N_SITES, N_COMPONENTS, N_TIMEPOINTS, TR, SPACE, PARCELS = 4, 20, 150, 2.0, "mni6mm", 100
#: (ICA model, parcels, the PCA's subject contribution, subject bound) measured at every size and budget
RUNS = (("spatial", 100, "moment", 1.0), ("spatial", 100, "moment", 0.25), ("spatial", 100, "subspace", 0.25),
        ("spatial", 400, "moment", 0.25), ("spatial", 400, "subspace", 0.25), ("temporal", 100, "moment", 1.0),
        ("temporal", 100, "moment", 0.25))


def consortium(model, parcellations: dict, subjects: int, n_sites: int, T: int) -> dict:
    """For every parcellation, per site the parcel-level D x N matrix (float32) and its subjects' lengths.

    Each subject is generated and prepared once and averaged into every parcellation.
    """
    from dpneuro.data.load import preprocess

    blocks = {P: [[] for _ in range(n_sites)] for P in parcellations}
    for s in range(n_sites):
        for m in range(subjects):
            X = preprocess(model.subject(s, m, T, TR)[0])
            for P, pc in parcellations.items():
                blocks[P][s].append(pc.reduce(X))
    return {P: ([np.hstack(b).astype(np.float32) for b in per_site], [[T] * subjects for _ in range(n_sites)])
            for P, per_site in blocks.items()}


def subject_frobenius(X_sites, lengths) -> np.ndarray:
    """Every subject's ||X_m X_m^T / n_m||_F with unit-norm time points: what the subject bound compares."""
    from dpneuro.algorithms.pca import gram_frobenius
    from dpneuro.data.matrix import scale_columns

    out = []
    for X, ln in zip(X_sites, lengths):
        a = 0
        for n in ln:
            out.append(gram_frobenius(scale_columns(X[:, a:a + n], "unit")) / n)
            a += n
    return np.array(out)


def base_config(tmp: Path, n_sites: int, **kw):
    """A simulation's configuration over ``n_sites`` placeholder sites (the data are given in memory).

    The maps' benchmarks run the reduction and the unmixing only, so the planner gives a total eps to them
    alone (``fnc = false``); ``fnc_utility.py`` measures what the FNC stage's share costs the maps."""
    from dpneuro.config import RunConfig

    sites = [{"name": f"site-{i + 1:02d}", "path": str(tmp)} for i in range(n_sites)]
    return RunConfig.from_dict({"sites": sites, "out": str(tmp / "run"), "space": SPACE, "parcels": PARCELS,
                                "n_components": N_COMPONENTS, "simulation": True, "fnc": False, **kw})


def planned(cfg, lengths, target: float, dim: int = PARCELS):
    """``cfg`` with the per-stage settings the planner chooses for the total (headline) eps ``target``."""
    from dpneuro.run.planner import SiteShape, plan_for_target

    shapes = [SiteShape(s.name, tuple(ln)) for s, ln in zip(cfg.sites, lengths)]
    return plan_for_target(cfg, shapes, dim, target).config


def run_maps(cfg, X_sites, lengths, parcels=None, *, spatial_options=None, with_release=False):
    """The run's maps from in-memory site data: features x components, painted to voxels when ``parcels``.

    ``spatial_options``: keyword arguments of ``spatial_ica`` instead of the product's (ablations of the spatial
    ICA, post-processing of the same release); ``with_release``: also return the reduction's result.
    """
    from dpneuro.algorithms.djica import spatial_maps
    from dpneuro.run.stages import reduce_inprocess, unmix_inprocess

    red = reduce_inprocess(cfg, X_sites, lengths)
    if spatial_options is not None and cfg.ica == "spatial":
        from dpneuro.algorithms.spatial_ica import spatial_ica

        W = spatial_ica(red.basis, red.eigenvalues, **spatial_options).W
    else:
        W = unmix_inprocess(cfg, X_sites, lengths, red.basis, red.eigenvalues).W
    maps = spatial_maps(red.basis, red.eigenvalues, W)
    maps = maps if parcels is None else parcels.expand(maps)
    return (maps, red) if with_release else maps


def write_results(stem: str, rows: list[dict], meta: dict, *, keys=None, digits: int = 3, default=str) -> None:
    """``benchmarks/results/<stem>.csv`` (``keys``, default the first row's; floats rounded) and ``<stem>.json``."""
    RESULTS.mkdir(exist_ok=True)
    keys = list(keys or rows[0])
    with open(RESULTS / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(r[k], digits) if isinstance(r[k], float) else r[k]) for k in keys})
    (RESULTS / f"{stem}.json").write_text(json.dumps(meta, indent=1, default=default))
    print(f"wrote {RESULTS / f'{stem}.csv'} in {meta.get('runtime_s', float('nan')):.0f} s")


def mean_r(est, ref) -> float:
    from dpneuro.algorithms.metrics import match_components

    return float(np.mean(np.abs(match_components(est, ref)[1])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small consortium, two budgets, one seed")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    from dataclasses import replace

    from dpneuro.data.parcellation import Parcellation, coordinate_parcels
    from dpneuro.datasets.synth import network_model

    t0 = time.perf_counter()
    if args.quick:
        subjects_grid, epsilons, seeds, n_sites, T = (12,), (4.0, 16.0), [0], 3, 100
        runs = [("spatial", PARCELS, "moment", 0.25), ("spatial", PARCELS, "subspace", 0.25),
                ("temporal", PARCELS, "moment", 0.25)]
    else:
        subjects_grid, epsilons, seeds, n_sites, T = SUBJECTS, EPSILONS, list(range(args.seeds)), N_SITES, \
            N_TIMEPOINTS
        runs = RUNS
    model = network_model(SPACE, N_COMPONENTS, random_state=0)
    A_true = model.A.astype(np.float64)
    parcellations = {P: Parcellation(coordinate_parcels(model.mask, P, seed=0)) for P in sorted({r[1] for r in runs})}
    # the best a parcel-level map can do: the true maps averaged into the parcels and painted back
    ceiling = {P: mean_r(pc.expand(pc.reduce(A_true)), A_true) for P, pc in parcellations.items()}
    print(f"parcel ceiling (true maps painted from parcels): {ceiling}", flush=True)
    rows, frob = [], {}
    with tempfile.TemporaryDirectory(prefix="dpneuro-frontier-") as tmp:
        tmp = Path(tmp)
        tg = time.perf_counter()
        data = consortium(model, parcellations, max(subjects_grid), n_sites, T)
        gen_s = time.perf_counter() - tg
        print(f"generated {n_sites} x {max(subjects_grid)} subjects in {gen_s:.0f} s", flush=True)
        for subjects in subjects_grid:
            for ica, P, con, bound in runs:
                X_sites = [X[:, :subjects * T] for X in data[P][0]]
                lengths = [ln[:subjects] for ln in data[P][1]]
                if (subjects, P) not in frob:
                    fro = subject_frobenius(X_sites, lengths)
                    frob[(subjects, P)] = {q: float(np.percentile(fro, q)) for q in (10, 50, 90)}
                kw = dict(ica=ica, parcels=P, pca_contribution=con, pca_subject_bound=bound)
                ref = run_maps(base_config(tmp, n_sites, plan="none", seed=0, **kw), X_sites, lengths,
                               parcellations[P])
                row0 = {"subjects": subjects, "ica": ica, "parcels": P, "contribution": con, "bound": bound}
                rows.append({**row0, "epsilon": "none", "r_truth_median": mean_r(ref, A_true), "r_truth_min": "",
                             "r_nonprivate_median": 1.0, "pca_epsilon": "", "seeds": 1})
                print(rows[-1], flush=True)
                cfg0 = base_config(tmp, n_sites, **kw)
                for eps in epsilons:
                    try:
                        cfg = planned(cfg0, lengths, eps, dim=P)
                    except ConfigError as exc:  # e.g. 40 ICA rounds cannot share a small total
                        print(f"{row0} eps {eps}: refused by the planner ({exc})", flush=True)
                        continue
                    rt, rn = [], []
                    for seed in seeds:
                        maps = run_maps(replace(cfg, seed=seed), X_sites, lengths, parcellations[P])
                        rt.append(mean_r(maps, A_true))
                        rn.append(mean_r(maps, ref))
                    rows.append({**row0, "epsilon": eps, "r_truth_median": statistics.median(rt),
                                 "r_truth_min": min(rt), "r_nonprivate_median": statistics.median(rn),
                                 "pca_epsilon": round(cfg.pca_epsilon, 3), "seeds": len(seeds)})
                    print(rows[-1], flush=True)
    runtime = time.perf_counter() - t0
    suffix = "_quick" if args.quick else ""
    RESULTS.mkdir(exist_ok=True)
    keys = ["subjects", "ica", "parcels", "contribution", "bound", "epsilon", "r_truth_median", "r_truth_min",
            "r_nonprivate_median", "pca_epsilon", "seeds"]
    with open(RESULTS / f"frontier{suffix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keys})
    meta = {"model": "networks", "space": SPACE, "n_components": N_COMPONENTS, "n_sites": n_sites,
            "timepoints": T, "tr": TR, "subjects_per_site": list(subjects_grid), "epsilons": list(epsilons),
            "runs": [list(r) for r in runs], "seeds": len(seeds), "delta": 1e-5,
            "parcel_ceiling": {str(k): v for k, v in ceiling.items()},
            "subject_frobenius_percentiles": {f"{k[0]} subjects, {k[1]} parcels": v for k, v in frob.items()},
            "generation_s": gen_s, "runtime_s": runtime}
    (RESULTS / f"frontier{suffix}.json").write_text(json.dumps(meta, indent=1))
    if not args.quick:
        figure(rows, subjects_grid, RESULTS / "frontier.png")
    print(f"wrote {RESULTS / f'frontier{suffix}.csv'} in {runtime:.0f} s")
    return 0


_LABELS = {"ica": str, "contribution": str, "parcels": lambda v: f"{v} parcels", "bound": lambda v: f"bound {v:g}"}


def figure(rows, subjects_grid, path: Path, *, series=("ica", "parcels", "contribution", "bound"),
           value="r_truth_median",
           ylabel="maps: mean |r| with the true networks", hline=None) -> None:
    """One panel per consortium size: ``value`` against the total eps, one line per ``series`` key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(subjects_grid), figsize=(4.2 * len(subjects_grid), 3.6), sharey=True)
    for ax, subjects in zip(np.atleast_1d(axes), subjects_grid):
        here = [r for r in rows if r["subjects"] == subjects and r["epsilon"] != "none" and r[value] != ""]
        for key in sorted({tuple(r[k] for k in series) for r in here}):
            pts = [(r["epsilon"], r[value]) for r in here if tuple(r[k] for k in series) == key]
            ax.plot(*zip(*pts), "o-" if key[0] == "spatial" else "s--",
                    label=", ".join(_LABELS[k](v) for k, v in zip(series, key)))
        if hline is not None:
            ax.axhline(hline, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{subjects} subjects per site")
        ax.set_xlabel("total epsilon per site (headline)")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel(ylabel)
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
