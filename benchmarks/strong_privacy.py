"""Real fMRI at strong privacy (total eps 1 to 8): what each remaining lever buys at 4 x 100 subjects.

The real-data pseudo-consortia of ``real_frontier.py`` (4 sites x 100
pseudo-subjects drawn from 33 real people, 150-volume windows, 122 regions),
the product's default run (spatial ICA on subject subspaces, bound 0.25, the
planner splitting each total eps). Every lever is measured on the product's
own release (``dpneuro.algorithms.pca.cape_pca`` at the planner's
``pca_epsilon``: the same noise and sensitivity as a run), then the same
post-processing as a run (top eigenvectors, the stable spatial ICA). Cell: mean
matched |r| of the private maps with the same lever's non-private maps
("own"), and with the default's non-private maps at 122 regions and 20
components ("default"), median of 3 noise seeds.

Levers (none is the default; the table says why):

* ``rank r``: a subject adds the projector on its top r < 20 (or > 20)
  principal directions instead of 20, scaled to the same norm bound.
* ``weights a``: a subject adds U diag(s^a) U^T (its singular values s to the
  power a, normalised to the same norm): between the subspace (a = 0) and the
  second moment (a = 2).
* ``features g``: the 122 regions merged into g groups by k-means of the
  atlas's region centroids (public geometry), the group means as features;
  maps painted back to the regions. Fewer features shrink the noise's edge
  2 sigma sqrt(D).
* ``components k``: fewer components than 20; "default" then matches the k
  maps to the best k of the default's 20.
* ``public prior b``: 11 of the 33 people stand for a public dataset, the
  consortium is drawn from the other 22; the aggregator adds b times the
  public people's mean projector (trace 1, as the release's) to the released
  matrix before the eigendecomposition: post-processing with public data. Its
  cells compare with the 22 people's own non-private maps (b = 0: that
  consortium without the prior); ``public data alone`` is the public matrix
  without the release. The "public" people come from the same study, task and
  atlas as the consortium: a public dataset's best case.

Limits (``--part limits``): at the sizes and budgets of the strong-privacy
targets (4 x 50 and 4 x 100 subjects, eps 1 to 8), what caps the default's
maps. Against the same size's non-private maps: the default's private maps;
FastICA on the released basis started from the rotation closest to the
non-private maps (where the ICA's criterion lands from a perfect start, not
what a run can do); and two ceilings of the released top 20 eigenvectors:
per map, each non-private map's largest |r| with any map in their span; and
for a rotation, the largest mean matched |r| any rotation of the whitened
basis reaches (the maps of every spatial ICA of the release are such a
rotation, so none can agree more). A random basis (no data) gives the chance
level of each.

    python benchmarks/strong_privacy.py            # ~20 min on 2 cores
    python benchmarks/strong_privacy.py --part limits   # the limits alone, ~4 min
    python benchmarks/strong_privacy.py --quick    # smoke run (writes *_quick.*)

Writes benchmarks/results/strong_privacy.{csv,json} (levers) and
strong_privacy_limits.{csv,json} (limits).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import base_config, mean_r, write_results  # noqa: E402
from real_frontier import N_SITES, WINDOW, pseudo_consortium, real_subjects  # noqa: E402

from dpneuro.algorithms import pca  # noqa: E402
from dpneuro.algorithms.djica import spatial_maps  # noqa: E402
from dpneuro.algorithms.spatial_ica import guided_ica, spatial_ica  # noqa: E402
from dpneuro.run.planner import SiteShape, plan_for_target  # noqa: E402

K = 20
EPSILONS = (1.0, 2.0, 4.0, 8.0)
PUBLIC_PEOPLE = 11  # of the 33: the "public dataset" of the prior lever
LEVERS = ([("default", None)] + [("rank r", r) for r in (10, 15, 30)] + [("weights a", a) for a in (0.5, 1.0)]
          + [("features g", g) for g in (40, 61, 90)] + [("components k", k) for k in (5, 10)]
          + [("public prior b", b) for b in (0.0, 0.5, 1.0, 2.0)])
#: the strong-privacy targets (issue 36): (subjects per site, total eps) -> mean |r| with the non-private maps
GOALS = {(100, 1.0): 0.6, (100, 2.0): 0.75, (100, 4.0): 0.85, (50, 4.0): 0.7}
LIMIT_SUBJECTS = (50, 100)


@contextlib.contextmanager
def contribution_shape(rank: int = K, alpha: float = 0.0):
    """Subjects add n_m U diag(w) U^T, U their top ``rank`` directions, w ~ s^alpha with ||w|| = 1/sqrt(k).

    The norm is the default's (n_m / sqrt(k)), so the release's sensitivity, and its noise, are unchanged.
    """
    original = pca.subject_factors

    def shaped(B, contribution, k, bound):
        L = pca.subspace_factor(B, rank)  # B L = U
        s = np.linalg.norm(B.T @ (B @ L), axis=0)
        w = s ** alpha
        w = w / np.linalg.norm(w) / math.sqrt(k)
        return L * np.sqrt(B.shape[1] * w)

    pca.subject_factors = shaped
    try:
        yield
    finally:
        pca.subject_factors = original


def release(X_sites, lengths, k: int, eps: float | None, seed: int) -> np.ndarray:
    """The aggregator's released matrix of the default run at total ``eps`` (None: without noise)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = base_config(Path(tmp), len(X_sites), ica="spatial", pca_contribution="subspace", parcels=0,
                          n_components=k)
        if eps is not None:
            cfg = plan_for_target(cfg, [SiteShape(s.name, tuple(ln)) for s, ln in zip(cfg.sites, lengths)],
                                  X_sites[0].shape[0], eps).config
    res = pca.cape_pca(X_sites, k, cfg.pca_epsilon if eps is not None else None, cfg.pca_delta,
                       plan="cape" if eps is not None else "none", subjects=lengths, scale="unit",
                       contribution="subspace", subject_bound=cfg.pca_subject_bound, random_state=seed)
    return res.info["A_hat"]


