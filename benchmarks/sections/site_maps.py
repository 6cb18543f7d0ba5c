"""benchmarks/site_maps.py: voxel maps at product scale, each site's own maps against the painted parcels."""

from sections import render, table

TEMPLATE = """\
### Voxel maps at product scale: each site's own maps against the painted parcels

Realistic "networks" data (`make_consortium(model="networks")`, {m[n_components]} networks) on the {m[space]}
grid, {m[n_sites]} sites x {m[subjects_per_site]} subjects x {m[n_timepoints]} volumes, int16 gzip NIfTI, through
the pipeline `dpneuro run` runs. Consortium: the shared maps, parcel values painted back to voxels. Sites: each
site's own voxel maps, computed at the site with no release, mean over the sites (worst site in the CSV): by the
default guided ICA (spatial ICA of the site's own principal subspace over voxels, started from and paired with the
dual-regression maps) and, from the same run's time courses, by dual regression (its subjects' voxels regressed on
their time courses, averaged). Private: total eps {m[epsilon_target]!n} per site (headline sense), median over
noise seeds {seeds}; voxel resolution with one seed (capepca-power). maps s: the maps stage, which decodes every
site's files once more for the site maps.

{run}

{table}

{fig}
"""

GLANCE = {"site maps": (
    """Voxel maps at product scale ({m[n_sites]} x {m[subjects_per_site]} subjects, {m[space]}, realistic networks,
    from files, eps {m[epsilon_target]!n}; goal 0.8)""",
    """each site's own voxel maps {d[r_sites]!n} at 100 parcels (best {b[r_sites]!n} at {b[parcels]}; dual
    regression {dual!n}) against {d[r_consortium]!n} for the painted parcels{voxels}""",
    {"met": "met", "not met": "not met: the weakest networks stay below the noise at this size"})}
VOXELS = " and {r!n} for private voxel-level maps"


def fields(R):
    meta = R.json("site_maps.json")
    summary = meta.get("summary", [])
    if not summary:
        return None
    return {"m": meta, "seeds": ", ".join(str(x) for x in meta["seeds"]),
            "run": R.run("python benchmarks/site_maps.py", ["site_maps.csv", "site_maps.json", "site_maps.png"],
                         meta.get("runtime_s")),
            "table": table(["features", "reduction", "epsilon per site", "seeds", "consortium: mean abs r with truth",
                            "sites, guided ICA (default)", "worst seed (guided ICA)", "sites, dual regression",
                            "maps s"],
                           [[f"{s['parcels']} parcels" if s["parcels"] else "voxels", s["reduction"], s["epsilon"],
                             s["n_seeds"], s["r_consortium"], s["r_sites"], s["r_sites_min_over_seeds"],
                             s.get("r_sites_dual_regression", float("nan")), s["maps_s"]] for s in summary]),
            "fig": R.fig("site_maps.png", "site voxel maps")}


def glance(R):
    meta = R.json("site_maps.json")
    cells = {(s["parcels"], s["reduction"]): s for s in meta.get("summary", [])}
    default, vox = cells.get((100, "capepca")), cells.get((0, "capepca-power"))
    private = [s for s in meta.get("summary", []) if s["reduction"] != "none" and s["parcels"]]
    if default and private:
        best = max(private, key=lambda s: s["r_sites"])
        yield "site maps", {"m": meta, "d": default, "b": best,
                            "dual": default.get("r_sites_dual_regression", float("nan")),
                            "voxels": render(VOXELS, {"r": vox["r_consortium"]}) if vox else ""}, \
            "met" if best["r_sites"] >= 0.8 else "not met"
