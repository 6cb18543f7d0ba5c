"""benchmarks/canica_agreement.py: real fMRI from NIfTI files, dpneuro's features against CanICA."""

from sections import table

TEMPLATE = """\
### Real fMRI from NIfTI files: dpneuro's features against CanICA

The {m[people]} real people above painted into the MIST 122 atlas on the 6 mm grid ({m[voxels]} voxels), one 4-D
NIfTI file each, over {m[n_sites]} site folders, {m[n_components]} components; every method reads the same files.
nilearn's CanICA with its defaults (6 mm smoothing, {m[canica_n_init]} FastICA starts, threshold "auto") and
without its threshold; dpneuro without noise (`plan = "none"`, otherwise its defaults) with the features a
consortium can choose. Mean matched |r| over the voxels with CanICA's maps as it shows them (thresholded: about
1/20 of the voxels kept) and unthresholded; CanICA's own thresholded maps agree with its unthresholded ones at
{m[canica_thresholded_vs_unthresholded]!n}, the ceiling of the first column for any unthresholded map; "both
thresholded" thresholds dpneuro's maps as CanICA thresholds its own (the 1/k of all values largest in magnitude),
to compare maps as they are shown. Wall time from the files to the maps, one run each, same process (dpneuro's
includes its report and each site's voxel maps; the last column leaves out the report's figures, of which CanICA
draws none). The data are constant on the atlas's regions, so the atlas rows are a label atlas's best case.

{run}

{table}
"""


def fields(R):
    rows = R.csv("canica_agreement.csv")
    if not rows:
        return None
    meta = R.json("canica_agreement.json")
    return {"m": meta, "run": R.run("python benchmarks/canica_agreement.py", ["canica_agreement.csv",
                                                                             "canica_agreement.json"],
                                    meta.get("runtime_s")),
            "table": table(["method", "features", "mean \\|r\\| with CanICA", "both thresholded",
                            "with CanICA unthresholded", "wall s", "without the report, s"],
                           [[r["method"], r["features"], r["vs CanICA"], r.get("both thresholded", "-"),
                             r["vs CanICA unthresholded"], r["seconds"], r.get("seconds without report", "-")]
                            for r in rows])}
