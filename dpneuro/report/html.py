"""The self-contained HTML report (images embedded)."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from dpneuro.data.load import site_data_summary
from dpneuro.privacy import gdp_epsilon
from dpneuro.privacy.summary import headline_lines, plain_reading, privacy_warnings, strength, threat_model
from dpneuro.report.figures import MAP_THRESHOLD
from dpneuro.report.timings import total

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:.25em .6em;font-size:.9em}
th{background:#f3f3f3}.num{text-align:right;font-variant-numeric:tabular-nums}
.grid{display:flex;flex-wrap:wrap;gap:10px}.comp{border:1px solid #ddd;padding:6px;border-radius:4px}
.comp p{margin:.2em 0;font-size:.85em}.headline{font-size:1.1em;background:#f6f8fa;padding:.8em;border-radius:6px}
.warn{color:#8a4b00}.small{font-size:.85em;color:#555}
.comp img{max-width:100%;height:auto}.sites{display:flex;flex-wrap:wrap;gap:6px;margin-top:.4em}
.comp.wide{flex:1 1 100%}.sites>div{flex:0 1 calc(50% - 3px)}.sites>div:only-child{flex-basis:100%}
"""

#: settings a run uses only in some set-ups, and the set-ups (tests on the run's configuration) that use them
_DJICA = ("ica_epsilon_i", "ica_delta_i", "ica_rounds", "clip_G", "clip_h", "optimizer", "ica_bias", "ica_clip_unit")
_PRIVATE_NOISE = ("pca_epsilon", "ica_epsilon_i", "ica_delta_i", "cumulant_epsilon", "states_epsilon",
                  "calibration", "n_colluding", "epsilon")


def run_settings(cfg: dict) -> dict:
    """The settings a run used, from its configuration (``RunConfig.to_json()``): what it did not use is left out.

    Spatial ICA runs no unmixing rounds (no capeDJICA or cumulant settings),
    capeDJICA no cumulant release and the cumulant ICA no gradient rounds;
    brain-state settings only with brain states, PD-SVD's iterations only with
    PD-SVD, an atlas or the parcels (whichever gave the features), and the
    plumbing of a deployment (exchange folder, cluster) only when set.
    """
    drop: set[str] = set()
    temporal = cfg.get("ica") == "temporal"
    cumulant = temporal and cfg.get("ica_unmixing") == "cumulant"
    if not temporal:
        drop |= {*_DJICA, "ica_unmixing", "cumulant_epsilon"}
    elif cumulant:
        drop |= set(_DJICA)
    else:
        drop.add("cumulant_epsilon")
    if not cfg.get("brain_states"):
        drop |= {"brain_states", "states_epsilon", "states_method", "states_window", "states_step", "states_metric"}
    reduction = cfg.get("reduction")
    if reduction != "pdsvd":
        drop.add("pdsvd_iterations")
    else:  # secure sums of the data: no noise, no subject clipping, no D x D matrices
        drop |= {"pca_epsilon", "pca_subject_bound", "pca_contribution", "max_memory_gb"}
    if reduction == "none":
        drop.add("pca_epsilon")
    if cfg.get("plan") == "none":  # nothing carries noise
        drop |= set(_PRIVATE_NOISE)
    if cfg.get("epsilon") is None:
        drop.add("epsilon")  # no total budget was asked for: the stages' own settings stand
    if cfg.get("atlas"):
        drop.add("parcels")
    else:
        drop.add("atlas")
    if not (cfg.get("atlas") or cfg.get("parcels")):  # voxels: the consortium's maps are at voxel resolution
        drop |= {"site_voxel_maps", "site_maps_method"}
    elif not cfg.get("site_voxel_maps"):
        drop.add("site_maps_method")
    if cfg.get("mask"):
        drop.add("space")  # the mask's own grid
    if not cfg.get("confounds"):
        drop.add("confounds_options")
    for name in ("cluster", "truth", "bids"):
        if not cfg.get(name):
            drop.add(name)
    if cfg.get("backend", "inprocess") == "inprocess":
        drop.add("exchange_dir")
    out = {k: v for k, v in cfg.items() if k not in drop}
    if "sites" in out:  # a site's unset options (no file list, no exclusions) say nothing
        out["sites"] = [{k: v for k, v in site.items() if v or k in ("name", "path")} if isinstance(site, dict)
                        else site for site in out["sites"]]
    return out


