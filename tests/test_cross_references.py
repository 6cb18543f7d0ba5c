"""Every cross-reference in the package's docstrings (:func:`dpneuro...`, :class:, :mod:, ...) names something
that exists, so a renamed or removed function cannot stay cited."""

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r":(?:func|class|mod|data|attr|meth|exc):`~?(dpneuro[\w.]*)`")


def resolves(name: str) -> bool:
    """Whether ``name`` (dotted) is a module of the package or an attribute path inside one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_cross_reference_resolves():
    refs = {(m.group(1), p.relative_to(ROOT).as_posix()) for p in (ROOT / "dpneuro").rglob("*.py")
            for m in REFERENCE.finditer(p.read_text(encoding="utf-8"))}
    assert len(refs) > 100  # the check reads what it should
    bad = sorted(f"{path}: {name}" for name, path in refs if not resolves(name))
    assert not bad, "references to nothing:\n" + "\n".join(bad)


def test_a_reference_to_nothing_is_seen():
    assert resolves("dpneuro.run.pipeline.stage_release") and resolves("dpneuro.protocol.cape")
    assert not resolves("dpneuro.run.pipeline.stage_reduce") and not resolves("dpneuro.nothing.here")
