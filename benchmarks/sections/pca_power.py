"""benchmarks/pca_power.py: capePCA's power mode at voxel level."""

from sections import one, par, table

TEMPLATE = """\
### capePCA power mode at voxel level (2 mm MNI brain)

D = {r[D]:,} voxels, k = {r[k]}, {r[sites]} sites (separate OS processes over a directory exchange) x
{r[subjects_per_site]} subjects x {r[tps]} time points, {r[n_iter]} power iterations, subject-level privacy,
delta = {r[delta]}. Single run per plan (memory and time of one deployment-like run).

{run}

{table}

{sweep}

{fig}
"""

SWEEP = "Site memory does not grow with the site's data (plan none, 3 rounds):"

GLANCE = {"power": (
    "Voxel-level capePCA (power mode, 2 mm, subject level)",
    "plan none q/q_o {none!n}; plan cape at eps = {eps!p}: {cape!n}",
    {"no utility": "no utility: voxel-level DP noise swamps the signal at eps = 1 (use parcels)",
     "usable": "usable"})}


def fields(R):
    rows = R.csv("pca_power.csv")
    if not rows:
        return None
    meta = R.json("pca_power.json")
    sweep = meta.get("memory_sweep", [])
    return {"r": rows[0], "run": R.run("python benchmarks/pca_power.py",
                                       ["pca_power.csv", "pca_power.json", "pca_power.png"], meta.get("total_seconds")),
            "table": table(["plan", "epsilon per site", "q / q_o", "run wall s", "site peak RSS MB", "site traced MB",
                            "MB sent per site"],
                           [[r["plan"], par(r["epsilon"]), r["q_over_qo"], r["run_wall_s"], r["site_peak_rss_mb_max"],
                             r["site_peak_traced_mb_max"], r["site_mb_sent"]] for r in rows]),
            "sweep": SWEEP + "\n\n" + table(
                ["subjects per site", "site data MB", "site peak RSS MB", "site traced MB", "s per round"],
                [[s["subjects_per_site"], s["site_data_mb"], s["site_peak_rss_mb_max"], s["site_peak_traced_mb_max"],
                  s["site_wall_s_per_round"]] for s in sweep]) if sweep else "",
            "fig": R.fig("pca_power.png", "power-mode capePCA memory and utility")}


def glance(R):
    rows = R.csv("pca_power.csv")
    cape, none = one(rows, plan="cape"), one(rows, plan="none")
    if cape:
        yield "power", {"none": none["q_over_qo"] if none else None, "eps": cape["epsilon"],
                        "cape": cape["q_over_qo"]}, "no utility" if cape["q_over_qo"] < 0.1 else "usable"
