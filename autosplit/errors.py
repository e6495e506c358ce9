"""Typed errors. Every error autosplit raises derives from :class:`AutosplitError`.

Messages follow one shape: what failed (with the numbers) → the likely cause → what to try.
"""

from __future__ import annotations

__all__ = [
    "AutosplitError",
    "DeviceError",
    "CaptureError",
    "CostModelError",
    "InfeasiblePlanError",
    "SolverError",
    "PlanValidationError",
    "PlanMismatchError",
    "CodegenError",
    "ConstraintError",
]


class AutosplitError(Exception):
    """Root of every error autosplit raises."""


class DeviceError(AutosplitError, ValueError):
    """A device entry, preset name or memory cap could not be understood."""


class CaptureError(AutosplitError):
    """Neither torch.fx symbolic tracing nor torch.export could capture the model."""


class CostModelError(AutosplitError):
    """A node's shapes, FLOPs or memory could not be estimated."""


class InfeasiblePlanError(AutosplitError):
    """No assignment satisfies the constraints (memory caps, colocation, stage count)."""


class SolverError(AutosplitError):
    """The solver returned no plan (time limit hit before a feasible plan was found)."""


class PlanValidationError(AutosplitError):
    """A plan breaks a correctness rule (DESIGN §4.5); raised by ``validate``."""


class PlanMismatchError(AutosplitError):
    """A saved plan was applied to a model whose graph differs from the planned one."""


class CodegenError(AutosplitError):
    """A stage module could not be generated from a plan."""


class ConstraintError(AutosplitError, ValueError):
    """A planning option or constraint is invalid: an unknown schedule, module or device."""
