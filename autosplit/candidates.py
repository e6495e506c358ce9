"""The rows of a comparison: one costed plan (or why there is none) and what measuring it showed.

Data only, read by :mod:`autosplit.compare` (which makes them) and :mod:`autosplit.report.html`
(which draws them).
"""

from __future__ import annotations

from dataclasses import dataclass

from autosplit.plans import Plan

__all__ = ["Candidate", "Measured"]


@dataclass(frozen=True)
class Measured:
    """Measured seconds per training step (forward, backward and optimizer step) of one plan."""

    runtime: str
    """``"distributed"`` (pipeline stages on the process group's ranks), ``"local"`` (one
    process, the stages in turn on their devices) or ``"makespan"`` (one process, a worker per
    device running its planned tasks at once: :class:`~autosplit.runtime.makespan.MakespanRunner`)."""
    median: float
    min: float
    max: float
    steps: int
    predicted: float
    """What the plan predicts for this runtime: its step time (distributed, makespan), or the sum
    of its stages' compute (local: one process runs every stage in turn, the whole batch at once)."""

    @property
    def error(self) -> float:
        """(predicted − measured) / measured."""
        return (self.predicted - self.median) / self.median


@dataclass(frozen=True)
class Candidate:
    """One split in the comparison: a costed plan, or why there is none."""

    name: str
    plan: Plan | None
    error: str | None = None
    """Why the split is not a plan (a module that does not exist, data flowing backwards, ...)."""
    over_cap: tuple[str, ...] = ()
    """The stages whose predicted memory exceeds their device's cap."""
    measured: Measured | None = None

    @property
    def feasible(self) -> bool:
        return self.plan is not None and not self.over_cap
