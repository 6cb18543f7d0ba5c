"""benchmarks/djica_speed.py: capeDJICA's time per round."""

from sections import one, table

TEMPLATE = """\
### capeDJICA speed per round

R = {m[R]}, N = {m[N]:,} samples in all, S = {m[S]} sites; median of {m[repeats]} repeats. 'compute' = every
site's clipped gradients plus the aggregator update; 'naive' materialises every per-sample R x R gradient;
'protocol' = a full round over the in-process exchange (slope of wall time against rounds; secure aggregation
included for plan cape).

{run}

{table}

{fig}
"""

GLANCE = {"speed": (
    "capeDJICA per-round cost (R = 20, N = 256K, S = 4)",
    """per-sample clipping without per-sample matrices: {ratio!n}x faster than the naive kernel; full CAPE round with
    secure aggregation {cape_ms!n} ms""",
    {"faster": "faster than a direct implementation"})}


def fields(R):
    rows = R.csv("djica_speed.csv")
    if not rows:
        return None
    return {"m": R.json("djica_speed.json"),
            "run": R.run("python benchmarks/djica_speed.py", ["djica_speed.csv", "djica_speed.json",
                                                               "djica_speed.png"], R.runtime("djica_speed")),
            "table": table(["what", "kernel", "dtype", "site threads", "BLAS threads", "plan", "ms per round"],
                           [[r["what"], r["kernel"], r["dtype"], r["site_threads"], r["blas_threads"], r["plan"],
                             1e3 * r["seconds_per_round"]] for r in rows]),
            "fig": R.fig("djica_speed.png", "capeDJICA ms per round")}


def glance(R):
    rows = R.csv("djica_speed.csv")
    naive = one(rows, kernel="naive")
    fast = one(rows, what="compute", kernel="sample", dtype="float64", site_threads=1)
    cape = one(rows, what="protocol", plan="cape")
    if naive and fast:
        yield "speed", {"ratio": naive["seconds_per_round"] / fast["seconds_per_round"],
                        "cape_ms": 1e3 * cape["seconds_per_round"] if cape else None}, "faster"
