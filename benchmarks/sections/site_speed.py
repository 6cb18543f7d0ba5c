"""benchmarks/site_speed.py: a site's speed on fMRIPrep outputs at 2 mm against the I/O floor, nilearn and CanICA."""

from sections import fmt, par, render, table

TEMPLATE = """\
### A site's speed on fMRIPrep outputs at 2 mm

{m[runs]} fMRIPrep-like runs (generated: {m[n_sites]} sites x {m[subjects_per_site]} subjects, {d[volumes]}
volumes, {span} per run, 8 planted networks, confounds tables) on the MNI152NLin2009cAsym `res-2` grid (97 x 115 x 97),
float32 gzip NIfTI, {gib} GiB. Each row runs in a fresh process and reports its own peak RSS; the floor and
nibabel rows are the median of {reps} repetitions, the others one run; the files are warm in the page cache.
dpneuro: `dpneuro run` with `site_templates/fmriprep.toml`'s settings ({settings}), {m[n_components]} components,
total eps {m[epsilon]!p} per site, Pydra plugin `{m[plugin]}` (stage seconds add up; each site decodes its
subjects in parallel threads); wall time of the command, imports included. CanICA: {m[n_components]} components,
6 mm smoothing, {m[canica_n_init]} FastICA starts, the same confounds, mask {mask}. The ratios are within this one
run on one machine ({loadavg}).

{run}

{table}

{stages}

{done}

{throughput}

{agreement}

{real}
"""

DONE = """\
| done when | measured | goal | |
|---|---|---|---|
| dpneuro's load (sum over the sites) / the `gzip -dc` floor | {r[load_over_floor]!n} | <= 1.5 | {v_load} |
| each site's voxel maps (sum over the sites) / the load | {r[site_maps_over_load]!n} | <= 2 | {v_maps} |
| `dpneuro run` with its defaults / CanICA (wall time) | {r[dpneuro_default_over_canica]!n} | <= 1 | {v_canica} |"""

AGREEMENT = """\
Agreement (mean matched |r| over the {a[voxels]} voxels of the 6 mm mask): dpneuro's consortium maps against
CanICA's {a[dpneuro_vs_canica]!n} (thresholded as CanICA thresholds: {a[dpneuro_thresholded_vs_canica]!n}), each
site's own voxel maps against CanICA's {a[site_maps_vs_canica]!n}; against the planted networks dpneuro
{a[dpneuro_vs_planted]!n}, the sites' maps {a[site_maps_vs_planted]!n}, CanICA {a[canica_vs_planted]!n}. Later
changes should be no worse."""

THROUGHPUT = """\
What to provision: the default run loaded {d[volumes]} volumes in {load!n} s on {cores} cores (each site's
subjects decoded in parallel threads), {per_core!n} volumes a second per core, with a peak RSS of {rss!n} MB.
A site of 1,000 subjects with 200 volumes each at 2 mm (200,000 volumes) needs about {core_h!n} core-hours to
load, on one machine or spread over its cluster (`cluster` in `site.toml`: batches of subjects decoded by Pydra's
Dask or SLURM worker, the same matrix bit for bit); every later stage reads the loaded matrix, not the runs."""

REAL = """\
On the {e[people]} real people of the CanICA comparison above ({e[n_sites]} site folders, 6 mm NIfTI):
`DecentralizedICA()` with the product's defaults (private, report and site voxel maps included) took
{dp!n} s (its sites' voxel maps {sm!n} s of it) and nilearn's `CanICA()` with its defaults but for the mask
({e[canica_mask]}; its own is empty on z-scored series) {can!n} s ({e[canica_n_init]} starts; same process, one
after the other): {ratio!n} x."""

LABELS = {"space": "space (mask, features)", "load": "load", "reduce": "reduce", "unmix": "unmix",
          "fnc": "static FNC", "maps": "maps and privacy record", "timecourses": "time courses",
          "site_maps": "site voxel maps", "report": "report", "other": "other"}


def _verdict(value, goal) -> str:
    return "" if value is None or value != value else ("met" if value <= goal else "not met")


def fields(R):
    m = R.json("site_speed.json")
    rows = m.get("rows") or {}
    if not rows:
        return None
    d, r = m.get("data", {}), m.get("ratios", {})
    dp = [(k, rows[k]) for k in ("dpneuro_no_site_maps", "dpneuro_default") if k in rows]
    stage_rows = [[LABELS.get(s, s)] + [x["stages_s"].get(s, 0.0) for _, x in dp]
                  for s in LABELS if any(x.get("stages_s", {}).get(s) for _, x in dp)]
    e = R.json("site_speed_real.json")
    real = ""
    if e.get("rows"):
        real = render(REAL, {"e": e, "dp": e["rows"][0]["seconds"], "can": e["rows"][1]["seconds"],
                             "ratio": e["ratios"]["dpneuro_default_over_canica"],
                             "sm": e.get("dpneuro_stages_s", {}).get("site_maps")})
    s = m.get("settings", {})
    throughput = ""
    if "dpneuro_default" in rows and rows["dpneuro_default"].get("stages_s", {}).get("load"):
        load = rows["dpneuro_default"]["stages_s"]["load"]
        cores = int(str(m.get("machine", "1 cores")).split(",")[-1].split()[0])
        per_core = d["volumes"] / (load * cores)
        throughput = render(THROUGHPUT, {"d": d, "load": load, "cores": cores, "per_core": per_core,
                                         "rss": rows["dpneuro_default"]["peak_rss_mb"],
                                         "core_h": 200_000 / per_core / 3600})
    return {
        "m": m, "d": d, "gib": fmt(d.get("bytes", 0) / 2**30),
        "span": "-".join(str(f(d.get("volumes_per_run") or [0])) for f in (min, max)),
        "reps": max((x["reps"] for x in rows.values()), default=1),
        "settings": f"atlas {s.get('atlas')} + {s.get('atlas_fill')} parcels of the rest, "
                    f"{par(s.get('smoothing_fwhm'))} mm smoothing, confounds \"{s.get('confounds')}\"",
        "mask": "dpneuro's 6 mm MNI mask" if m.get("canica_mask") == "mni6mm" else "CanICA's own (2 mm)",
        "loadavg": f"load average {fmt(m.get('loadavg_start'))} at the start, 2 cores shared",
        "run": R.run("python benchmarks/site_speed.py", ["site_speed.csv", "site_speed.json"], m.get("runtime_s")),
        "table": table(["measurement", "repetitions", "wall s (process)", "work s", "peak RSS MB", "ICA status"],
                       [[x["label"], x["reps"], x["process_s"], x["work_s"], x["peak_rss_mb"],
                         x.get("ica_status") or ""] for x in rows.values()]),
        "stages": table(["dpneuro stage, s", *(x["label"] for _, x in dp)], stage_rows) if dp else "",
        "done": render(DONE, {"r": r, "v_load": _verdict(r.get("load_over_floor"), 1.5),
                              "v_maps": _verdict(r.get("site_maps_over_load"), 2.0),
                              "v_canica": _verdict(r.get("dpneuro_default_over_canica"), 1.0)}, soft=False),
        "agreement": render(AGREEMENT, {"a": m["agreement"]}) if m.get("agreement") else "",
        "real": real, "throughput": throughput}
