"""Group ICA of a consortium from a notebook: NIfTI lists in, maps, a privacy table and a report out.

Run it as a script (``python examples/decentralized_ica.py [OUT] [--small]``) or
cell by cell in Jupyter. It synthesizes the demo's consortium (4 sites x 32
subjects, 6 mm, 8 networks; about 80 s in all), so it needs no data of your
own; ``--small`` (3 sites x 8 subjects, about 25 s) shows the API on a
consortium too small for private maps, which the warnings then say. With real
data, replace ``sites`` by your own mapping: site name -> folder, BIDS root or
list of 4-D NIfTI files.
"""

# %% A consortium: three sites, each a list of 4-D NIfTI files (one per subject)
import sys
from pathlib import Path

import dpneuro
from dpneuro.datasets.synth import make_consortium

args = [a for a in sys.argv[1:] if a != "--small"]
out = Path(args[0] if args else "dpneuro_example")
n_sites, n_subjects, n_networks = (3, 8, 6) if "--small" in sys.argv else (4, 32, 8)
manifest = make_consortium(out / "data", n_sites=n_sites, subjects_per_site=n_subjects, n_components=n_networks,
                           n_timepoints=120, space="mni6mm", random_state=0, dtype="int16")
sites = {s["site"]: sorted(Path(s["path"]).glob("*.nii.gz")) for s in manifest["sites"]}

# %% How much privacy would the run spend? The planner reads the counts from the file headers
print(dpneuro.plan_budget(8.0, sites=sites, n_components=n_networks, mask=manifest["mask"]))

# %% Fit: the five lines a notebook needs
ica = dpneuro.DecentralizedICA(n_components=n_networks, epsilon=8.0, mask=manifest["mask"],
                               # truth: agreement with the synthetic ground truth
                               out=out / "run", truth=str(out / "data"))
ica.fit(sites)
print(ica.privacy_)
ica.report_.save_as_html(out / "report.html")

# %% Plot the first component with nilearn, and look at one subject's time courses
from nilearn import image, plotting  # noqa: E402

display = plotting.plot_stat_map(image.index_img(ica.components_img_, 0), threshold=2.0, title="IC01")
display.savefig(out / "IC01.png")
display.close()
site, subjects = next(iter(ica.timecourses_.items()))
subject, tc = next(iter(subjects.items()))
print(f"{site} {subject}: time courses {tc.shape} (volumes x components), computed at the site")
print(f"agreement with the truth: {ica.metrics_}")
