"""dpneuro against the centralized, non-private tools a user would otherwise pick, on the same synthetic data.

Data: one ``dpneuro.datasets.synth`` consortium (real 4-D NIfTI files) with the data set
of ``dpneuro demo`` (read from ``dpneuro.cli.DEMO`` at run time; at the time of
writing the MNI152 6 mm brain mask, D = 8,735 voxels, 4 sites x 32 subjects x
120 volumes, R = 8 ground-truth maps), noise 0.5, seed 0. Generated once;
every method reads the same files. The settings used are in the JSON.

A. From the NIfTI files to R spatial maps (what each tool does end to end):

``CanICA``            nilearn's group spatial ICA on the voxels, its defaults
                      (6 mm smoothing, standardize, detrend, 10 FastICA
                      inits) with the consortium mask (works offline).
``dpneuro none``      ``dpneuro run`` in-process (Pydra workflow: load,
                      capePCA, capeDJICA, maps, report) with plan "none"
                      (not private) on the demo's number of data-independent
                      parcels (``dpneuro.data.parcellation``).
``dpneuro cape``      the same workflow with plan "cape" and capeDJICA's
                      privacy settings (FULL: pca_epsilon 16 without a subject
                      bound, eps_i 0.7, 40 rounds, clipping 0.7; the temporal
                      model, which B compares with FastICA and infomax); the
                      total epsilon per site at delta = 1e-5 is in the table.
                      The default spatial model's numbers on the same data
                      are those of ``benchmarks/demo_speed.py``.

B. Unmixing only, on the same whitened data Z: the non-private dpneuro run's
loaded parcel data with every time point scaled to unit norm (the scaling that
bounds a subject's influence for DP) and whitened with the run's PCA basis,
exactly as a dpneuro site does (R x all time points):

``FastICA``           scikit-learn FastICA(whiten=False), its defaults.
``MNE infomax``       mne.preprocessing.infomax, its defaults (extended infomax).
``capeDJICA none``    the pipeline's own unmixing code (``unmix_inprocess``:
                      site whitening + capeDJICA with the run's settings), plan "none".
``capeDJICA cape``    the same with plan "cape" (ICA private; this Z comes from a
                      non-private PCA, so only the ICA's epsilon is counted).

C. FastICA and MNE infomax again, on a conventional whitening of the same
parcel data (pooled PCA, no unit-norm scaling), which is what these tools are
usually given. The unit-norm scaling multiplies every time point by its own
factor, so the whitened components become a scale mixture; in our runs
FastICA and extended infomax suffer from it and dpneuro's infomax does not
(compare B and C).

Map quality: the estimated maps (CanICA's components; V Lambda^{1/2} W^{-1}
painted back from parcels to voxels for the others) against the true maps:
mean |Pearson r| after Hungarian matching (``dpneuro.algorithms.metrics.match_components``;
the JSON also gives the parcel ceiling, the true maps averaged within parcels),
and qNGI of W (A_w) where an unmixing matrix of the whitened data exists
(not for CanICA, which never forms one). Time: wall clock and CPU time
(process plus children, all threads) of each method, median over repeats;
``ratio`` columns are per repeat (same run, same machine state) and then the
median: the method's time over the reference's (CanICA in A, FastICA in B and C).
BLAS threads are left at each library's default, as a user would run them.

    python benchmarks/centralized_tools.py            # full: 3 repeats, about 5-8 minutes on 2 cores
    python benchmarks/centralized_tools.py --quick    # seconds-long smoke run on grid30 (writes *_quick.*)

Writes benchmarks/results/centralized_tools.{csv,json,png}.
"""

from __future__ import annotations

import os

os.environ.setdefault("MPLBACKEND", "Agg")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from dpneuro.algorithms.djica import spatial_maps  # noqa: E402
from dpneuro.algorithms.metrics import match_components, qngi  # noqa: E402
from dpneuro.run.pipeline import public_results  # noqa: E402
from dpneuro.run.stages import unmix_inprocess  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

