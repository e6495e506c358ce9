"""The user's module/device constraints (``pin``, ``avoid``, ``together``) as rules over graph nodes.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.errors import ConstraintError, advice
from autosplit.options import PlanOptions
from autosplit.plan_export import layer_paths, module_prefixes, names_for
from autosplit.solver.problem import UserConstraint

__all__ = ["engine_groups", "user_constraints"]


def _device_index(ref: int | str, specs: Sequence[DeviceSpec]) -> int:
    if isinstance(ref, int) and 0 <= ref < len(specs):
        return ref
    hits = [i for i, s in enumerate(specs) if str(ref) in (s.torch_device, s.name)]
    if len(hits) != 1:
        raise ConstraintError(
            advice(
                f"constraint names device {ref!r}, which matches {len(hits)} of the {len(specs)} devices "
                f"({[s.torch_device or s.name for s in specs]})",
                "a constraint must name exactly one device" + (" and several share that name" if hits else ""),
                f"name it by its index 0..{len(specs) - 1}",
            )
        )
    return hits[0]


def _module_nodes(module: str, table: CostTable) -> tuple[int, ...]:
    nodes = tuple(i for i, p in enumerate(table.module_paths) if p == module or p.startswith(module + "."))
    if not nodes:
        known = sorted({p for p in table.module_paths if p})
        close = difflib.get_close_matches(module, known, n=3)
        raise ConstraintError(
            advice(
                f"constraint names module {module!r}, but no graph node comes from it",
                "a misspelt name, or a module the forward never calls",
                f"did you mean {close}?" if close else f"a module of the model; they look like {known[:5]}",
            )
        )
    return nodes


def user_constraints(table: CostTable, options: PlanOptions) -> list[UserConstraint]:
    """Module/device constraints as (node, device) rules; build_problem maps devices to stages."""
    specs, out = table.devices, []
    for module, ref in (options.pin or {}).items():
        d = _device_index(ref, specs)
        nodes = _module_nodes(module, table)
        forbid = tuple((n, other) for n in nodes for other in range(len(specs)) if other != d)
        out.append(UserConstraint(f"pin '{module}' to device {d} ({specs[d].torch_device or specs[d].name})", forbid))
    for module, refs in (options.avoid or {}).items():
        listed = [refs] if isinstance(refs, (int, str)) else list(refs)
        ds = sorted({_device_index(r, specs) for r in listed})
        nodes = _module_nodes(module, table)
        out.append(UserConstraint(f"keep '{module}' off devices {ds}", tuple((n, d) for n in nodes for d in ds)))
    for modules in options.together or ():
        nodes = tuple(sorted({n for m in modules for n in _module_nodes(m, table)}))
        out.append(UserConstraint(f"keep {list(modules)} together", (), nodes))
    if options.expressible_in:
        for modules in engine_groups(table, options.expressible_in, options.names):
            nodes = tuple(sorted({n for m in modules for n in _module_nodes(m, table)}))
            out.append(UserConstraint(f"keep {list(modules)} on one stage, as {options.expressible_in} places them", (), nodes))
    return out


def engine_groups(table: CostTable, engine: str, names: Mapping[str, str] | None = None) -> list[tuple[str, ...]]:
    """The modules ``engine`` places only together (:mod:`autosplit.plan_export`): each layer of the
    repeated blocks, and for Megatron the final norm with the output (its loss stage ``L``); ``names``:
    where torchtitan's llama3 modules are in the model (found by itself for the models it knows)."""
    paths = module_prefixes(table.module_paths)
    resolved = names_for(paths, names)
    groups: list[tuple[str, ...]] = [(p,) for p in layer_paths(paths, resolved)]
    return groups + ([(resolved.norm, resolved.output)] if engine == "megatron" else [])