def _img(path, alt: str = "", width: int | None = None) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    w = f' width="{width}"' if width else ""
    return f'<img alt="{html.escape(alt)}"{w} src="data:image/png;base64,{data}"/>'


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        if x != x:
            return "n/a"
        if x == float("inf"):
            return "&infin;"
        return f"{x:.{digits}g}"
    return html.escape(str(x))


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(
            f'<td class="num">{_fmt(c)}</td>' if isinstance(c, (int, float)) else f"<td>{_fmt(c)}</td>" for c in r
        ) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def components_table(rows: list[dict]) -> str:
    """The components in network order: network (and its share of the map's weight), peak, hemisphere, share of
    the released spectrum and the noise fraction (components.tsv)."""
    def noise(r: dict) -> str:
        if not r.get("signal", True):
            return "yes: below the privacy noise"
        return "yes: outside grey matter" if r["noise"] else ""

    body = [[r["component"], r["network_name"],
             r[f"overlap_{r['network']}"] if r["network"] != "unnamed" and r.get("signal", True) else "",
             f"{r['peak_x']:.0f}, {r['peak_y']:.0f}, {r['peak_z']:.0f}", r["hemisphere"], r["variance_share"],
             r["noise_fraction"], noise(r)] for r in rows]
    note = ("<p class=\"small\">Each component named by the network of the Schaefer 2018 atlas (7 networks of Yeo "
            "2011) that holds most of its map's positive weight; outside the atlas's cortex, by MNI position "
            "(subcortical, cerebellum, white matter / edge). Noise fraction: the map's weight outside grey matter "
            "or on the brain mask's edge (flagged above 0.6). Spectrum: the component's share of the released "
            "eigenvalues. A component whose map lies mostly in released directions below the privacy noise's edge "
            "(the released spectrum below) is noise, named so and no finding. All computed from the public maps "
            "and the plan's public noise (components.tsv).</p>")
    return "<h3>Components</h3>" + note + _table(
        ["component", "network", "overlap", "peak (x, y, z mm)", "hemisphere", "spectrum share", "noise fraction",
         "noise?"], body)


def privacy_section(privacy: dict) -> str:
    """Per-site totals, per-stage table and the assumptions, all from the ledgers."""
    delta = privacy["delta"]
    rows = []
    for site, s in privacy["sites"].items():
        rows.append([site, s["n_subjects"], s["epsilon"], s["epsilon_rdp"], s["mu"], s["epsilon_single_release"],
                     s["releases"]])
    who = threat_model(privacy["plan"], privacy["n_colluding"])
    out = [f"<p>Total privacy spent by every site, (&epsilon;, &delta;) with &delta; = {delta:g}, against "
           f"{html.escape(who)}. Privacy unit: <b>{html.escape(privacy['unit'])}</b>; "
           f"{html.escape(privacy.get('neighbour_text', ''))}.</p>",
           _table(["site", "subjects", "ε (exact GDP)", "ε (RDP)", "μ (GDP)",
                   "ε of one site's releases alone, at most (secondary)", "releases"], rows)]
    per_stage = []
    for site, s in privacy["sites"].items():
        for stage, mu in s.get("by_stage_mu", {}).items():
            per_stage.append([site, stage, mu, gdp_epsilon(delta, mu) if mu > 0 else 0.0])
    if per_stage:
        out.append("<p>Per stage (each stage alone, same adversary; the totals above compose them):</p>"
                   + _table(["site", "stage", "μ (GDP)", f"ε at δ = {delta:g}"], per_stage))
    stage_rows = []
    for site, s in privacy["sites"].items():
        for r in s["ledger"]["releases"]:
            stage_rows.append([site, r["stage"], r["name"], r["unit"], r.get("neighbour", "replace"),
                               r["sensitivity"], r["sigma"], r["count"]])
    out.append("<details><summary>Every release (from the ledgers)</summary>"
               + _table(["site", "stage", "quantity", "unit", "neighbours", "sensitivity", "noise std", "rounds"],
                        stage_rows)
               + "</details>")
    out.append("<p><b>Assumptions, in plain words.</b></p><ul>"
               + "".join(f"<li>{html.escape(a)}</li>" for a in privacy.get("assumptions", [])) + "</ul>")
    return "\n".join(out)


def report_headline(what: str, privacy: dict, warnings: list[str] | None = None) -> list[str]:
    """The box at the top of a report: what ran, the privacy headline and the run's warnings."""
    # the first headline line names every site's eps; the privacy box below says what it means
    return [what, headline_lines(privacy)[0], *(privacy_warnings(privacy) if warnings is None else warnings)]