#: fallback when ``dpneuro demo``'s settings cannot be read (the full run follows the demo, see demo_settings)
#: the privacy settings are capeDJICA's (temporal ICA, the unmixing this benchmark compares with FastICA and
#: infomax) as the demo ran it before spatial ICA and the subject bound became the defaults
FULL = dict(space="mni6mm", sites=4, subjects=16, components=8, timepoints=100, parcels=200, noise=0.5,
            pca_epsilon=16.0, ica_epsilon_i=0.7, ica_rounds=40, clip=0.7, repeats=3)
_DEMO_KEYS = ("space", "sites", "subjects", "components", "timepoints", "parcels")


def demo_settings() -> dict:
    """The data set and privacy settings of ``dpneuro demo`` (so plan "cape" here is what the demo runs)."""
    try:
        from dpneuro.cli import DEMO
    except ImportError:  # pragma: no cover - the CLI is optional here
        DEMO = {}
    return {**FULL, **{k: DEMO[k] for k in _DEMO_KEYS if k in DEMO}, "from_demo": bool(DEMO)}
QUICK = dict(space="grid30", sites=3, subjects=4, components=4, timepoints=60, parcels=0, noise=0.5,
             pca_epsilon=4.0, ica_epsilon_i=2.0, ica_rounds=20, repeats=1)
DELTA = 1e-5


