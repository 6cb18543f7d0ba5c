"""benchmarks/fastica_noise.py: FastICA on pure-noise bases, no exception, collapses restarted."""

from sections import table

TEMPLATE = """\
### FastICA on pure-noise bases: no fit ends in an exception

On a basis that is mostly noise the stabilised FastICA's damped step can collapse two directions into one; before
the guard the decorrelation then overflowed and scipy raised. Single fits: whitened Gaussian bases, D in
{m[D_range][0]}..{m[D_range][1]}, K in {m[K_range][0]}..{m[K_range][1]}, tol {m[tol]}, max_iter {m[max_iter]},
a collapsed fit restarted from public derived seeds as the spatial ICA does; then `spatial_ica` with its defaults
(20 starts) on orthonormal pure-noise bases. `collapsed`: fits (spatial: starts) that collapsed; `left out`: still
collapsed after every restart; time per fit on one BLAS thread, {m[workers]} processes side by side (spatial: a
basis' time over its 20 starts).

{run}

{table}
"""


def fields(R):
    rows = R.csv("fastica_noise.csv")
    if not rows:
        return None
    meta = R.json("fastica_noise.json")
    return {"m": meta, "run": R.run("python benchmarks/fastica_noise.py", ["fastica_noise.csv", "fastica_noise.json"],
                                    meta.get("runtime_s")),
            "table": table(["part", "runs", "FastICA fits", "exceptions", "RuntimeWarnings", "collapsed", "restarts",
                            "left out", "not converged", "median s per fit"],
                           [[r["part"], r["runs"], r["fits"], r["exceptions"], r["runtime_warnings"], r["collapsed"],
                             r["restarts"], r["collapsed_after_restarts"], r["not_converged"], r["median_s_per_fit"]]
                            for r in rows])}