def privacy_box(privacy: dict) -> str:
    """What the headline eps protects against, and whether it is strong, moderate or weak, in plain words."""
    eps = privacy.get("epsilon") or {n: s["epsilon"] for n, s in privacy["sites"].items()}
    worst = max(eps.values()) if eps else 0.0
    label = strength(worst)
    what = {"strong": "strong", "moderate": "moderate", "weak": "WEAK", "none": "NONE (not private)"}[label]
    return (f'<div class="privacybox {label}"><b>Privacy: {what}.</b> Every subject at every site is protected '
            f"with eps up to {worst:.3g} at delta = {privacy['delta']:g} against "
            f"{html.escape(threat_model(privacy['plan'], privacy['n_colluding']))}. "
            f"{html.escape(plain_reading(worst, privacy['delta']))} Rule of thumb: eps &le; 1 is strong, up to 10 "
            "moderate, above 10 weak."
            + "".join(f"<br/><b>Not differentially private:</b> {html.escape(why)}"
                      for why in privacy.get("not_private", []))
            + "</div>")


def spectrum_html(spectrum: dict) -> str:
    """The released eigen-spectrum against the plan's noise."""
    lam = spectrum["eigenvalues"]
    if spectrum["noise_sd"] is None:
        text = (f"The eigenvalues of the released matrix behind the {len(lam)} components; the release carried no "
                "privacy noise.")
    else:
        text = (f"The eigenvalues of the released matrix behind the {len(lam)} components, against the noise the "
                f"plan put on it (per-entry sd sigma = {spectrum['noise_sd']:.3g} over D = {spectrum['dim']} "
                "features): the noise's own eigenvalues reach its edge 2 sigma sqrt(D) (drawn with the largest one's "
                "99 % fluctuation), so an eigenvalue below the edge cannot be told from noise (grey). "
                + spectrum["sentence"])
    return f'<h3>Released spectrum</h3><p class="small">{text}</p>' + _img(spectrum["figure"], "released spectrum")


def glm_html(glm: dict) -> str:
    """The group-statistics section: each contrast's effects, the significant ones, and the noise they carry."""
    parts = ["<h2>Group statistics</h2>",
             f'<p class="small">{html.escape(glm["text"])}</p>']
    for c in glm["contrasts"]:
        parts.append(f"<h3>{html.escape(c['label'])}</h3>")
        parts.append(f'<p class="small">{html.escape(c["summary"])}</p>')
        if c["rows"]:
            head = "".join(f"<th>{h}</th>" for h in ("measure", "estimate", f"{glm['level']:.0%} interval", "p",
                                                      "q (FDR)", "noise sd"))
            body = "".join(
                f"<tr><td>{html.escape(r['measure'])}</td><td>{r['estimate']:.3g}</td>"
                f"<td>[{r['ci_low']:.3g}, {r['ci_high']:.3g}]</td><td>{r['p']:.2g}</td><td>{r['q']:.2g}</td>"
                f"<td>{r['noise_sd']:.3g}</td></tr>" for r in c["rows"])
            parts.append(f'<table class="small"><tr>{head}</tr>{body}</table>')
        if c.get("figure"):
            parts.append(_img(c["figure"], f"FNC effects: {c['label']}"))
    return "\n".join(parts)


def fnc_html(fnc: dict) -> str:
    """The static FNC section: the consortium's mean connectivity between components and its noise."""
    return "\n".join([
        "<h2>Static functional network connectivity (FNC)</h2>",
        '<p class="small">The consortium\'s mean correlation between the components\' time courses (Fisher z), '
        "in the components' network order. Each site computed its subjects' FNC, bounded each subject's, and "
        "released their mean through CAPE; each entry carries Gaussian noise of standard deviation "
        f"{fnc['noise_sd']:.3f} (so |z| below {2 * fnc['noise_sd']:.3f} is within the noise's 95 % range). Each "
        "subject's own FNC stays at its site (fnc_subjects.tsv)."
        + (f" The rows of {', '.join(fnc['noise_components'])} are grey: those components are below the privacy "
           "noise, so their connectivity is no finding." if fnc.get("noise_components") else "") + "</p>",
        _img(fnc["figure"], "static FNC")])


