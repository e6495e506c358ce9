"""Typed errors. Every error autosplit raises derives from :class:`AutosplitError`.

One class per kind of failure; messages follow one shape, built by :func:`advice`:
what failed (with the numbers) → the likely cause → what to try.

Usage::

    raise DeviceError(advice(f"device {dev} is not available (found {n})", "...", "pass a preset such as 'A100-80GB'"))
"""

from __future__ import annotations

__all__ = [
    "AutosplitError",
    "CaptureError",
    "CodegenError",
    "CompileError",
    "ConstraintError",
    "CostModelError",
    "DeviceError",
    "DistributedError",
    "ExportError",
    "InfeasiblePlanError",
    "LayerCutError",
    "PlanFileError",
    "PlanMismatchError",
    "PlanValidationError",
    "SolverError",
    "UnknownNameError",
    "advice",
    "causes",
    "unknown_name",
]


def advice(what: str, why: str | None = None, fix: str | None = None) -> str:
    """One error message: ``what`` failed → ``why`` (the likely cause) → ``fix`` (what to try)."""
    parts = [what.rstrip(". ")]
    if why:
        parts.append(f"Likely cause: {why.rstrip('. ')}")
    if fix:
        parts.append(f"Try: {fix.rstrip('. ')}")
    return ". ".join(parts) + "."


def causes(e: BaseException | None) -> str:
    """The first line of each exception in the chain: ``RuntimeError: … ← ValueError: …``."""
    lines: list[str] = []
    while e is not None and len(lines) < 4:
        text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        lines.append(f"{type(e).__name__}: {text[:300]}")
        e = e.__cause__ or e.__context__
    return " ← ".join(lines)


class AutosplitError(Exception):
    """Root of every error autosplit raises."""


class DeviceError(AutosplitError, ValueError):
    """A device entry, preset name or memory cap could not be understood."""


class ConstraintError(AutosplitError, ValueError):
    """A planning option or constraint is invalid: an unknown schedule, module, device or value out of range."""


class CaptureError(AutosplitError):
    """Neither torch.fx symbolic tracing nor torch.export could capture the model."""


class CostModelError(AutosplitError):
    """A node's shapes, FLOPs, memory or measured cost could not be obtained."""


class InfeasiblePlanError(AutosplitError):
    """No assignment satisfies the constraints (memory caps, colocation, stage count)."""


class SolverError(AutosplitError):
    """The solver returned no plan (time limit hit before a feasible plan was found)."""


class PlanValidationError(AutosplitError):
    """A plan breaks a correctness rule (DESIGN §4.5); raised by ``validate``."""


class PlanFileError(AutosplitError):
    """A plan file cannot be read: missing, not JSON, another schema version, or a malformed field."""


class PlanMismatchError(AutosplitError):
    """A plan was applied to a model whose graph differs from the planned one."""


class CodegenError(AutosplitError):
    """A stage module could not be generated from a plan."""


class CompileError(AutosplitError):
    """A stage cannot be compiled with ``torch.compile``: no C++ compiler or triton for inductor, an unknown
    backend, or an operation the backend refuses (``compile=True``; see :mod:`autosplit.runtime.compiled`)."""


class ExportError(AutosplitError, ValueError):
    """A plan cannot be written in an engine's terms: a cut inside a layer, parameters the name map
    does not place, a schedule or recomputation the engine does not run."""


class LayerCutError(ExportError):
    """An export refused because the plan cuts inside a layer; ``nearest`` holds, where the planner made
    it (:meth:`autosplit.Planner.export`), the nearest plan that keeps every layer whole."""

    nearest: object = None


class UnknownNameError(AutosplitError, AttributeError):
    """A name a package of autosplit does not have (its module ``__getattr__``, which imports some names on first
    use): an ``AttributeError``, so that ``hasattr`` and ``from autosplit import …`` behave as on any module."""


def unknown_name(module: str, name: str) -> UnknownNameError:
    """The error a package's ``__getattr__`` raises for ``name``, which it does not have."""
    return UnknownNameError(advice(f"module {module!r} has no attribute {name!r}",
                                   "the package exports the names of its __all__", f"use one of dir({module})"))


class DistributedError(AutosplitError):
    """The distributed runtime cannot run: the process group does not match the plan, or a rank failed."""
