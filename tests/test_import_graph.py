"""The package's imports, read from its source (no module is imported).

Two rules: the imports a module runs when it is loaded form no cycle among dpneuro's modules, and no
function imports anything, except a heavy optional dependency deferred so that loading the module stays
fast (:data:`DEFERRED`, each with its reason).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: where each package's source lives (workflows/ ships as dpneuro.workflows, pyproject.toml)
PACKAGES = {"dpneuro": ROOT / "dpneuro", "dpneuro.workflows": ROOT / "workflows"}

#: modules (and their submodules) a function may import, and why: each is slow to load, or loads a third-party
#: module that is, and is needed by few paths, so that loading dpneuro's modules stays fast
DEFERRED = {
    "matplotlib": "figures only; pyplot takes about a second to load",
    "nilearn": "templates, resampling, atlases, confounds and plotting only; it loads sklearn, pandas and more",
    "pandas": "a table of named confounds only",
    "scipy.signal": "detrending and the figures' spectra only; about 0.3 s to load",
    "scipy.stats": "the synthetic HRF and PD-SVD's measured leak only; about 0.3 s to load",
    "websockets": "COINSTAC's simulator only; an optional extra (coinstac, test)",
    "dp_accounting": "the RDP cross-check of a ledger only; a large accounting library",
    "dpneuro.estimators": "the demo and run commands only; it loads scikit-learn (BaseEstimator)",
    "dpneuro.workflows": ("the Pydra engine only: it loads pydra (about 0.2 s), and its workflow imports "
                          "dpneuro.run.pipeline (a cycle if loaded there)"),
    "dpneuro.deploy.cluster": "a site's cluster workers only (Dask or SLURM through Pydra): it loads pydra",
}

#: the package's layers, lowest first: a module may import only from its own layer and those below (the folders
#: are the layers; the estimators and the command line sit on top)
LAYERS = (
    ("dpneuro._utils",),
    ("dpneuro.privacy",),
    ("dpneuro.protocol",),
    ("dpneuro.data",),
    ("dpneuro.algorithms",),
    ("dpneuro.config",),
    ("dpneuro.datasets",),
    ("dpneuro.report",),
    ("dpneuro.run",),
    ("dpneuro.deploy", "dpneuro.workflows"),
    ("dpneuro.estimators", "dpneuro.cli"),
)
#: imports that reach up a layer, each deferred into a function, and why
UPWARD = {
    ("dpneuro.run.pipeline", "dpneuro.deploy.cluster"): "the load stage hands a site's decoding to its cluster "
                                                         "(Pydra's workers) only when the site configured one",
}


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, for its __init__.py)."""
    out = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, resolved against the importing module."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    # a package's __init__ resolves "." to itself, a module to its package
    base = base[:len(base) - node.level + (1 if _is_package(module) else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement names (absolute), with ``from pkg import submodule`` resolved."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    target = _absolute(module, node)
    return [target] + [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _load_time_imports(tree: ast.Module):
    """Import statements run when the module is loaded: the module body and class bodies, inside if/try/with
    blocks, not inside functions and not under ``if TYPE_CHECKING``."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def _function_imports(tree: ast.Module):
    """Import statements inside a function (at any depth)."""
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield node


def _trees() -> dict[str, ast.Module]:
    return {m: ast.parse(p.read_text(encoding="utf-8"), filename=str(p)) for m, p in MODULES.items()}


def load_graph() -> dict[str, set[str]]:
    """Module -> the package modules its loading runs: each named module and the packages above it (their
    __init__ runs first), except the importer's own packages, which are already loading."""
    graph: dict[str, set[str]] = {}
    for module, tree in _trees().items():
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        if _is_package(module):
            own.add(module)
        edges = set()
        for node in _load_time_imports(tree):
            for name in _imported(module, node):
                parts = name.split(".")
                edges |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & MODULES.keys()
        graph[module] = edges - own
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def function_imports() -> list[tuple[str, int, str]]:
    """(file, line, imported module) of every import inside a function."""
    out = []
    for module, tree in _trees().items():
        path = _rel(MODULES[module])
        for node in _function_imports(tree):
            # each name as module.name: "from scipy import stats" is scipy.stats, a function of nilearn.image
            # is covered by nilearn
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [f"{_absolute(module, node)}.{a.name}" for a in node.names])
            out += [(path, node.lineno, name) for name in names]
    return out


def test_no_import_cycle():
    found = cycles(load_graph())
    assert not found, "modules that import each other when loaded (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_cycle_detection_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _deferred(name: str) -> str | None:
    """The :data:`DEFERRED` entry that covers module ``name`` (itself or a package above it), if any."""
    parts = name.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in DEFERRED), None)


def test_no_function_level_imports():
    bad = [f"{path}:{line} imports {name}" for path, line, name in function_imports() if _deferred(name) is None]
    assert not bad, ("imports inside functions (move them to the top of the module, or add a heavy optional "
                     "dependency to DEFERRED with the reason):\n" + "\n".join(bad))


def layer(name: str) -> int | None:
    """The index in :data:`LAYERS` of the module ``name`` (the longest matching package), None outside them."""
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def upward_imports() -> list[tuple[str, str, int]]:
    """(module, imported module, line) of every import, at load time or in a function, of a higher layer."""
    out = []
    for module, tree in _trees().items():
        here = layer(module)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(module, node):
                    there = layer(name) if name in MODULES else None
                    if here is not None and there is not None and there > here:
                        out.append((module, name, node.lineno))
    return out


def test_every_module_is_in_a_layer():
    assert [m for m in MODULES if m != "dpneuro" and layer(m) is None] == []


def test_no_module_imports_from_a_higher_layer():
    bad = [f"{m} imports {name} (line {line})" for m, name, line in upward_imports() if (m, name) not in UPWARD]
    assert not bad, "imports from a higher layer (tests/test_import_graph.py LAYERS):\n" + "\n".join(bad)
    assert {(m, n) for m, n, _ in upward_imports()} == set(UPWARD)  # every listed exception is still needed


def test_the_layer_check_sees_an_upward_import():
    assert layer("dpneuro.protocol.cape.phases") < layer("dpneuro.algorithms.pca") < layer("dpneuro.run.stages")
    assert layer("dpneuro.run.pipeline") < layer("dpneuro.deploy.party") < layer("dpneuro.cli")


def private_imports(trees: dict[str, ast.Module] | None = None) -> list[str]:
    """``from <package module> import _name``: a module reaching into another's private names."""
    out = []
    for module, tree in (trees or _trees()).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _absolute(module, node).startswith("dpneuro"):
                out += [f"{module} imports {_absolute(module, node)}.{a.name} (line {node.lineno})"
                        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []


def test_the_private_import_check_sees_one():
    tree = ast.parse("from dpneuro._utils.files import _json_default\nfrom dpneuro._utils import errors\n")
    assert private_imports({"dpneuro.data.load": tree}) == [
        "dpneuro.data.load imports dpneuro._utils.files._json_default (line 1)"]


def test_every_deferred_dependency_is_deferred_somewhere():
    used = {_deferred(name) for _, _, name in function_imports()}
    assert set(DEFERRED) <= used, f"DEFERRED entries no function imports: {sorted(set(DEFERRED) - used)}"
