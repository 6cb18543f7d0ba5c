"""Each benchmark's section of benchmarks/README.md, next to the benchmarks: one module per script, named after it.

A section module holds its page section as data, and the code that turns the results into the template's fields:

- ``TEMPLATE``: the section in Markdown, with ``{placeholders}`` (``str.format``; ``!n`` formats a measurement
  with ``fmt``, ``!p`` a set parameter with ``par``). Paragraphs that render empty are left out.
- ``fields(R)``: the placeholders' values from the results (``R.csv``, ``R.json``, ``R.run``, ``R.fig``), or
  ``None`` when the benchmark has no committed results (the section is left out).
- ``GLANCE`` (optional): the "At a glance" rows, ``{row: (claim, measured, {verdict: wording})}``, and
  ``glance(R)`` yielding ``(row, fields, verdict)`` for the rows that were measured.
- ``README`` (optional): passages of the project's README.md, ``{name: template}``, and ``readme(R)`` giving
  ``{name: fields}``. In these, a line longer than 100 characters that is not a table row is a paragraph,
  filled to 76 columns; shorter lines are kept as written.

``PAGE`` and ``GLANCE`` give the order on the page; a new benchmark adds its module and its name to them.
"""

from __future__ import annotations

import math
import re
import string

#: the sections in page order
PAGE = ["pca_utility", "pca_vs_n", "pca_power", "agn_utility", "agn_vs_n", "cape_delta", "secagg_overhead",
        "djica_speed", "djica_utility", "djica_end_to_end", "temporal_levers", "djica_vs_m", "centralized_tools",
        "coinstac_run", "dfnc_states", "dfnc_real", "states_utility", "fnc_utility", "group_stats", "group_findings",
        "real_frontier", "strong_privacy", "stable_ica", "fastica_noise", "canica_agreement", "feature_frontier",
        "noise_ablation", "frontier", "scale", "site_maps", "demo_speed", "site_speed"]

#: the "At a glance" rows, in order
GLANCE = ["pca_utility", "pca_vs_n", "pca_power", "agn_utility", "agn_vs_n", "djica_utility", "djica_end_to_end",
          "djica_vs_m", "centralized_tools", "secagg_overhead", "djica_speed", "demo_speed", "group_stats",
          "real_frontier", "site_maps"]


def fmt(v) -> str:
    """Numbers to at most 3-4 significant digits; inf/nan spelled out."""
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        a = abs(v)
        if a == 0:
            return "0"
        for low, spec in ((1000, ",.0f"), (100, ".0f"), (10, ".1f"), (1, ".2f"), (0.001, ".3f")):
            if a >= low:
                return format(v, spec)
        return f"{v:.2e}"
    return str(v)


def par(v) -> str:
    """A set parameter (epsilon, delta, ...) as written: 0.5, 2, 1e-05; not a measurement."""
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def r2(v) -> str:
    return f"{float(v):.2f}"


def table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(fmt(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def pick(rows, **kw):
    return [r for r in rows if all(r.get(k) == v for k, v in kw.items())]


def one(rows, **kw):
    got = pick(rows, **kw)
    return got[0] if got else None


def paras(*parts) -> str:
    """Paragraphs (or nested lists of them), blank-line separated, the empty ones left out."""
    flat = []
    for p in parts:
        flat += [paras(*p)] if isinstance(p, (list, tuple)) else [p]
    return "\n\n".join(p for p in flat if p.strip())


class _Formatter(string.Formatter):
    def get_field(self, field_name, args, kwargs):
        try:
            return super().get_field(field_name, args, kwargs)
        except (KeyError, IndexError):  # a field the results do not have reads as None, as dict.get
            return None, field_name

    def convert_field(self, value, conversion):
        return fmt(value) if conversion == "n" else par(value) if conversion == "p" else \
            super().convert_field(value, conversion)


def render(template: str, fields: dict, soft: bool = True) -> str:
    """``template`` filled in, its empty paragraphs left out. ``soft``: a single line break in the template is a
    space (paragraphs are wrapped in the source, one line on the page); line breaks from the fields stay."""
    template = template.strip("\n")
    if soft:
        template = re.sub(r"(?<!\n)\n(?!\n)", " ", re.sub(r"[ \t]*\n[ \t]*", "\n", template))
    return paras(*_Formatter().vformat(template, (), fields).split("\n\n"))


def frontier_table(rows, key_cols, value, epsilons, no_noise: bool = True) -> str:
    """One row per key (e.g. subjects, model, bound), one column per budget ("no noise" first unless left out)."""
    keys = list(dict.fromkeys(tuple(r[k] for k in key_cols) for r in rows))
    cols = ["none"] + [e for e in epsilons if e != "none"]
    out = []
    for key in keys:
        cells = {r["epsilon"]: r[value] for r in rows if tuple(r[k] for k in key_cols) == key}
        if any(c in cells for c in cols[1:]):
            out.append(list(key) + [cells.get(c, "") for c in cols])
    header = [*key_cols, *(f"eps {c:g}" if c != "none" else "no noise" for c in cols)]
    if not no_noise:
        header, out = header[:1] + header[2:], [b[:1] + b[2:] for b in out]
    return table(header, out)
