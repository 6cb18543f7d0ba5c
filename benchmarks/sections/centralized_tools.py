"""benchmarks/centralized_tools.py: dpneuro against centralized non-private tools on the same data."""

from sections import render, table

TEMPLATE = """\
### dpneuro vs centralized non-private tools (same data)

One dpneuro.datasets.synth consortium, {demo}{s[space]} ({m[n_voxels]:,} voxels), {s[sites]} sites x {s[subjects]} subjects
x {s[timepoints]} volumes, R = {s[components]} true maps, noise {s[noise]}. A = from the NIfTI files to maps:
nilearn {v[nilearn]} CanICA (voxels, its defaults) vs the dpneuro workflow with temporal ICA, the unmixing B
compares (load, capePCA, capeDJICA, maps, report), on {s[parcels]} data-independent parcels, plan none and plan
cape (pca_epsilon {c[pca_epsilon]!p}, eps_i {c[ica_epsilon_i]!p}, {c[ica_rounds]} rounds, clip {c[clip_G]!p} per
{clip_unit}; full configuration in the JSON). B = unmixing only, on the plan-none run's own whitened data (every
time point scaled to unit norm, as dpneuro sites do for DP, then the run's PCA basis): scikit-learn
{v[scikit-learn]} FastICA and MNE {v[mne]} infomax (their defaults) vs the pipeline's capeDJICA unmixing, plan none
/ cape (ICA epsilon only). C = FastICA and MNE infomax on a conventional whitening of the same parcel data (no
unit-norm scaling). mean |r| = Hungarian-matched correlation of the maps with the truth; qNGI where an unmixing
matrix exists (in that group's whitened space). Times: median of {m[repeats]} repeats; ratio = the method's time
over the reference's (CanICA in A, FastICA in B and C) in the same repeat, then the median. BLAS threads at each
library's default.

{ceiling}

{run}

{table}

{fig}
"""

DEMO = "the data set of `dpneuro demo` at run time: "
CEILING = """\
Parcel ceiling: the true maps averaged within the parcels correlate with the true maps at mean |r| {ceiling!n}; no
method working on these parcels can exceed it."""

GLANCE = {
    "canica": ("dpneuro vs nilearn CanICA, files to maps (non-private)",
               """wall {n[wall_s]!n} s vs {a[wall_s]!n} s (ratio {n[wall_ratio]!n}), CPU ratio {n[cpu_ratio]!n};
               mean |r| with truth {n[mean_abs_r]!n} vs {a[mean_abs_r]!n}""",
               {"faster, better": "faster, better maps", "slower, better": "slower, better maps",
                "faster, worse": "faster, less accurate maps{ceiling}",
                "slower, worse": "slower, less accurate maps{ceiling}"}),
    "private": ("dpneuro private end to end (plan cape, {s[sites]} x {s[subjects]} subjects)",
                "mean |r| {k[mean_abs_r]!n}, qNGI {k[qngi]!n} at total epsilon {k[eps_total]!n}",
                {"none": "no usable maps at this size", "usable": "usable maps",
                 "rough": "rough maps (qNGI above 0.1)"}),
    "unmixing": ("Unmixing: capeDJICA (none) vs FastICA / MNE infomax on dpneuro's whitened data",
                 """time {dn[wall_s]!n} s vs {fi[wall_s]!n} s / {im[wall_s]!n} s; qNGI {dn[qngi]!n} vs
                 {fi[qngi]!n} / {im[qngi]!n}{raw}""",
                 {"more": "more accurate on the same data{time}{scaling}", "as": "as accurate{time}{scaling}",
                  "less": "less accurate{time}{scaling}"}),
}
CEILING_NOTE = " (parcel ceiling {ceiling!n})"
RAW = "; on conventionally whitened data FastICA {fr[qngi]!n}, infomax {ir[qngi]!n}"
SLOWER = "; {dn[wall_ratio]!n}x FastICA's time"
FASTER = "; faster than FastICA"
SCALING = "; but FastICA on unscaled data beats both: the unit-norm scaling DP needs costs accuracy"


def fields(R):
    rows = R.csv("centralized_tools.csv")
    if not rows:
        return None
    meta = R.json("centralized_tools.json")
    s, cfg = meta.get("setup", {}), meta.get("dpneuro_config", {})
    ceiling = meta.get("parcel_ceiling_mean_abs_r")
    return {"m": meta, "s": s, "v": meta.get("versions", {}), "c": cfg,
            "clip_unit": cfg.get("ica_clip_unit", "sample"), "demo": DEMO if s.get("from_demo") else "",
            "ceiling": render(CEILING, {"ceiling": ceiling}) if ceiling is not None else "",
            "run": R.run("python benchmarks/centralized_tools.py", ["centralized_tools.csv", "centralized_tools.json",
                                                                     "centralized_tools.png"],
                         meta.get("wall_seconds")),
            "table": table(["group", "method", "wall s", "CPU s", "wall / ref", "CPU / ref", "mean abs r", "qNGI",
                            "total epsilon"],
                           [[r["group"], r["method"], r["wall_s"], r["cpu_s"], r["wall_ratio"], r["cpu_ratio"],
                             r["mean_abs_r"], r["qngi"], r["eps_total"]] for r in rows]),
            "fig": R.fig("centralized_tools.png", "centralized tools")}


def glance(R):
    rows = R.csv("centralized_tools.csv")
    if not rows:
        return
    meta = R.json("centralized_tools.json")
    c = {r["method"]: r for r in rows}
    a, n, k = c.get("CanICA"), c.get("dpneuro none"), c.get("dpneuro cape")
    ceiling = meta.get("parcel_ceiling_mean_abs_r")
    if a and n:
        yield "canica", {"a": a, "n": n, "ceiling": render(CEILING_NOTE, {"ceiling": ceiling}) if ceiling else ""}, \
            ("faster" if n["wall_ratio"] < 1 else "slower") + (", better" if n["mean_abs_r"] > a["mean_abs_r"]
                                                              else ", worse")
    if k:
        yield "private", {"k": k, "s": meta.get("setup", {})}, \
            "none" if k["mean_abs_r"] < 0.5 else "usable" if k["qngi"] <= 0.1 else "rough"
    fi, im, dn = c.get("FastICA"), c.get("MNE infomax"), c.get("capeDJICA none")
    fr, ir = c.get("FastICA (raw whitening)"), c.get("MNE infomax (raw whitening)")
    if fi and im and dn:
        best = min(fi["qngi"], im["qngi"])
        f = {"fi": fi, "im": im, "dn": dn, "fr": fr, "ir": ir}
        yield "unmixing", {**f, "raw": render(RAW, f) if fr and ir else "",
                           "time": render(SLOWER, f) if dn["wall_s"] > fi["wall_s"] else FASTER,
                           "scaling": SCALING if fr and fr["qngi"] < 0.9 * dn["qngi"] else ""}, \
            "more" if dn["qngi"] < 0.9 * best else "as" if dn["qngi"] <= 1.1 * best else "less"
