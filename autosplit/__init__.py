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
import logging
from typing import TYPE_CHECKING, Any

from autosplit import debug
from autosplit.api.comparison import compare
from autosplit.api.hybrid import plan_hybrid
from autosplit.api.planner import Planner, autosplit, plan
from autosplit.calibration.efficiency import calibrate
from autosplit.compiler.hybrid import Cluster
from autosplit.devices import DeviceSpec
from autosplit.errors import AutosplitError, unknown_name
from autosplit.options import PlanOptions
from autosplit.plans import Plan
from autosplit.recipes import Recipe
from autosplit.runtime.local import SplitModule
from autosplit.runtime.makespan import MakespanRunner
from autosplit.shapes import Spec

if TYPE_CHECKING:
    from autosplit.api.distributed import distribute
    from autosplit.runtime.distributed import DistributedModel

__all__ = [
    "autosplit", "plan", "distribute", "compare", "plan_hybrid", "calibrate",
    "Planner", "PlanOptions", "Plan", "Recipe", "Cluster", "DeviceSpec", "Spec",
    "SplitModule", "DistributedModel", "MakespanRunner",
    "AutosplitError",
]

_LAZY = {"distribute": "autosplit.api.distributed", "DistributedModel": "autosplit.runtime.distributed"}
"""Names imported on first use: the multi-process runtime pulls in ``torch.distributed.pipelining`` (and with it
``torch._dynamo`` and FSDP), seconds of imports that planning and the command line's help never need."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise unknown_name(__name__, name)


logging.getLogger(__name__).addHandler(logging.NullHandler())
debug.configure()
