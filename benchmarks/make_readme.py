"""Regenerate benchmarks/README.md from the result files in benchmarks/results/.

Every number in the README is read from a result file (CSV/JSON written by the
benchmark scripts), so the page and the results cannot drift apart. The
machine description and the date of each result come from
``results/environment.json``, written by ``--record`` on the machine that ran
the benchmarks (so regenerating elsewhere gives the same page).

Each benchmark's section (its prose as a Markdown template, its verdicts as data,
its passages of the project's README) lives next to it in ``benchmarks/sections/``,
one module per script; this file only renders them.

    python benchmarks/make_readme.py                 # rewrite README.md from the results
    python benchmarks/make_readme.py --record        # first snapshot this machine and the result dates
    python benchmarks/make_readme.py --record --runtime cape_delta=3   # plus measured run times (s)
    python benchmarks/make_readme.py --check         # exit 1 if README.md is not up to date (CI)

``*_quick.*`` files (smoke runs) are ignored.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import io
import json
import math
import os
import platform
import re
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sections  # noqa: E402
from sections import fmt, one, par, pick, render, table  # noqa: E402,F401  (re-exported for tests and scripts)

RESULTS = HERE / "results"
README = HERE / "README.md"
ENV = RESULTS / "environment.json"
#: the project's README: its measured passages sit between ``<!-- measured: NAME -->`` and ``<!-- /measured -->``
TOP_README = HERE.parent / "README.md"


# -- reading ---------------------------------------------------------------------------------------------

def read_csv(name: str) -> list[dict]:
    path = RESULTS / name
    if not path.exists():
        return []
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    for r in rows:
        for k, v in r.items():
            r[k] = _num(v)
    return rows


def read_json(name: str) -> dict:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else {}


def _num(v):
    if v is None or v == "":
        return v
    try:
        x = float(v)
    except (TypeError, ValueError):
        return {"True": True, "False": False}.get(v, v)
    return int(x) if x.is_integer() and "." not in v and "e" not in v.lower() and "inf" not in v else x


class Results:
    """What a section reads: the result files, and the lines every section shares (run line, figure)."""

    def __init__(self, env: dict):
        self.env = env

    def csv(self, name: str) -> list[dict]:
        return read_csv(name)

    def json(self, name: str) -> dict:
        return read_json(name)

    def text(self, name: str) -> str:
        return (RESULTS / name).read_text() if (RESULTS / name).exists() else ""

    def runtime(self, key: str):
        return self.env.get("runtimes_s", {}).get(key)

    def run(self, command: str, files: list[str], runtime_s=None) -> str:
        """The command that wrote ``files``, their date and the run time."""
        rt = f"{runtime_s:.0f} s" if isinstance(runtime_s, (int, float)) and math.isfinite(runtime_s) else \
            "not recorded"
        dates = sorted({d for d in (self.env.get("file_dates", {}).get(f) for f in files) if d})
        return (f"- command: `{command}`\n- results: {', '.join(f'[{f}](results/{f})' for f in files)}; run on "
                f"{', '.join(dates) if dates else 'unknown'}; run time {rt}")

    def fig(self, name: str, alt: str) -> str:
        return f"![{alt}](results/{name})" if (RESULTS / name).exists() else ""


def modules(names: list[str]):
    return [importlib.import_module(f"sections.{n}") for n in names]


# -- environment -----------------------------------------------------------------------------------------

def record_environment(runtimes: dict[str, float]) -> dict:
    import numpy as np

    old = json.loads(ENV.read_text()) if ENV.exists() else {}
    np.dot(np.ones((4, 4)), np.ones((4, 4)))  # load BLAS so threadpoolctl sees it
    try:
        from threadpoolctl import threadpool_info

        blas = [{k: d.get(k) for k in ("internal_api", "version", "num_threads", "threading_layer",
                                       "architecture")} for d in threadpool_info()]
    except ImportError:  # pragma: no cover
        blas = []
    try:
        deps = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        np_blas = f"{deps.get('name')} {deps.get('version')} ({deps.get('openblas configuration', '').strip()})"
    except Exception:  # noqa: BLE001 - older numpy: not essential
        np_blas = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dates = {p.name: datetime.date.fromtimestamp(p.stat().st_mtime).isoformat()
             for p in sorted(RESULTS.iterdir()) if p.is_file() and "_quick." not in p.name and p != ENV}
    env = {"recorded": datetime.date.today().isoformat(), "nproc": os.cpu_count(), "cpu": cpu,
           "os": platform.platform(), "python": platform.python_version(), "numpy": np.__version__,
           "numpy_blas": np_blas, "threadpoolctl": blas, "load_average_at_record": list(os.getloadavg()),
           "file_dates": dates, "runtimes_s": {**old.get("runtimes_s", {}), **runtimes}}
    ENV.write_text(json.dumps(env, indent=1) + "\n")
    return env


# -- the page ----------------------------------------------------------------------------------------------

PAGE = """\
# Benchmarks and reproduction report

