"""autosplit: automatic graph partitioning of PyTorch training across devices.

Usage::

    import autosplit
    from autosplit.report import plan_report

    split = autosplit.autosplit(model, ["cpu"] * 4, example_inputs=(x,))
    print(plan_report(split.plan))

The verbs and the classes a user holds are here; everything else is imported from its room
(``autosplit.report``, ``autosplit.calibration``, ``autosplit.errors``, ``autosplit.devices``, …;
``docs/architecture.md`` lists them). ``AUTOSPLIT_DEBUG=1`` logs every pass with its time, ``2``
the solver and each plan, ``3`` each stage's code (:mod:`autosplit.debug`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import TYPE_CHECKING, Any

from autosplit import debug
from autosplit.errors import AutosplitError, unknown_name

if TYPE_CHECKING:
    from autosplit.api.comparison import compare
    from autosplit.api.distributed import distribute
    from autosplit.api.hybrid import plan_hybrid
    from autosplit.api.planner import Planner, autosplit, plan
    from autosplit.calibration.efficiency import calibrate
    from autosplit.compiler.hybrid import Cluster
    from autosplit.devices import DeviceSpec
    from autosplit.options import PlanOptions
    from autosplit.plans import Plan
    from autosplit.recipes import Recipe
    from autosplit.runtime.distributed import DistributedModel
    from autosplit.runtime.local import SplitModule
    from autosplit.runtime.makespan import MakespanRunner
    from autosplit.shapes import Spec

__all__ = [
    "autosplit", "plan", "distribute", "compare", "plan_hybrid", "calibrate",
    "Planner", "PlanOptions", "Plan", "Recipe", "Cluster", "DeviceSpec", "Spec",
    "SplitModule", "DistributedModel", "MakespanRunner",
    "AutosplitError",
]

_LAZY = {
    "autosplit": "autosplit.api.planner", "plan": "autosplit.api.planner", "Planner": "autosplit.api.planner",
    "distribute": "autosplit.api.distributed", "compare": "autosplit.api.comparison", "plan_hybrid": "autosplit.api.hybrid",
    "calibrate": "autosplit.calibration.efficiency", "PlanOptions": "autosplit.options", "Plan": "autosplit.plans",
    "Recipe": "autosplit.recipes", "Cluster": "autosplit.compiler.hybrid", "DeviceSpec": "autosplit.devices",
    "Spec": "autosplit.shapes", "SplitModule": "autosplit.runtime.local", "DistributedModel": "autosplit.runtime.distributed",
    "MakespanRunner": "autosplit.runtime.makespan",
}
"""Where each exported name lives, imported on first use: ``import autosplit`` costs what its first verb needs.
The planner's rooms (capture, costs, the solvers' front ends) take a quarter of a second over torch; the multi-process
runtime pulls in ``torch.distributed.pipelining`` (and with it ``torch._dynamo`` and FSDP), seconds more; the
command line's help needs neither."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # a room, e.g. ``autosplit.report`` (sets the attribute)
    raise unknown_name(__name__, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


logging.getLogger(__name__).addHandler(logging.NullHandler())
debug.configure()
