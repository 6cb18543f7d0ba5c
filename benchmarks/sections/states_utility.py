"""benchmarks/states_utility.py: dFNC states in the run, and PD-SVD as the reduction."""

from sections import table

TEMPLATE = """\
### dFNC states in the run, and PD-SVD as the reduction

The demo's consortium (4 sites, 120 volumes per subject, 6 mm, 8 networks) with {m[K]} planted dFNC states
(`dpneuro demo --brain-states 4`: the sources switch between four correlation matrices), at 32 and 128 subjects per
site; the run's defaults (spatial ICA, capePCA), then the states stage on each site's component time courses at
each `states_epsilon` (the whole stage, at delta/2). Metric: each state's components put in the truth's order and
sign by the maps' match, the state matrices against the planted ones, matched one to one, mean r; median (and
worst) of {m[seeds]} seeds; the occupancy error and the maps' mean |r| with the truth (medians). `none`: no noise
anywhere (plan none). eps columns: the headline (against the aggregator and its colluders, exact GDP, delta 1e-5)
of the states stage alone and of the whole run.

{run}

{states}

The states are read from the run's own time courses, so they inherit the maps' error: with 8 components whose maps
agree with the truth at about 0.73, even the noise-free states stay below the planted ones.

Spatial maps with the exact PCA (`reduction = "none"`, no noise) and with PD-SVD (secure sums, no noise: not
differentially private), 32 subjects per site, mean |r| with the truth:

{maps}
"""


def fields(R):
    rows = R.csv("states_utility.csv")
    if not rows:
        return None
    meta = R.json("states_utility.json")
    return {"m": meta, "run": R.run("python benchmarks/states_utility.py", ["states_utility.csv",
                                                                           "states_utility.json"],
                                    meta.get("runtime_s")),
            "states": table(["subjects per site", "states_epsilon", "state r (median)", "state r (worst)",
                             "occupancy error", "maps |r|", "eps of the stage", "eps of the run"],
                            [[r["subjects"], r["states_epsilon"], r["states_r_median"], r["states_r_min"],
                              r["occ_err_median"], r["maps_r_median"], r["eps_states"], r["eps_total"]]
                             for r in rows if r["method"] == "states"]),
            "maps": table(["reduction", "mean |r| with truth"],
                          [[r["reduction"], r["maps_r"]] for r in rows if r["method"] == "maps"])}
