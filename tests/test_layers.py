"""The package's import layers, from every import statement (function-local ones included).

- no import cycle between modules;
- the solver imports neither torch nor the passes, nor anything of autosplit above it
  (errors, units, the schedule registry and the solver itself only);
- the ground floor (errors, units, schedules, progress, debug) imports nothing above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "autosplit"
GROUND = {"autosplit.errors", "autosplit.units", "autosplit.schedules", "autosplit.progress", "autosplit.debug"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module ``path`` imports, by any statement anywhere in it (``from autosplit import x``
    counts as importing ``autosplit.x`` when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        if name == "autosplit":  # the package's front door imports every room by design
            continue
        for target in _imports(path, modules):
            if target.startswith("autosplit") and target != name:
                graph.add_edge(name, target)
    return graph


def test_no_import_cycles():
    cycles = sorted(nx.simple_cycles(_graph()), key=len)
    assert not cycles, "import cycles: " + "; ".join(" → ".join(c) for c in cycles[:5])


def test_the_solver_imports_neither_torch_nor_the_passes_nor_anything_above_it():
    modules = _modules()
    allowed = {"autosplit.errors", "autosplit.units", "autosplit.schedules"}
    bad = []
    for name, path in modules.items():
        if name.startswith("autosplit.solver"):
            for target in _imports(path, modules):
                root = target.split(".")[0]
                if root == "torch" or (root == "autosplit" and not target.startswith("autosplit.solver") and target not in allowed):
                    bad.append(f"{name} imports {target}")
    assert not bad, bad


def test_the_ground_floor_imports_nothing_above_it():
    modules = _modules()
    bad = [f"{name} imports {target}" for name in GROUND for target in _imports(modules[name], modules)
           if target.startswith("autosplit") and target not in GROUND]
    assert not bad, bad