def states_html(states: dict) -> str:
    """The brain-states section: the dFNC states' connectivity matrices and the consortium's occupancy, or a
    site's own subjects' statistics (``site``)."""
    out = ["<h2>Brain states (dFNC)</h2>",
           f'<p class="small">{states["n_states"]} dynamic functional network connectivity states, as GIFT\'s dFNC '
           "finds them: each subject's component time courses cut into tapered sliding windows, each window's "
           "correlation between components, the windows clustered. The sites computed their windows; the "
           "consortium clustered them from private releases (each subject's windows bounded together). Each "
           "matrix is a state's correlation between components (ordered so that coupled ones sit together); "
           "the fraction of windows is the consortium's, from the last release. Each site's own subjects' "
           "statistics (fraction of time, dwell times, transitions) stay at the site.</p>"]
    if states.get("truth"):
        out.append(_table(["mean r of the state matrices with the planted ones", "largest occupancy error"],
                          [[states["truth"]["mean r with truth"], states["truth"]["occupancy error"]]]))
    if states.get("figure"):
        out.append(_img(states["figure"], "brain states"))
    if states.get("site"):
        site = states["site"]
        K = len(site["occupancy"])
        out.append(_table(["", *[f"state {k + 1}" for k in range(K)]],
                          [["this site's mean fraction of time", *site["occupancy"]],
                           ["mean dwell time (s)", *site["dwell_seconds"]]]))
        out.append(f'<p class="small">Mean number of state changes per subject: {site["transitions"]:.1f}.</p>')
    return "\n".join(out)


def data_section(data: dict) -> str:
    """How the data were read and cleaned at each site (from the sites' load records)."""
    parts = ["<h2>Data</h2>"]
    if data.get("features"):
        parts.append(f'<p class="small">Features the sites released statistics of: '
                     f"<b>{html.escape(data['features'])}</b> (the same at every site; the maps are painted back to "
                     "the mask's voxels).</p>")
    parts.append(f'<p class="small">How the data were cleaned (every site, before anything was '
                 f"released): {html.escape(data['cleaning'])}.</p>")
    rows, details = [], []
    for rec in data.get("sites", []):
        s = site_data_summary(rec)
        rows.append([rec["site"], s["subjects"], s["runs"], s["tr"] if s["tr"] else "-",
                     f"{s['resampled_runs']} from {', '.join(s['resampled_from'])}" if s["resampled_runs"] else "0",
                     s["scrubbed_volumes"], "; ".join(f"{sid}: {why}" for sid, why in s["excluded"]) or "-",
                     s["files_not_used"]])
        if rec.get("skipped"):
            items = "".join(f"<li>{html.escape(f)}: {html.escape(why)}</li>" for f, why in rec["skipped"])
            details.append(f"<details><summary>{html.escape(rec['site'])}: {len(rec['skipped'])} file(s) not "
                           f"used</summary><ul class='small'>{items}</ul></details>")
    if rows:
        parts.append(_table(["site", "subjects", "runs", "TR (s)", "runs resampled", "volumes censored",
                             "subjects left out", "files not used"], rows))
    return "".join(parts + details)


def timings_section(timings: dict[str, float]) -> str:
    """Seconds per stage, in the order the run performed them, and their total."""
    rows = [[k, round(float(v), 2)] for k, v in timings.items()] + [["total", round(total(timings), 2)]]
    return ("<h2>Timings</h2><p class='small'>Wall time of every stage (seconds), as the run recorded it; a stage "
            "found finished from an earlier run keeps the time it took then.</p>"
            + _table(["stage", "seconds"], rows))


