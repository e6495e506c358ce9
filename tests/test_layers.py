"""The package's import layers, from every import statement (function-local ones included).

- no import cycle between modules;
- the ground floor (the values passes exchange: options, plans, cost tables, devices, the
  schedule registry, errors, units, timers, …) imports nothing above it;
- the solver imports neither torch nor the passes: only itself and the torch-free ground floor;
- the runtimes and the reports never import the compiler or the API;
- the plan, option and cost-table modules (and what they import) load without torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "autosplit"
GROUND = {f"autosplit.{m}" for m in (
    "errors", "units", "schedules", "progress", "debug", "devices", "costtable", "options", "option_checks", "option_records",
    "plans", "plan_records",
    "plan_json", "candidates", "recipes", "microbatch", "timers", "compat", "plan_export", "megatron_layout", "device_spec",
    "gpu_presets", "engine_profiles",
)}
TORCH_FREE = {f"autosplit.{m}" for m in (
    "errors", "units", "schedules", "progress", "debug", "devices", "costtable", "options", "option_checks", "option_records",
    "plans", "plan_records",
    "plan_json", "recipes", "plan_export", "megatron_layout", "device_spec", "gpu_presets", "engine_profiles",
)}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path], *, top_level_only: bool = False) -> set[str]:
    """Every module ``path`` imports, by any statement anywhere in it (``from autosplit import x``
    counts as importing ``autosplit.x`` when that is a module); ``top_level_only``: what loading it
    imports (statements in functions and under ``if TYPE_CHECKING:`` left out)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in (tree.body if top_level_only else ast.walk(tree)):
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
    allowed = TORCH_FREE
    bad = []
    for name, path in modules.items():
        if name.startswith("autosplit.solver"):
            for target in _imports(path, modules):
                root = target.split(".")[0]
                if root == "torch" or (root == "autosplit" and not target.startswith("autosplit.solver") and target not in allowed):
                    bad.append(f"{name} imports {target}")
    assert not bad, bad



def test_solver_never_imports_passes_or_torch():
    code = (
        "import sys, autosplit.solver, autosplit.solver.makespan, autosplit.solver.hybrid; "
        "bad = sorted(m for m in sys.modules if m.startswith(('autosplit.passes', 'torch'))); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    # Import the solver package alone, without the autosplit package's own __init__ pulling torch in.
    result = subprocess.run(
        [sys.executable, "-c", "import importlib.util, sys, types; "
         f"pkg = types.ModuleType('autosplit'); pkg.__path__ = [{str(PACKAGE)!r}]; sys.modules['autosplit'] = pkg; "
         + code],
        capture_output=True, text=True, cwd=PACKAGE.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr

def test_the_ground_floor_imports_nothing_above_it():
    modules = _modules()
    bad = [f"{name} imports {target}" for name in GROUND for target in _imports(modules[name], modules)
           if target.startswith("autosplit") and target not in GROUND]
    assert not bad, bad


def test_the_runtimes_and_the_reports_import_neither_the_compiler_nor_the_api():
    modules = _modules()
    bad = [f"{name} imports {target}" for name, path in modules.items()
           if name.startswith(("autosplit.runtime", "autosplit.report"))
           for target in _imports(path, modules) if target.startswith(("autosplit.compiler", "autosplit.api"))]
    assert not bad, bad


def test_plans_options_and_cost_tables_load_without_torch():
    modules = _modules()
    seen, todo, bad = set(), list(TORCH_FREE), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for target in _imports(modules[name], modules, top_level_only=True):
            if target.split(".")[0] in ("torch", "numpy"):
                bad.append(f"{name} imports {target}")
            elif target.startswith("autosplit") and target in modules:
                todo.append(target)
    assert not bad, bad
