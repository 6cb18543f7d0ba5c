"""Power-mode capePCA at voxel level: 2 mm MNI brain (D = 235,375), sites as separate processes.

Data: nilearn's MNI152 2 mm brain mask (235,375 voxels); S sites x M subjects
x T time points from a low-rank + noise model (k spatially smooth maps inside
the mask with decreasing strengths, Gaussian time courses, white noise), one
float32 ``.npy`` file per subject. Every site streams its subjects one at a time
(``np.load`` of one file per block: one subject in memory) and every time point
is scaled to unit norm (``scale="unit"``), the fMRI unit being one subject.

Each run has the aggregator in this process and every site in its own OS
process over a :class:`~dpneuro.protocol.exchange.DirectoryExchange`; the site processes
report wall time, CPU time, peak resident memory (``ru_maxrss``) and the peak
of traced allocations (``tracemalloc``: numpy arrays included).

Reference: the exact top-k captured energy q_o of the pooled (unit-scaled)
second-moment matrix, from the eigenvalues of the N x N Gram matrix.
Target: plan "none" (epsilon = inf) within 1% of q_o. A DP run (plan "cape",
subject level) is reported as well, for its cost and honest utility.

Writes benchmarks/results/pca_power.csv, .json and .png (``_quick`` with --quick).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


# -- data ---------------------------------------------------------------------------------

def brain_mask(quick: bool) -> np.ndarray:
    if quick:
        from dpneuro.data.images import load_space

        return load_space("mni6mm")[0]
    from nilearn import datasets

    return np.asarray(datasets.load_mni152_brain_mask(resolution=2).dataobj) > 0


def make_data(workdir: Path, mask: np.ndarray, k: int, S: int, M: int, T: int, seed: int) -> list[list[str]]:
    """Write one float32 D x T file per subject; return the per-site file lists."""
    from scipy.ndimage import gaussian_filter

    rng = np.random.default_rng(seed)
    D = int(mask.sum())
    maps = np.empty((D, k))
    for j in range(k):  # smooth random fields inside the brain
        maps[:, j] = gaussian_filter(rng.standard_normal(mask.shape), sigma=2.5)[mask]
    maps = np.linalg.qr(maps)[0] * np.sqrt(np.geomspace(1.0, 0.05, k))[None, :]
    sites = []
    for s in range(S):
        files = []
        for m in range(M):
            X = maps @ rng.standard_normal((k, T)) + rng.standard_normal((D, T)) / np.sqrt(D)
            f = workdir / f"site{s}" / f"sub{m:02d}.npy"
            f.parent.mkdir(parents=True, exist_ok=True)
            np.save(f, X.astype(np.float32))
            files.append(str(f))
        sites.append(files)
    return sites


def load_unit(files) -> np.ndarray:
    X = np.hstack([np.load(f) for f in files])
    X /= np.linalg.norm(X, axis=0)
    return X


# -- one site process ---------------------------------------------------------------------------

def _vm_hwm_mb() -> float:
    """Peak resident set of this process image (VmHWM; unlike ru_maxrss it is not inherited across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def site_worker(cfg: dict) -> None:
    import tracemalloc

    from dpneuro.algorithms.pca import CapePCA, SiteSource
    from dpneuro.protocol.cape import cape_protocol
    from dpneuro.protocol.driver import run_site
    from dpneuro.protocol.exchange import DirectoryExchange

    rss0 = _vm_hwm_mb()
    tracemalloc.start()
    files = cfg["files"]
    src = SiteSource(lambda: (np.load(f) for f in files))  # one subject per block, read on demand
    alg = CapePCA(cfg["k"], cfg["epsilon"], cfg["delta"], mode="power", n_iter=cfg["n_iter"], scale="unit",
                  random_state=cfg["seed"], dim=cfg["D"])
    ex = DirectoryExchange(cfg["root"], cfg["S"], run_id=cfg["run_id"], key=bytes.fromhex(cfg["key"]),
                           poll_interval=0.01)
    t0, c0 = time.time(), time.process_time()
    state = run_site(cape_protocol(alg, cfg["plan"], n_sites=cfg["S"]), cfg["site"], src, ex, timeout=3600)
    wall, cpu = time.time() - t0, time.process_time() - c0
    peak_traced = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    sent = sum(int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize
               for rec in ex.egress_log(cfg["site"]) for a in rec["arrays"].values())
    led = state["ledger"]
    out = {"site": cfg["site"], "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": _vm_hwm_mb(),
           "rss_after_imports_mb": rss0, "peak_traced_mb": peak_traced,
        "bytes_sent": sent, "epsilon": led.epsilon(cfg["delta"]) if led.releases else None,
        "unit": state["unit"], "n_samples": state["n"]}
    Path(cfg["report"]).write_text(json.dumps(out))


# -- one run: aggregator here, sites as processes ---------------------------------------------------

def run(plan: str, epsilon, args, sites, D: int, workdir: Path, n_iter: int | None = None) -> dict:
    from dpneuro.algorithms.pca import CapePCA
    from dpneuro.protocol.cape import cape_protocol
    from dpneuro.protocol.driver import RunOptions, run_aggregator
    from dpneuro.protocol.exchange import DirectoryExchange

    S = len(sites)
    run_id = f"power-{plan}-{secrets.token_hex(4)}"
    key = secrets.token_bytes(32)
    root = workdir / "exchange"
    ex = DirectoryExchange(root, S, run_id=run_id, key=key, poll_interval=0.01)
    n_iter = n_iter or args.n_iter
    alg = CapePCA(args.k, epsilon, args.delta, mode="power", n_iter=n_iter, scale="unit", random_state=args.seed, dim=D)
    out: dict = {}

    def agg():
        try:
            out["state"] = run_aggregator(cape_protocol(alg, plan, n_sites=S), ex, options=RunOptions(timeout=3600))
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    t0 = time.time()
    th = threading.Thread(target=agg, daemon=True)
    th.start()
    procs, reports = [], []
    for s in range(S):
        rep = workdir / f"{run_id}-site{s}.json"
        cfg = {"files": sites[s], "k": args.k, "epsilon": epsilon, "delta": args.delta, "n_iter": n_iter,
               "seed": args.seed, "D": D, "root": str(root), "S": S, "run_id": run_id, "key": key.hex(),
               "plan": plan, "site": s, "report": str(rep)}
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // S)))
        procs.append(subprocess.Popen([sys.executable, __file__, "--site-worker", json.dumps(cfg)], env=env,
                                      stderr=open(workdir / f"{run_id}-site{s}.err", "w")))
        reports.append(rep)
    codes = [p.wait() for p in procs]
    th.join()
    wall = time.time() - t0
    if any(codes) or "error" in out:
        errs = [(workdir / f"{run_id}-site{s}.err").read_text()[-2000:] for s in range(S)]
        raise RuntimeError(f"run {run_id} failed: {out.get('error')!r} {codes} {errs}")
    shutil.rmtree(root / run_id, ignore_errors=True)
    return {"state": out["state"], "sites": [json.loads(r.read_text()) for r in reports], "wall_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="6 mm mask, fewer subjects: a seconds-long smoke run")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--subjects", type=int, default=5, help="subjects per site")
    ap.add_argument("--tps", type=int, default=100, help="time points per subject")
    ap.add_argument("--n-iter", type=int, default=15)
    ap.add_argument("--epsilon", type=float, default=1.0, help="per-site epsilon of the DP run (subject level)")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", type=int, nargs="*", default=None,
                    help="subjects per site for the memory sweep (plan none, 3 rounds); default 1 5 10")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "dpneuro_pca_power")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    if a.site_worker:
        site_worker(json.loads(a.site_worker))
        return 0
    if a.quick:
        a.subjects, a.tps, a.n_iter, a.sites = 2, 50, 8, 3
    sweep = a.sweep if a.sweep is not None else ([1, 2] if a.quick else [1, 5, 10])
    t_all = time.time()
    mask = brain_mask(a.quick)
    D = int(mask.sum())
    shutil.rmtree(a.workdir, ignore_errors=True)
    a.workdir.mkdir(parents=True)
    t = time.time()
    all_files = make_data(a.workdir, mask, a.k, a.sites, max([a.subjects, *sweep]), a.tps, a.seed)
    sites = [fs[: a.subjects] for fs in all_files]
    t_gen = time.time() - t
    N = a.sites * a.subjects * a.tps
    print(f"D = {D} voxels, {a.sites} sites x {a.subjects} subjects x {a.tps} time points (N = {N}); "
          f"data written in {t_gen:.0f} s", flush=True)

    # exact reference from the N x N Gram matrix of the pooled unit-scaled data
    t = time.time()
    X = load_unit([f for fs in sites for f in fs])
    G = (X.T @ X).astype(np.float64)
    q_o = float(np.sort(np.linalg.eigvalsh(G))[::-1][: a.k].sum() / N)
    t_ref = time.time() - t
    print(f"exact reference q_o = {q_o:.6g} ({t_ref:.0f} s)", flush=True)

    rows, per_site = [], []
    for plan, eps in (("none", None), ("cape", a.epsilon)):
        r = run(plan, eps, a, sites, D, a.workdir)
        V = r["state"]["basis"]
        q = float(np.sum((X.T @ V.astype(np.float32)).astype(np.float64) ** 2) / N)
        ss = r["sites"]
        row = {"plan": plan, "epsilon": "inf" if eps is None else eps, "delta": a.delta, "unit": ss[0]["unit"],
               "D": D, "k": a.k, "n_iter": a.n_iter, "sites": a.sites, "subjects_per_site": a.subjects,
               "tps": a.tps, "q_over_qo": q / q_o, "run_wall_s": r["wall_s"],
               "site_wall_s_max": max(x["wall_s"] for x in ss), "site_cpu_s_max": max(x["cpu_s"] for x in ss),
               "site_peak_rss_mb_max": max(x["peak_rss_mb"] for x in ss),
               "site_rss_after_imports_mb": max(x["rss_after_imports_mb"] for x in ss),
               "site_peak_traced_mb_max": max(x["peak_traced_mb"] for x in ss),
               "site_mb_sent": max(x["bytes_sent"] for x in ss) / 2**20,
               "site_epsilon": ss[0]["epsilon"]}
        rows.append(row)
        per_site += [{"plan": plan, **x} for x in ss]
        print(f"plan {plan:5s} eps={row['epsilon']}: q/q_o = {row['q_over_qo']:.5f}, run {row['run_wall_s']:.0f} s, "
              f"site peak RSS {row['site_peak_rss_mb_max']:.0f} MB (after imports "
              f"{row['site_rss_after_imports_mb']:.0f} MB), traced peak {row['site_peak_traced_mb_max']:.0f} MB, "
              f"sent {row['site_mb_sent']:.0f} MB", flush=True)
    del X

    # memory does not grow with the site's data: plan none, 3 rounds, 1..10 subjects per site
    sweep_rows = []
    for M in sweep:
        r = run("none", None, a, [fs[:M] for fs in all_files], D, a.workdir, n_iter=3)
        ss = r["sites"]
        sweep_rows.append({"subjects_per_site": M, "site_data_mb": D * M * a.tps * 4 / 2**20,
                           "site_peak_rss_mb_max": max(x["peak_rss_mb"] for x in ss),
                           "site_rss_after_imports_mb": max(x["rss_after_imports_mb"] for x in ss),
                           "site_peak_traced_mb_max": max(x["peak_traced_mb"] for x in ss),
                           "site_wall_s_per_round": max(x["wall_s"] for x in ss) / 3})
        print(f"sweep: {M:2d} subjects/site ({sweep_rows[-1]['site_data_mb']:.0f} MB of data): site peak RSS "
              f"{sweep_rows[-1]['site_peak_rss_mb_max']:.0f} MB, traced peak "
              f"{sweep_rows[-1]['site_peak_traced_mb_max']:.0f} MB", flush=True)

    sizes = {"one_subject_float32_mb": D * a.tps * 4 / 2**20, "one_subject_float64_mb": D * a.tps * 8 / 2**20,
             "D_by_k_float64_mb": D * a.k * 8 / 2**20,
             "site_matrix_float32_mb": D * a.subjects * a.tps * 4 / 2**20,
             "D_by_D_float64_gb": D * D * 8 / 2**30}
    name = "pca_power_quick" if a.quick else "pca_power"
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (a.out / f"{name}.json").write_text(json.dumps(
        {"rows": rows, "per_site": per_site, "memory_sweep": sweep_rows, "sizes": sizes, "q_o": q_o,
         "data_seconds": t_gen,
         "reference_seconds": t_ref, "total_seconds": time.time() - t_all,
         "model": "k smooth maps (geomspace(1, 0.05) energies) x N(0,1) time courses + white noise, "
                  "every time point scaled to unit norm"}, indent=2))
    print("\n" + " | ".join(f"{k}" for k in ("plan", "eps", "q/q_o", "run s", "site peak RSS MB",
                                               "site traced MB", "one subject f32 MB", "D x k f64 MB")))
    for r in rows:
        print(f"{r['plan']} | {r['epsilon']} | {r['q_over_qo']:.5f} | {r['run_wall_s']:.0f} | "
              f"{r['site_peak_rss_mb_max']:.0f} | {r['site_peak_traced_mb_max']:.0f} | "
              f"{sizes['one_subject_float32_mb']:.0f} | {sizes['D_by_k_float64_mb']:.0f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(13, 3.8))
    labels = [f"{r['plan']}\neps={r['epsilon']}" for r in rows]
    xs = np.arange(len(rows))
    ax1.bar(xs - 0.2, [r["site_peak_rss_mb_max"] for r in rows], 0.4, label="peak RSS")
    ax1.bar(xs + 0.2, [r["site_peak_traced_mb_max"] for r in rows], 0.4, label="peak traced (numpy)")
    ax1.axhline(sizes["site_matrix_float32_mb"], color="k", ls=":", label="site's data (float32)")
    ax1.axhline(sizes["one_subject_float32_mb"], color="gray", ls="--", label="one subject (float32)")
    ax1.axhline(rows[0]["site_rss_after_imports_mb"], color="tab:blue", ls="-.", lw=0.8, label="RSS after imports")
    ax1.set_xticks(xs, labels)
    ax1.set_ylabel("MB per site process")
    ax1.set_ylim(0, 1.35 * max(sizes["site_matrix_float32_mb"], max(r["site_peak_rss_mb_max"] for r in rows)))
    ax1.legend(fontsize=6, ncol=2, loc="upper left")
    ms = [r["subjects_per_site"] for r in sweep_rows]
    ax3.plot(ms, [r["site_data_mb"] for r in sweep_rows], "k:", marker="o", label="site's data (float32)")
    ax3.plot(ms, [r["site_peak_rss_mb_max"] for r in sweep_rows], marker="s", label="peak RSS")
    ax3.plot(ms, [r["site_peak_traced_mb_max"] for r in sweep_rows], marker="^", label="peak traced (numpy)")
    ax3.set_xlabel("subjects per site (plan none)")
    ax3.set_ylabel("MB per site process")
    ax3.legend(fontsize=7)
    ax2.bar(xs, [r["q_over_qo"] for r in rows])
    ax2.axhline(0.99, color="r", ls=":", label="target (plan none): 0.99")
    ax2.set_xticks(xs, labels)
    ax2.set_ylabel("q / q_o")
    ax2.legend(fontsize=7)
    fig.suptitle(f"power mode, D = {D}, k = {a.k}, {a.n_iter} rounds, {a.sites} sites x {a.subjects} subjects")
    fig.tight_layout()
    fig.savefig(a.out / f"{name}.png", dpi=120)
    shutil.rmtree(a.workdir, ignore_errors=True)
    print(f"wrote {a.out / (name + '.csv')}, .json, .png; total {time.time() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