def _cpu() -> float:
    """CPU seconds of this process (all threads) and its finished children."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class Clock:
    def __enter__(self):
        self.t, self.c = time.perf_counter(), _cpu()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.t, _cpu() - self.c


# -- quality -------------------------------------------------------------------------------------

def map_quality(maps_vox: np.ndarray, A_true: np.ndarray) -> float:
    """Mean |r| of Hungarian-matched estimated maps (voxels x R) with the true maps."""
    _, corr = match_components(maps_vox, A_true)
    return float(np.mean(np.abs(corr)))


class Whitening:
    """Whitened data of every site, with what is needed to score an unmixing matrix of them."""

    def __init__(self, V, lam, X_sites, parcels, A_true, unit: bool):
        from dpneuro.run.roles import site_whiten

        self.V, self.lam, self.parcels, self.A_true = V, lam, parcels, A_true
        if unit:  # exactly what a dpneuro site does: unit-norm time points, then the public basis
            self.Z = [site_whiten(X, V, lam) for X in X_sites]
        else:
            self.Z = [((V / np.sqrt(lam)).T @ X).astype(np.float32) for X in X_sites]
        A_red = parcels.reduce(A_true) if parcels is not None else A_true
        self.Aw = (V / np.sqrt(lam)).T @ A_red  # true mixing in this whitened space

    def maps(self, W: np.ndarray) -> np.ndarray:
        A = spatial_maps(self.V, self.lam, W)
        return self.parcels.expand(A) if self.parcels is not None else A

    def quality(self, W: np.ndarray) -> dict:
        return {"mean_abs_r": map_quality(self.maps(W), self.A_true), "qngi": qngi(W @ self.Aw)}


class Reference:
    """A finished dpneuro run: its loaded site data, basis, parcels and W, and two whitenings of the data.

    ``unit``: the run's own whitened data (unit-norm time points, the run's PCA basis), what capeDJICA
    unmixes. ``raw``: conventional whitening of the same loaded parcel data (pooled PCA without the
    unit-norm scaling), what FastICA or infomax would usually be given.
    """

    def __init__(self, cfg, A_true: np.ndarray, R: int):
        from dpneuro.data.parcellation import Parcellation

        work = Path(cfg.out) / "work"  # the stage cache; the outputs are in the run's folder
        red = public_results(json.loads(next(work.glob("reduce-*/reduce.json")).read_text())["chain"])["reduce"]
        space = json.loads(next(work.glob("space-*/space.json")).read_text())
        sites = sorted((json.loads(p.read_text()) for p in work.glob("load-*/site.json")), key=lambda s: s["site"])
        parcels = Parcellation(np.load(space["parcels"])) if space["parcels"] else None
        self.X = [np.load(s["X"]) for s in sites]
        self.lengths = [[b - a for a, b in s["boundaries"]] for s in sites]
        self.V, self.lam = red["basis"], red["eigenvalues"]
        self.unit = Whitening(self.V, self.lam, self.X, parcels, A_true, unit=True)
        Xall = np.concatenate(self.X, axis=1).astype(np.float64)
        lam, V = np.linalg.eigh(Xall @ Xall.T / Xall.shape[1])
        self.raw = Whitening(V[:, ::-1][:, :R], lam[::-1][:R], self.X, parcels, A_true, unit=False)
        self.W_run = np.load(cfg.run_dir / "W.npy")
        # the best any method working on these parcels can do: the true maps averaged within parcels
        self.ceiling = (map_quality(parcels.expand(parcels.reduce(A_true)), A_true) if parcels is not None
                        else 1.0)


# -- the methods ------------------------------------------------------------------------------

def run_canica(files, mask, R, seed):
    from nilearn.decomposition import CanICA

    ica = CanICA(n_components=R, mask=mask, random_state=seed, memory=None, n_jobs=1, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ica.fit(files)
    return ica.components_.T  # voxels (mask order) x R


def run_dpneuro(manifest, data_dir, out, cfg_over: dict, plan: str, seed: int):
    from dpneuro.config import RunConfig
    from dpneuro.workflows import run_workflow

    cfg = RunConfig.from_dict(dict(
        sites=[{"name": s["site"], "path": s["path"]} for s in manifest["sites"]], out=str(out),
        mask=manifest["mask"], truth=str(data_dir), seed=seed, plan=plan, **cfg_over)).validate()
    return cfg, run_workflow(cfg)


def privacy_of(maps_json: str) -> float:
    maps = json.loads(Path(maps_json).read_text())
    priv = json.loads(Path(maps["privacy"]).read_text())
    return max(s["epsilon"] for s in priv["sites"].values())  # against the aggregator and its colluders


def run_fastica(Z, R, seed):
    from sklearn.decomposition import FastICA

    ica = FastICA(n_components=R, whiten=False, random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence warnings are part of the result
        ica.fit(np.concatenate(Z, axis=1).T.astype(np.float64))
    return ica.components_  # sources = W @ Z


def run_infomax(Z, seed):
    from mne.preprocessing import infomax

    return infomax(np.concatenate(Z, axis=1).T.astype(np.float64), rng=seed, verbose=False)


def plot(rows: list[dict], title: str, repeats: int, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    y = np.arange(len(rows))
    colors = ["tab:gray" if r["eps_total"] == float("inf") else "tab:red" for r in rows]
    ax1.barh(y, [r["wall_s"] for r in rows], color=colors)
    ax1.set_xscale("log")
    ax1.set_yticks(y, [f"{r['group']}: {r['method']}" for r in rows])
    ax1.invert_yaxis()
    ax1.set_xlabel(f"wall seconds (median of {repeats}); red: private")
    ax2.barh(y, [r["mean_abs_r"] for r in rows], color=colors)
    for yi, r in zip(y, rows):
        txt = f"qNGI {r['qngi']:.3f}" if np.isfinite(r["qngi"]) else ""
        if np.isfinite(r["eps_total"]):
            txt += f", eps {r['eps_total']:.0f}"
        inside = r["mean_abs_r"] > 0.45  # the label fits in the bar; else it goes after it
        ax2.text(0.02 if inside else r["mean_abs_r"] + 0.02, yi, txt, va="center", fontsize=7,
                 color="w" if inside else "k")
    ax2.set_yticks(y, [])
    ax2.invert_yaxis()
    ax2.set_xlim(0, 1)
    ax2.set_xlabel("mean |r| with the true maps (Hungarian-matched)")
    fig.suptitle(f"{title}: A = files to maps, B = unmixing of dpneuro's whitened data, "
                 "C = of conventionally whitened data", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run (grid30, 12 subjects)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 3; quick 1)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    a = ap.parse_args(argv)
    P = dict(QUICK) if a.quick else demo_settings()
    repeats = a.repeats or P["repeats"]
    name = "centralized_tools_quick" if a.quick else "centralized_tools"
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="dpneuro_central_"))
    t_all = time.perf_counter()
    from dpneuro.datasets.synth import make_consortium

    with Clock() as c_syn:
        manifest = make_consortium(work / "data", n_sites=P["sites"], subjects_per_site=P["subjects"],
                                   n_components=P["components"], n_timepoints=P["timepoints"], space=P["space"],
                                   random_state=0, noise=P["noise"])
    files = [s["path"] for site in manifest["sites"] for s in site["subjects"]]
    A_true = np.load(manifest["truth"]["A"]).astype(np.float64)
    R = P["components"]
    print(f"data: {P['space']} ({manifest['n_voxels']} voxels), {len(files)} subjects x {P['timepoints']} volumes, "
          f"R = {R}; synthesized in {c_syn.wall:.0f} s", flush=True)
    cfg_over = dict(parcels=P["parcels"], n_components=R, pca_epsilon=P["pca_epsilon"],
                    ica_epsilon_i=P["ica_epsilon_i"], ica_rounds=P["ica_rounds"], delta=DELTA, ica="temporal",
                    pca_subject_bound=1.0)
    if "clip" in P:
        cfg_over.update(clip_G=P["clip"], clip_h=P["clip"])

    runs = []  # one dict per (repeat, method)
    for rep in range(repeats):
        rec = {}
        # A. end to end from the files
        with Clock() as c:
            comps = run_canica(files, manifest["mask"], R, seed=rep)
        rec["CanICA"] = dict(group="A", wall=c.wall, cpu=c.cpu, mean_abs_r=map_quality(comps, A_true),
                             qngi=float("nan"), eps=float("inf"))
        out_none = work / f"run-none-{rep}"
        with Clock() as c:
            cfg, res = run_dpneuro(manifest, work / "data", out_none, cfg_over, "none", seed=rep)
        ref = Reference(cfg, A_true, R)
        rec["dpneuro none"] = dict(group="A", wall=c.wall, cpu=c.cpu, **ref.unit.quality(ref.W_run),
                                   eps=float("inf"))
        out_cape = work / f"run-cape-{rep}"
        with Clock() as c:
            cfg_c, res_c = run_dpneuro(manifest, work / "data", out_cape, cfg_over, "cape", seed=rep)
        ref_c = Reference(cfg_c, A_true, R)
        rec["dpneuro cape"] = dict(group="A", wall=c.wall, cpu=c.cpu, **ref_c.unit.quality(ref_c.W_run),
                                   eps=privacy_of(res_c["maps"]))
        # B. unmixing only, on the non-private run's own whitened data (unit-norm time points)
        with Clock() as c:
            W = run_fastica(ref.unit.Z, R, seed=rep)
        rec["FastICA"] = dict(group="B", wall=c.wall, cpu=c.cpu, **ref.unit.quality(W), eps=float("inf"))
        with Clock() as c:
            W = run_infomax(ref.unit.Z, seed=rep)
        rec["MNE infomax"] = dict(group="B", wall=c.wall, cpu=c.cpu, **ref.unit.quality(W), eps=float("inf"))
        for plan in ("none", "cape"):
            # the pipeline's own unmixing code (site whitening + capeDJICA with the run's settings)
            with Clock() as c:
                u = unmix_inprocess(replace(cfg, plan=plan), ref.X, ref.lengths, ref.V, ref.lam)
            eps = (max(led.epsilon(DELTA, collusion=True) for led in u.ledgers if led is not None)
                   if plan != "none" else float("inf"))
            rec[f"capeDJICA {plan}"] = dict(group="B", wall=c.wall, cpu=c.cpu, **ref.unit.quality(u.W), eps=eps)
        # C. conventional whitening of the same parcel data (no unit-norm scaling), as these tools expect
        with Clock() as c:
            W = run_fastica(ref.raw.Z, R, seed=rep)
        rec["FastICA (raw whitening)"] = dict(group="C", wall=c.wall, cpu=c.cpu, **ref.raw.quality(W),
                                              eps=float("inf"))
        with Clock() as c:
            W = run_infomax(ref.raw.Z, seed=rep)
        rec["MNE infomax (raw whitening)"] = dict(group="C", wall=c.wall, cpu=c.cpu, **ref.raw.quality(W),
                                                  eps=float("inf"))
        for method, r in rec.items():
            refm = {"A": "CanICA", "B": "FastICA", "C": "FastICA (raw whitening)"}[r["group"]]
            runs.append(dict(repeat=rep, method=method, **r, wall_ratio=r["wall"] / rec[refm]["wall"],
                             cpu_ratio=r["cpu"] / rec[refm]["cpu"], reference=refm))
        print(f"repeat {rep + 1}/{repeats}: " + ", ".join(f"{m} {r['wall']:.1f} s" for m, r in rec.items()),
              flush=True)
        for d in (out_none, out_cape):
            shutil.rmtree(d, ignore_errors=True)

    order = list(dict.fromkeys(r["method"] for r in runs))
    rows = []
    for m in order:
        rs = [r for r in runs if r["method"] == m]
        med = lambda k: float(np.median([r[k] for r in rs]))  # noqa: E731
        rows.append({"group": rs[0]["group"], "method": m, "wall_s": med("wall"), "cpu_s": med("cpu"),
                     "reference": rs[0]["reference"], "wall_ratio": med("wall_ratio"), "cpu_ratio": med("cpu_ratio"),
                     "mean_abs_r": med("mean_abs_r"), "qngi": med("qngi"), "eps_total": med("eps"),
                     "repeats": len(rs)})
    with open(a.out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    import mne
    import nilearn
    import sklearn

    run_cfg = {k: v for k, v in cfg.to_json().items() if k not in ("sites", "out", "mask", "truth", "seed")}
    meta = {"setup": P, "delta": DELTA, "dpneuro_config": run_cfg, "parcel_ceiling_mean_abs_r": ref.ceiling,
            "n_voxels": manifest["n_voxels"], "n_subjects": len(files),
            "repeats": repeats, "synth_seconds": c_syn.wall, "wall_seconds": time.perf_counter() - t_all,
            "versions": {"nilearn": nilearn.__version__, "scikit-learn": sklearn.__version__,
                         "mne": mne.__version__, "numpy": np.__version__},
            "date": time.strftime("%Y-%m-%d"), "runs": runs}
    (a.out / f"{name}.json").write_text(json.dumps(meta, indent=1))

    print(f"\n{'group':5} {'method':28} {'wall s':>8} {'CPU s':>8} {'ratio wall':>10} {'ratio CPU':>9} "
          f"{'mean|r|':>8} {'qNGI':>6} {'eps':>7}   (median of {repeats}; ratio vs CanICA in A, FastICA in B and C)")
    for r in rows:
        print(f"{r['group']:5} {r['method']:28} {r['wall_s']:8.2f} {r['cpu_s']:8.2f} {r['wall_ratio']:10.3f} "
              f"{r['cpu_ratio']:9.3f} {r['mean_abs_r']:8.3f} {r['qngi']:6.3f} {r['eps_total']:7.1f}")

    print(f"parcel ceiling (true maps averaged within the parcels): mean |r| {ref.ceiling:.3f}")
    plot(rows, f"{P['space']}, {len(files)} subjects x {P['timepoints']} volumes, R = {R}", repeats,
         a.out / f"{name}.png")
    if a.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nwrote {a.out / (name + '.csv')}, .json, .png in {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
