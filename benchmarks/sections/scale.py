"""benchmarks/scale.py: from NIfTI files to maps at parcel and voxel resolution."""

from sections import render, table

TEMPLATE = """\
### Scale: from NIfTI files to maps at parcel and voxel resolution

`make_consortium` data ({r[sites]} sites x M subjects x {r[timepoints]} volumes, 20 components, int16 gzip NIfTI);
every stage in a fresh process that runs the whole consortium (every site and the aggregator), so its peak resident
memory (VmHWM) bounds one site process of a deployment. Load: the sites one after another, each decoding its
subjects in {r[workers]} threads, into float32 column-major matrices (with the mask and parcels). Reduction `none`
is the PCA without noise (covariance when D x D fits `max_memory_gb` = 4, otherwise streamed subspace iterations
that stop once converged; passes: how many times the reduction read the data); the private one is capePCA
(covariance) or `capepca-power` (one pass per planned release) where the covariance does not fit. decompress: the
time to gunzip every input once with as many threads (the I/O floor); x floor = total / decompress; load share =
load / total. Rows without a pass count were measured by an earlier run of the same code for their stages (the
streamed PCA's stopping rule changes only the `none` voxel rows).

{run}

{table}

{growth}

{synth}
"""

GROWTH = """\
Growth exponents b of time ~ x^b (least squares on logs): with the features (voxel grids, same M) and with the
subjects per site."""
SYNTH = "- `dpneuro synth` at {space}: {s[subjects]} subjects x {s[timepoints]} volumes in {s[seconds]!n} s (gzip)."


def fields(R):
    rows = R.csv("scale.csv")
    if not rows:
        return None
    meta = R.json("scale.json")
    growth = meta.get("growth", {})
    cols = sorted({c for g in growth.values() for c in g["with subjects"]})
    return {"r": rows[0], "run": R.run("python benchmarks/scale.py --workdir DIR", ["scale.csv", "scale.json"],
                                       meta.get("total_seconds")),
            "table": table(["data", "features", "M", "reduction", "load s", "reduce s", "passes", "unmix s", "maps s",
                            "total s", "decompress s", "x floor", "load share", "peak MB", "mean abs r with truth"],
                           [[r["config"], r["features"], r["subjects_per_site"], r["reduction"], r["load_s"],
                             r["reduce_s"], r.get("reduce_rounds") or "", r["unmix_s"], r["maps_s"], r["total_s"],
                             r["decompress_s"], r["total_over_decompress"],
                             f"{float(r['load_s']) / float(r['total_s']):.0%}", r["peak_mb"], r["mean_r_truth"]]
                            for r in rows]),
            "growth": render(GROWTH, {}) + "\n\n" + table(
                ["stage", "with features", *cols],
                [[k, g["with features"], *[g["with subjects"].get(c) for c in cols]] for k, g in growth.items()])
            if growth else "",
            "synth": "\n".join(render(SYNTH, {"space": space, "s": s}) for space, s in meta.get("synth", {}).items())}
