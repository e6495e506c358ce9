"""Private torch APIs are reached only through :mod:`autosplit.compat`.

Every module of the library but ``compat.py`` is walked (AST): no import of a private torch module
(``torch._ops``, ``torch.utils._pytree``), no underscore name imported from torch, no attribute chain
from ``torch`` through an underscore name (``torch._amp_update_scale_``,
``torch.nn.modules.batchnorm._NormBase``). The range ``pyproject.toml`` declares is the one
``compat`` names as checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

from autosplit import compat

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted(p for p in (ROOT / "autosplit").rglob("*.py") if p.name != "compat.py" or p.parent.name != "autosplit")


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _chain(node: ast.AST) -> list[str] | None:
    """``torch.a.b`` as ``["torch", "a", "b"]``; ``None`` for any other expression."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(names)]
    return None


def _uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] == "torch" and _private(a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = (node.module or "").split(".")
            found += [f"{where} from {node.module} import {a.name}" for a in node.names if _private([*module, a.name])]
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] == "torch" and _private(chain):
                found.append(f"{where} {'.'.join(chain)}")
    return sorted(set(found))


def test_the_walk_sees_private_uses(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nimport torch._dynamo\nfrom torch.utils import _pytree\nfrom torch._ops import OpOverload\n"
                     "x = torch._amp_update_scale_\ny = torch.nn.modules.batchnorm._NormBase\nz = torch.__version__\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        uses = _uses(probe)
    finally:
        ROOT = saved
    assert len(uses) == 5 and not any("__version__" in u for u in uses)


def test_private_torch_apis_only_through_compat():
    assert len(LIBRARY) > 50
    uses = [u for path in LIBRARY for u in _uses(path)]
    assert not uses, "private torch APIs outside autosplit/compat.py (add them there, with the versions checked):\n" + "\n".join(uses)


def test_the_declared_torch_range_holds_the_checked_versions_and_this_one():
    declared = re.findall(r'^\s*"torch\s*>=\s*([\d.]+)\s*,\s*<\s*([\d.]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert len(declared) == 1, "pyproject.toml declares torch as one range: torch>=LOW,<HIGH"
    ((low, high),) = declared
    spec = f"torch>={low},<{high}"

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])

    for checked in (*compat.TORCH_CHECKED, torch.__version__):
        assert version(low) <= version(checked) < version(high), f"torch {checked} outside the declared {spec}"