def write_report(out_html, *, title: str, headline: list[str], components: list[dict], privacy: dict,
                 metrics: dict | None = None, convergence_png=None,
                 timings: dict | None = None, run: dict | None = None, notes: list[str] | None = None,
                 maps_note: str = "", timecourses_png=None, states: dict | None = None,
                 site_maps: dict | None = None, data: dict | None = None,
                 component_table: list[dict] | None = None, fnc: dict | None = None,
                 overview_png=None, spectrum: dict | None = None, glm: dict | None = None) -> Path:
    """Write ``report.html``.

    ``components``: one dict per component with ``png`` (the map), optional
    ``truth_png`` and ``corr`` (matched ground-truth map and its correlation),
    ``interactive`` (a self-contained HTML viewer, embedded) and ``label``.
    ``maps_note`` says how the maps are drawn (threshold, template).
    ``timecourses_png`` only in a site's own report: time courses are a
    site's un-noised data and never appear in the consortium's. ``states``
    (brain states): ``entries`` (as ``components``), ``figure`` (activation
    and occupancy), ``occupancy`` (the consortium's), ``note``, ``truth``.
    ``data``: how the data were read and cleaned: ``cleaning`` (a sentence) and
    ``sites`` (the sites' load records: subjects, runs, resampling, subjects
    left out, files not used).
    ``site_maps`` (the sites' own voxel maps): ``note``, what they are. The
    maps themselves are in ``components``: an entry's ``sites`` (``site``,
    ``png``, ``r`` with the consortium's map) are drawn below its map; a
    deployed site's own report has that site's, a simulation's every site's.
    ``timings``: seconds per stage, as the run recorded them (a total is added).
    ``run``: the run's configuration; only the settings it used are listed
    (:func:`run_settings`). ``component_table``: the rows of ``components.tsv``
    (each component's network, peak, spectrum share, noise fraction). ``fnc``: the
    consortium's static FNC (``figure``, ``noise_sd``). ``overview_png``: every
    component on one figure; ``spectrum``: the released eigenvalues against the
    plan's noise (``figure``, ``noise_sd``, ``edge``, ``threshold``). ``glm``: the
    group statistics (:func:`glm_html`).
    """
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    parts.append('<div class="headline">' + "<br/>".join(html.escape(h) for h in headline) + "</div>")
    parts.append(privacy_box(privacy))
    for n in notes or []:
        parts.append(f'<p class="warn">{html.escape(n)}</p>')

    if data:
        parts.append(data_section(data))

    if overview_png:
        parts.append("<h2>Components at a glance</h2>" + '<p class="small">Every component in network order, seen '
                     "from above (left is left, front at the top) and from the side (front to the right): the "
                     f"largest |z| along each line of sight, where |z| &gt; {MAP_THRESHOLD:g}.</p>"
                     + _img(overview_png, "every component"))
    if fnc:
        parts.append(fnc_html(fnc))
    if glm:
        parts.append(glm_html(glm))
    parts.append("<h2>Spatial maps</h2>")
    if component_table:
        parts.append(components_table(component_table))
    if spectrum:
        parts.append(spectrum_html(spectrum))
    if maps_note:
        parts.append(f'<p class="small">{html.escape(maps_note)}</p>')
    if metrics:
        parts.append(_table(list(metrics), [list(metrics.values())]))
    if site_maps:
        parts.append(f'<p class="small"><b>Voxel maps of each site.</b> {html.escape(site_maps["note"])}</p>')
    parts.append('<div class="grid">')
    for c in components:
        cell = [f'<div class="comp{" wide" if c.get("sites") else ""}"><p><b>{html.escape(c["label"])}</b>'
                + (f" &mdash; r = {c['corr']:.2f} with truth" if c.get("corr") is not None else "") + "</p>",
                _img(c["png"], c["label"])]
        if c.get("truth_png"):
            cell.append("<p>matched ground truth</p>" + _img(c["truth_png"], "truth " + c["label"]))
        if c.get("sites"):  # the sites' own voxel maps of this component, through the same slices
            cell.append('<div class="sites">' + "".join(
                f'<div><p>{html.escape(m["site"])}\'s voxel map &mdash; r = {m["r"]:.2f} with the consortium\'s</p>'
                + _img(m["png"], f'{m["site"]} {c["label"]}') + "</div>" for m in c["sites"]) + "</div>")
        if c.get("interactive"):
            cell.append("<details><summary>interactive view</summary>"
                        f'<iframe title="{html.escape(c["label"])} interactive" '
                        f'srcdoc="{html.escape(c["interactive"], quote=True)}"></iframe></details>')
        cell.append("</div>")
        parts.append("".join(cell))
    parts.append("</div>")

    if states:
        parts.append(states_html(states))

    parts.append("<h2>Time courses</h2>")
    if timecourses_png:
        parts.append('<p class="small">This site\'s own subjects, computed here from its data and the shared '
                     "unmixing (all subjects: <code>timecourses.tsv</code>).</p>"
                     + _img(timecourses_png, "time courses"))
    else:
        parts.append('<p class="small">Time courses are computed by each site from its own data and the '
                     "shared unmixing; they are not private releases, so this consortium report shows none. "
                     "Each site finds its subjects' time courses (a TSV, and a figure) in its own outputs.</p>")
    parts.append("<h2>Privacy</h2>")
    parts.append(privacy_section(privacy))
    if convergence_png:
        parts.append("<h2>Convergence</h2>" + _img(convergence_png, "convergence"))
    if timings:
        parts.append(timings_section(timings))
    if run:
        parts.append("<h2>Run</h2><p class='small'>The settings this run used (its full configuration is in "
                     "run.json).</p><pre class='small'>"
                     + html.escape(json.dumps(run_settings(run), indent=2, default=str)) + "</pre>")
    parts.append("</body></html>")
    out_html = Path(out_html)
    out_html.write_text("\n".join(parts), encoding="utf-8")
    return out_html
