"""The README's measured passages are rendered from the committed benchmark results (benchmarks/make_readme.py),
and CI's ``make_readme.py --check`` fails when a result changes and the README does not."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import make_readme  # noqa: E402
from sections import real_frontier  # noqa: E402


def test_every_measured_passage_of_the_readme_is_rendered_from_the_results():
    text = (ROOT / "README.md").read_text()
    blocks = make_readme.readme_blocks()
    assert set(blocks) == {"demo", "real_frontier", "strong_privacy", "frontier", "states", "fnc", "group_stats"}
    assert make_readme.render_top_readme(text, blocks) == text  # the committed README is up to date
    assert text.count("<!-- measured: ") == len(blocks)


def test_a_changed_result_changes_the_readme(monkeypatch):
    text = (ROOT / "README.md").read_text()
    real = make_readme.read_json

    def demo_with(r):
        def read_json(name):
            d = real(name)
            return {**d, "mean_abs_r": r} if name == "demo_speed.json" else d
        return read_json

    monkeypatch.setattr(make_readme, "read_json", demo_with(0.5))
    changed = make_readme.render_top_readme(text, make_readme.readme_blocks())
    assert changed != text and "correlate 0.50 on" in changed


def _rendered_with(monkeypatch, csv_name: str, edit) -> tuple[str, str]:
    """(committed README, README rendered with ``edit(row)`` applied to every row of ``csv_name``)."""
    text = (ROOT / "README.md").read_text()
    real = make_readme.read_csv
    monkeypatch.setattr(make_readme, "read_csv", lambda name: [edit(r) for r in real(name)] if name == csv_name
                        else real(name))
    return text, make_readme.render_top_readme(text, make_readme.readme_blocks())


def test_a_changed_states_result_changes_the_readme(monkeypatch):
    text, changed = _rendered_with(monkeypatch, "dfnc_states.csv", lambda r: {**r, "state_r": 0.5} if
                                   r["method"] == "kmeans" and r["eps"] == 4.0 else r)
    assert changed != text and "r = 0.50 at a states budget of eps 4" in changed


def test_a_missing_or_repeated_marker_is_refused():
    with pytest.raises(SystemExit, match="'demo' exactly once"):
        make_readme.render_top_readme("no markers here\n", {"demo": "x"})
    twice = "<!-- measured: demo -->\n<!-- /measured -->\n" * 2
    with pytest.raises(SystemExit, match="exactly once"):
        make_readme.render_top_readme(twice, {"demo": "x"})


def _default_rows(cells):
    return [{"subjects": m, "sites": "equal", "ica": "spatial", "contribution": "subspace", "bound": 0.25,
             "epsilon": e, "r_median": v} for (m, e), v in cells.items()]


def test_the_size_a_budget_needs_is_the_smallest_from_which_the_maps_stay_good():
    rows = _default_rows({(50, 2.0): 0.5, (100, 2.0): 0.82, (250, 2.0): 0.79, (500, 2.0): 0.9, (1000, 2.0): 0.95,
                          (100, 4.0): 0.85})
    # 100 reaches 0.8 but 250 falls below: the size is the one from which every larger size stays at 0.8
    assert real_frontier.subjects_for(rows, 2.0) == (500, 0.9)
    assert real_frontier.subjects_for(rows, 4.0) == (100, 0.85)
    assert real_frontier.subjects_for(rows, 1.0) is None
    assert real_frontier.subjects_for(rows, 2.0, level=0.96) is None
    # other runs and unequal sites do not count
    other = [{**r, "contribution": "moment"} for r in _default_rows({(50, 4.0): 0.99})]
    unequal = [{**r, "sites": "30/60/90/120"} for r in _default_rows({(75, 4.0): 0.99})]
    assert real_frontier.subjects_for(rows + other + unequal, 4.0) == (100, 0.85)
    text = real_frontier.sizes_sentence(rows)
    assert "eps 2 needs 500 subjects per site (0.90)" in text and "eps 1 more than 0 per site" in text


def test_a_changed_frontier_changes_the_readmes_sizes(monkeypatch):
    def edit(r):
        default = r["ica"] == "spatial" and r["contribution"] == "subspace" and r["bound"] == 0.25
        return {**r, "r_median": 0.99} if default and r.get("sites") == "equal" and r["epsilon"] == 4.0 else r

    text, changed = _rendered_with(monkeypatch, "real_frontier.csv", edit)
    smallest = min(r["subjects"] for r in make_readme.read_csv("real_frontier.csv") if r.get("sites") == "equal")
    assert changed != text and f"eps 4 needs {smallest} subjects per site (0.99)" in " ".join(changed.split())


def test_a_changed_limit_changes_the_readme(monkeypatch):
    def edit(r):
        return {**r, "rotation_ceiling_max": 0.99} if (r["subjects"], r["epsilon"]) == (100, 4.0) else r

    lim = make_readme.read_csv("strong_privacy_limits.csv")
    eps1, eps2 = (f"{make_readme.one(lim, subjects=100, epsilon=e)['rotation_ceiling_max']:.2f}" for e in (1.0, 2.0))
    text, changed = _rendered_with(monkeypatch, "strong_privacy_limits.csv", edit)
    assert changed != text and f"at most at {eps1}, {eps2}, 0.99 at 4 x 100" in " ".join(changed.split())


def test_a_changed_result_changes_the_benchmarks_page_and_its_verdict(monkeypatch):
    """The page is rendered from the results; a verdict's wording is chosen by the data (sections/site_maps.py)."""
    env = make_readme.json.loads(make_readme.ENV.read_text())
    page = make_readme.build(env)
    assert page == (ROOT / "benchmarks" / "README.md").read_text()  # the committed page is up to date
    real = make_readme.read_json

    def worse(name):
        d = real(name)
        if name != "site_maps.json":
            return d
        return {**d, "summary": [{**s, "r_sites": 0.5} for s in d["summary"]]}

    monkeypatch.setattr(make_readme, "read_json", worse)
    changed = make_readme.build(env)
    row = next(ln for ln in changed.splitlines() if ln.startswith("| Voxel maps at product scale"))
    assert "each site's own voxel maps 0.500 at 100 parcels" in row
    assert row.endswith("| not met: the weakest networks stay below the noise at this size |")
    assert next(ln for ln in page.splitlines() if ln.startswith("| Voxel maps at product scale")).endswith("| met |")
