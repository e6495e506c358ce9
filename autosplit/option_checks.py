"""The checks of :class:`~autosplit.options.PlanOptions`' mapping-valued fields and its costs' source, and the error
every option check raises (a module of its own: the options' module holds the fields and the checks of one value).

Usage::

    raise bad("micro_batches", 0, "an integer ≥ 1")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autosplit.costtable import CostTable
from autosplit.errors import ConstraintError, advice
from autosplit.option_records import ProfileOptions
from autosplit.units import parse_bytes

__all__ = ["bad", "check_costs_and_mappings", "is_int"]

def bad(name: str, value: Any, legal: str) -> ConstraintError:
    """The error for option ``name`` set to ``value`` outside ``legal``."""
    return ConstraintError(advice(
        f"option {name}={value!r} is out of range", f"{name} must be {legal}", f"pass {name} = {legal}"
    ))


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_costs_and_mappings(self: Any) -> None:
    """The costs' source; memory caps, pins, avoids, overrides and groups, keyed and valued as each one reads."""
    named = isinstance(self.costs, str) and self.costs in ("analytic", "measured")
    given = isinstance(self.costs, (ProfileOptions, CostTable)) or (
        isinstance(self.costs, (str, Path)) and Path(self.costs).is_file()
    )
    if not (named or given):
        raise bad("costs", self.costs, "'analytic', 'measured', ProfileOptions(...), a CostTable or a saved table's path")
    if self.memory is not None:
        if not isinstance(self.memory, Mapping):
            raise bad("memory", self.memory, "a mapping of device index or name to a size, e.g. {0: '8GiB'}")
        for key, cap in self.memory.items():
            if not isinstance(key, str) and not (is_int(key) and int(key) >= 0):
                raise bad("memory", self.memory, "keyed by device index (an integer ≥ 0) or device name")
            parse_bytes(cap)  # raises a DeviceError naming the size it cannot read
    for name in ("pin", "avoid", "cost_overrides"):
        value = getattr(self, name)
        if value is not None and not (isinstance(value, Mapping) and all(isinstance(k, str) for k in value)):
            raise bad(name, value, "a mapping keyed by module or node name")
    for name, value in (("pin", self.pin), ("avoid", self.avoid)):
        for module, where in (value or {}).items():
            targets = [where] if name == "pin" or isinstance(where, (int, str)) else where
            if not isinstance(targets, Sequence) or not all(is_int(t) or isinstance(t, str) for t in targets):
                raise bad(name, {module: where}, "device indices or names per module")
    if self.together is not None and (
        isinstance(self.together, str)
        or not all(not isinstance(g, str) and isinstance(g, Sequence) and all(isinstance(m, str) for m in g)
                   for g in self.together)
    ):
        raise bad("together", self.together, "a list of groups of module names, e.g. [('wte', 'head')]")