<!-- generated by benchmarks/make_readme.py from benchmarks/results/; do not edit by hand -->

What dpneuro reproduces from the papers ([CAPE-TF] Imtiaz & Sarwate 2018, [DPdisPCA] ICASSP 2018, [capeDJICA]
Imtiaz et al. 2021; see docs/references.md), where it is faster or better, and where it is not. Every number below
is measured by the script named with it, a median over the stated repeats; ratios come from one run. Regenerate
this page with `python benchmarks/make_readme.py` after re-running a benchmark (`--record` also snapshots the
machine and the result dates). CI runs every script with `--quick` (smoke size, `*_quick.*` outputs, not
committed).

## Machine

{machine}

## At a glance

{glance}

## Results

{results}
"""

MACHINE = [
    "- cores (`nproc`): {nproc}; CPU: {cpu}; {os}",
    "- Python {python}, numpy {numpy}; BLAS (numpy.show_config): {numpy_blas}; at run time (threadpoolctl): {blas}",
    ("- shared machine: other jobs ran alongside (load average {load} when this snapshot was recorded on {recorded}),"
     " so wall times are upper bounds; CPU times are given where a script measures them"),
]

GLANCE_HEADER = ["paper claim / question", "dpneuro, measured (medians)", "verdict"]


def glance_rows(R: Results) -> list[list[str]]:
    """Every section's "At a glance" rows: its claim, what was measured, and the verdict its data name."""
    rows = []
    for mod in modules(sections.GLANCE):
        for key, f, verdict in mod.glance(R):
            claim, measured, verdicts = mod.GLANCE[key]
            rows.append([render(claim, f), render(measured, f), render(verdicts[verdict], f)])
    return rows


def build(env: dict) -> str:
    R = Results(env)
    blas = "; ".join(f"{b.get('internal_api')} {b.get('version')} ({b.get('threading_layer')}, "
                     f"{b.get('num_threads')} threads, {b.get('architecture')})" for b in env.get("threadpoolctl", []))
    la = env.get("load_average_at_record")
    machine = render("\n".join(MACHINE if la else MACHINE[:2]),
                     {**env, "blas": blas or "unknown", "load": ", ".join(f"{x:.1f}" for x in la or [])}, soft=False)
    parts = []
    for mod in modules(sections.PAGE):
        f = mod.fields(R)
        if f is not None:
            parts.append(render(mod.TEMPLATE, f))
    return render(PAGE, {"machine": machine, "glance": table(GLANCE_HEADER, glance_rows(R)),
                         "results": "\n\n".join(parts)}) + "\n"


# -- the project README's measured passages ------------------------------------------------------------------

def _fill(text: str) -> str:
    """A README passage: lines longer than 100 characters (not table rows) are paragraphs, filled to 76."""
    return "\n".join("\n".join(textwrap.wrap(ln, 76)) if len(ln) > 100 and not ln.startswith("|") else ln
                     for ln in text.split("\n"))


def readme_blocks() -> dict[str, str]:
    """The README's "What to expect" passages that quote measurements, rendered from the result files."""
    R = Results(json.loads(ENV.read_text()) if ENV.exists() else {})
    blocks = {}
    for mod in modules(sections.PAGE):
        for name, f in (mod.readme(R) if hasattr(mod, "readme") else {}).items():
            blocks[name] = _fill(render(mod.README[name], f, soft=False))
    return blocks


def render_top_readme(text: str, blocks: dict[str, str]) -> str:
    """``text`` with every measured passage replaced by its rendering (each must be in the README once)."""
    for name, body in blocks.items():
        pattern = re.compile(rf"(<!-- measured: {name} -->\n)(?:(?!<!-- ).*\n)*?(<!-- /measured -->)")
        if len(pattern.findall(text)) != 1:
            raise SystemExit(f"README.md must hold the measured passage {name!r} exactly once")
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", action="store_true", help="snapshot this machine and the result dates first")
    ap.add_argument("--runtime", action="append", default=[], metavar="NAME=SECONDS",
                    help="with --record: a measured run time for a script that does not record its own")
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md differs from the generated page")
    a = ap.parse_args(argv)
    if a.record:
        env = record_environment({k: float(v) for k, v in (x.split("=", 1) for x in a.runtime)})
    else:
        env = json.loads(ENV.read_text()) if ENV.exists() else {}
    text = build(env)
    top = TOP_README.read_text()
    top_text = render_top_readme(top, readme_blocks())
    if a.check:
        stale = [str(f) for f, have, want in ((README, README.read_text() if README.exists() else "", text),
                                             (TOP_README, top, top_text)) if have != want]
        if stale:
            print(f"out of date: {', '.join(stale)}: run python benchmarks/make_readme.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(text)
    TOP_README.write_text(top_text)
    print(f"wrote {README} and the measured passages of {TOP_README}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