def maps_of(A: np.ndarray, k: int) -> np.ndarray:
    """The run's post-processing of a released matrix: top-k eigenpairs, stable spatial ICA, maps (D x k)."""
    lam, V = pca.top_eigh(A, k)
    lam = np.maximum(lam, 1e-12 * max(float(lam[0]), 1e-300))
    return spatial_maps(V, lam, spatial_ica(V, lam).W)


def agree(maps: np.ndarray, ref: np.ndarray) -> float:
    """Mean matched |r| of ``maps`` with ``ref``; fewer maps than ``ref`` are matched to its best ones."""
    return mean_r(ref, maps) if maps.shape[1] < ref.shape[1] else mean_r(maps, ref)


def subspace_ceilings(basis: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(per map, rotation): how far maps built from span(``basis``) can agree with ``ref``'s maps (mean |r|).

    Per map: the mean over ``ref``'s maps of the largest |r| any map in the span reaches with it (correlation
    centres both, so the best map is the centred reference's projection on the centred span). Rotation: the
    largest mean matched |r| of maps that are a rotation of the whitened basis, as a spatial ICA's are: with
    Z the whitened centred basis and C = Z^T ref_std / D (the correlations of its directions with the
    references), a rotation U and any matching and signs give sum |r| = tr(U'^T C) for an orthogonal U',
    at most C's nuclear norm, which the Procrustes rotation reaches.
    """
    Zc = basis - basis.mean(axis=0)
    Q, _ = np.linalg.qr(Zc)
    R = (ref - ref.mean(axis=0)) / ref.std(axis=0)
    D, k = ref.shape
    per_map = float(np.mean(np.linalg.norm(Q.T @ R, axis=0) / np.sqrt(D)))
    rotation = float(np.linalg.svd(Q.T @ R / np.sqrt(D), compute_uv=False).sum() / k)
    return per_map, rotation


def limit_row(subjects: int, epsilon, ref: np.ndarray, bases: list, maps: list, guided: list | None = None) -> dict:
    """One row of the limits table: medians over the draws' bases and maps, the best draw's rotation ceiling."""
    ceilings = [subspace_ceilings(V, ref) for V in bases]
    rotation = [c[1] for c in ceilings]
    return {"subjects": subjects, "epsilon": epsilon, "goal": GOALS.get((subjects, epsilon), ""),
            "maps_median": statistics.median(agree(m, ref) for m in maps),
            "guided_median": statistics.median(agree(m, ref) for m in guided) if guided else "",
            "map_ceiling_median": statistics.median(c[0] for c in ceilings),
            "rotation_ceiling_median": statistics.median(rotation), "rotation_ceiling_max": max(rotation)}


def limits(runs, subjects_grid, epsilons, seeds) -> list[dict]:
    """Per size and budget: the default's maps, FastICA from the best rotation, the two ceilings."""
    rows = []
    for subjects in subjects_grid:
        X, ln = pseudo_consortium(runs, subjects, N_SITES, WINDOW, seed=1)
        X = [x.astype(np.float64) for x in X]
        ref = maps_of(release(X, ln, K, None, 0), K)
        # chance: a random basis (no data) through the same spatial ICA
        bases = [np.linalg.qr(np.random.default_rng(1000 + s).standard_normal((len(ref), K)))[0] for s in seeds]
        rows.append(limit_row(subjects, "random basis", ref, bases, [spatial_ica(V, np.ones(K)).maps for V in bases]))
        print(rows[-1], flush=True)
        for eps in epsilons:
            released = [release(X, ln, K, eps, s) for s in seeds]
            bases = [pca.top_eigh(A, K)[1] for A in released]
            rows.append(limit_row(subjects, eps, ref, bases, [maps_of(A, K) for A in released],
                                  [guided_ica(V, ref).maps for V in bases]))
            print(rows[-1], flush=True)
    return rows


def centroid_groups(atlas, n_groups: int) -> np.ndarray:
    """Group of each region: k-means of the atlas's region centroids (mm), fixed seed."""
    import nibabel as nib
    from sklearn.cluster import KMeans

    lab = np.asarray(atlas.dataobj).astype(np.int64)
    n = int(lab.max())
    ijk = np.array([np.argwhere(lab == v).mean(0) for v in range(1, n + 1)])
    xyz = nib.affines.apply_affine(atlas.affine, ijk)
    return KMeans(n_groups, n_init=10, random_state=0).fit_predict(xyz)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small consortium, two levers, one budget, one seed")
    ap.add_argument("--part", choices=("all", "levers", "limits"), default="all")
    args = ap.parse_args(argv)
    d, runs = real_subjects()
    suffix = "_quick" if args.quick else ""
    if args.part in ("all", "limits"):
        t0 = time.perf_counter()
        grid, epsilons, seeds = (LIMIT_SUBJECTS, EPSILONS, (0, 1, 2)) if not args.quick else ((12,), (4.0,), (0,))
        rows = limits(runs, grid, epsilons, seeds)
        meta = {"n_sites": N_SITES, "window": WINDOW, "regions": runs[0][0].shape[0], "n_components": K,
                "epsilons": list(epsilons), "seeds": len(seeds), "subjects": list(grid),
                "runtime_s": time.perf_counter() - t0}
        write_results("strong_privacy_limits" + suffix, rows, meta, digits=3)
    if args.part in ("all", "levers"):
        lever_rows(d, runs, args.quick, suffix)
    return 0


def lever_rows(d, runs, quick: bool, suffix: str) -> None:
    """Each lever's private maps at 4 x 100 subjects against its own and the default's non-private maps."""
    t0 = time.perf_counter()
    subjects, epsilons, seeds, levers = 100, EPSILONS, (0, 1, 2), LEVERS
    if quick:
        subjects, epsilons, seeds = 12, (4.0,), (0,)
        levers = [("default", None), ("rank r", 10), ("features g", 40), ("components k", 5), ("public prior b", 1.0)]

    def consortium(people):
        X, ln = pseudo_consortium(people, subjects, N_SITES, WINDOW, seed=1)
        return [x.astype(np.float64) for x in X], ln

    X_all, len_all = consortium(runs)
    X_con, len_con = consortium(runs[PUBLIC_PEOPLE:])
    default_ref = maps_of(release(X_all, len_all, K, None, 0), K)
    A_pub = con_ref = None  # the prior levers': the public people's matrix, the other 22's non-private maps
    rows = []
    for lever, value in levers:
        X, ln, k, shape, paint, ref_default = X_all, len_all, K, {}, None, default_ref
        if lever == "rank r":
            shape = {"rank": value}
        elif lever == "weights a":
            shape = {"alpha": value}
        elif lever == "components k":
            k = value
        elif lever == "features g":
            groups = centroid_groups(d["atlas"], value)
            G = np.zeros((value, len(groups)))
            G[groups, np.arange(len(groups))] = 1.0
            X = [(G / G.sum(1, keepdims=True)) @ x for x in X]
            paint = G.T  # a region takes its group's value
        elif lever == "public prior b":
            X, ln = X_con, len_con
            if A_pub is None:
                blocks = [np.hstack(p) for p in runs[:PUBLIC_PEOPLE]]
                A_pub = release([np.hstack(blocks)], [[b.shape[1] for b in blocks]], K, None, 0)
                con_ref = maps_of(release(X, ln, K, None, 0), K)
            ref_default = con_ref
        prior = value * A_pub if lever == "public prior b" else 0.0

        def maps(eps, seed):
            with contribution_shape(**shape) if shape else contextlib.nullcontext():
                A = release(X, ln, k, eps, seed)
            M = maps_of(A + prior, k)
            return M if paint is None else paint @ M

        own = maps(None, 0) if lever != "public prior b" else ref_default
        label = lever if value is None else f"{lever} = {value:g}"
        row = {"lever": label, "none_vs_default": agree(own, default_ref) if lever != "public prior b" else ""}
        for eps in epsilons:
            got = [maps(eps, s) for s in seeds]
            row[f"own_{eps:g}"] = statistics.median(agree(m, own) for m in got)
            row[f"default_{eps:g}"] = statistics.median(agree(m, ref_default) for m in got)
        rows.append(row)
        print(row, flush=True)
    if A_pub is not None:
        alone = mean_r(maps_of(A_pub, K), con_ref)
        rows.append({"lever": "public data alone", "none_vs_default": "",
                     **{f"{c}_{e:g}": alone for e in epsilons for c in ("own", "default")}})
        print(rows[-1], flush=True)
    meta = {"subjects_per_site": subjects, "n_sites": N_SITES, "window": WINDOW, "regions": X_all[0].shape[0], "n_components": K, "epsilons": list(epsilons), "seeds": len(seeds),
            "public_people": PUBLIC_PEOPLE, "people": len(runs), "runtime_s": time.perf_counter() - t0}
    write_results("strong_privacy" + suffix, rows, meta, digits=3)


if __name__ == "__main__":
    sys.exit(main())
