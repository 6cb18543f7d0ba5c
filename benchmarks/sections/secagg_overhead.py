"""benchmarks/secagg_overhead.py: secure aggregation's cost per round."""

from sections import render, table

TEMPLATE = """\
### Secure aggregation overhead per round

One secure sum per round over the in-process exchange (both phases, all parties' work, encoding and
authentication) against a plain float sum; set-up excluded. File header: "{head}".

{run}

{table}
"""

GLANCE = {"secagg": (
    "Secure aggregation (CAPE's zero-sum noise without a trusted party, [capeDJICA] App. B-A)",
    "{cells}",
    {"small upload": "measured cost (upload within 0.1% of plain for large payloads)", "measured": "measured cost"})}
CELL = "{n_sites} sites x {payload}: {secure!n} ms vs {plain!n} ms plain"


def fields(R):
    rows = R.csv("secagg_overhead.csv")
    if not rows:
        return None
    return {"head": R.text("secagg_overhead.csv").splitlines()[0].lstrip("# "),
            "run": R.run(f"python benchmarks/secagg_overhead.py --reps {rows[0]['reps']}", ["secagg_overhead.csv"],
                         R.runtime("secagg_overhead")),
            "table": table(["sites", "payload", "secure s/round", "plain s/round", "overhead s", "secure CPU s",
                            "plain CPU s", "upload B/site/round secure", "plain"],
                           [[r["n_sites"], r["payload"], r["secure_round_s_median"], r["plain_round_s_median"],
                             r["overhead_s_median"], r["secure_cpu_s_median"], r["plain_cpu_s_median"],
                             r["site_upload_bytes_secure"], r["site_upload_bytes_plain"]] for r in rows])}


def glance(R):
    rows = R.csv("secagg_overhead.csv")
    if rows:
        small = all(r["site_upload_bytes_secure"] < 1.001 * r["site_upload_bytes_plain"] for r in rows
                    if r["n_values"] > 10_000)
        yield "secagg", {"cells": "; ".join(render(CELL, {**r, "secure": 1e3 * r["secure_round_s_median"],
                                                          "plain": 1e3 * r["plain_round_s_median"]}) for r in rows)}, \
            "small upload" if small else "measured"
