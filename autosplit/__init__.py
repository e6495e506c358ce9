"""autosplit: automatic graph partitioning of PyTorch training across devices.

Usage::

    import autosplit
    split = autosplit.autosplit(model, ["cpu"] * 4, example_inputs=(x,))
    print(split.plan)

Set ``AUTOSPLIT_DEBUG=1`` to log every pass with its time.
"""

from __future__ import annotations

import logging
import os

from autosplit.calibrate import Calibration, calibrate
from autosplit.compare import Comparison, compare
from autosplit.devices import PRESETS, DeviceSpec, resolve_devices
from autosplit.errors import (
    AutosplitError,
    CaptureError,
    CodegenError,
    ConstraintError,
    CostModelError,
    DeviceError,
    DistributedError,
    InfeasiblePlanError,
    PlanFileError,
    PlanMismatchError,
    PlanValidationError,
    SolverError,
)
from autosplit.htmlreport import write_html
from autosplit.hybrid import Cluster, HybridPlan, measure_noise_scale, plan_hybrid
from autosplit.measure import measure_link, measure_runtime, measure_stages
from autosplit.options import PlanOptions
from autosplit.passes.costs import CostTable
from autosplit.passes.profile import ProfileOptions
from autosplit.plan import Plan
from autosplit.planner import Planner, autosplit, plan
from autosplit.runtime import SplitModule
from autosplit.runtime.distributed import DistributedModel, distribute

__all__ = [
    "autosplit", "plan", "distribute", "DistributedModel", "Planner", "PlanOptions", "Plan", "SplitModule",
    "compare", "Comparison", "write_html", "plan_hybrid", "HybridPlan", "Cluster", "measure_noise_scale",
    "DeviceSpec", "PRESETS", "resolve_devices",
    "CostTable", "ProfileOptions", "calibrate", "Calibration", "measure_link", "measure_runtime", "measure_stages",
    "AutosplitError", "CaptureError", "CodegenError", "ConstraintError", "CostModelError", "DeviceError",
    "DistributedError", "InfeasiblePlanError", "PlanFileError", "PlanMismatchError", "PlanValidationError",
    "SolverError",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
if os.environ.get("AUTOSPLIT_DEBUG"):
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[autosplit] %(name)s: %(message)s"))
    logging.getLogger(__name__).addHandler(_handler)
    logging.getLogger(__name__).setLevel(logging.DEBUG)
