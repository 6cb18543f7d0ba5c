"""The README's measured passages are rendered from the committed benchmark results (benchmarks/make_readme.py),
and CI's ``make_readme.py --check`` fails when a result changes and the README does not."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import make_readme  # noqa: E402


def test_every_measured_passage_of_the_readme_is_rendered_from_the_results():
    text = (ROOT / "README.md").read_text()
    blocks = make_readme.readme_blocks()
    assert set(blocks) == {"demo", "real_frontier", "frontier", "states"}
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


def test_a_changed_states_result_changes_the_readme(monkeypatch):
    text = (ROOT / "README.md").read_text()
    real = make_readme.read_csv

    def read_csv(name):
        rows = real(name)
        if name == "dfnc_states.csv":
            rows = [{**r, "state_r": 0.5} if r["method"] == "kmeans" and r["eps"] == 4.0 else r for r in rows]
        return rows

    monkeypatch.setattr(make_readme, "read_csv", read_csv)
    changed = make_readme.render_top_readme(text, make_readme.readme_blocks())
    assert changed != text and "r = 0.50 at a states budget of eps 4" in changed


def test_a_missing_or_repeated_marker_is_refused():
    with pytest.raises(SystemExit, match="'demo' exactly once"):
        make_readme.render_top_readme("no markers here\n", {"demo": "x"})
    twice = "<!-- measured: demo -->\n<!-- /measured -->\n" * 2
    with pytest.raises(SystemExit, match="exactly once"):
        make_readme.render_top_readme(twice, {"demo": "x"})
