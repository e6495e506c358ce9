"""autosplit: automatic graph partitioning of PyTorch training across devices.

Usage::

    import autosplit
    split = autosplit.autosplit(model, ["cpu"] * 4, example_inputs=(x,))
    print(split.plan)

``AUTOSPLIT_DEBUG=1`` logs every pass with its time, ``2`` the solver and each plan, ``3`` each
stage's code (:mod:`autosplit.debug`).
"""

from __future__ import annotations

import logging

from autosplit import debug
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
from autosplit.options import PlanOptions, SolverLimits
from autosplit.passes.costs import CostTable
from autosplit.passes.profile import ProfileOptions
from autosplit.plan import Plan
from autosplit.planner import Planner, autosplit, plan
from autosplit.runtime import SplitModule
from autosplit.runtime.distributed import DistributedModel, distribute

__all__ = [
    "autosplit", "plan", "distribute", "DistributedModel", "Planner", "PlanOptions", "SolverLimits", "Plan", "SplitModule",
    "compare", "Comparison", "write_html", "plan_hybrid", "HybridPlan", "Cluster", "measure_noise_scale",
    "DeviceSpec", "PRESETS", "resolve_devices",
    "CostTable", "ProfileOptions", "calibrate", "Calibration", "measure_link", "measure_runtime", "measure_stages",
    "AutosplitError", "CaptureError", "CodegenError", "ConstraintError", "CostModelError", "DeviceError",
    "DistributedError", "InfeasiblePlanError", "PlanFileError", "PlanMismatchError", "PlanValidationError",
    "SolverError",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
debug.configure()
