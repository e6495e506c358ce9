"""How much work the solver may do: model sizes past which it coarsens, skips CP-SAT or narrows a bound.

These are the solver's engineering limits, not its time limit (``PlanOptions.time_limit``):
each trades plan quality or bound tightness against planning time and memory
(``benchmarks/solver_scaling.py`` measures the trade; its results record the limits used).
The defaults are what every plan uses unless a caller passes others (``PlanOptions.limits``,
or ``limits=`` to the solver's functions), so the same problem, seed and limits give the same
plan on every rank. Torch-free, like the rest of :mod:`autosplit.solver`.

Usage::

    solve(problem, limits=SolverLimits(cpsat_vars=40_000))            # CP-SAT on larger models
    autosplit.plan(model, devices, example_inputs=(x,), limits=SolverLimits(dp_work=1))  # always coarsen
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autosplit.errors import ConstraintError, advice

__all__ = ["SolverLimits"]


@dataclass(frozen=True)
class SolverLimits:
    """Sizes past which the solver takes its cheaper path; every field a positive integer."""

    dp_work: int = 4 * 10**6
    """Pipeline objective: the largest N² (N nodes) for which the split DP may cut anywhere (one
    banded pass costs about N², whatever the number of stages S); above it the DP cuts at the
    block boundaries of the coarsening, then refines around the chosen cuts. ``1``: always coarsen."""
    cpsat_vars: int = 12_000
    """Pipeline objective: the largest CP-SAT model, in stage booleans (units × (S − 1)), worth
    building in Python; past it the DP's plan is the answer and infeasibility is reported from the
    memory floors rather than explained by CP-SAT."""
    blocks_per_stage: int = 64
    """Pipeline objective, coarsening target: a block costs at most 1/``blocks_per_stage`` of an
    ideal stage, so cutting only at block boundaries costs at most that much balance before
    refinement..."""
    max_blocks: int = 1536
    """... and there are at most this many blocks (24 per stage on 64 devices): past that, the block
    DP's passes cost more than the refinement that follows needs (measured in solver_scaling)."""
    makespan_units: int = 150
    """Makespan objective: the largest graph CP-SAT schedules unit by unit; a larger one is
    coarsened into about this many blocks along its module hierarchy (Inception's towers stay
    apart while each is below the block size)."""
    free_span: int = 64
    """Pipeline bound: off-chain nodes that may sit on either side of more than this many chain
    positions are left out of the chain bound's detour cuts (which only lowers the bound), so
    each position's min-cut network stays small."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConstraintError(advice(
                    f"solver limit {f.name}={value!r} is out of range",
                    f"{f.name} must be an integer ≥ 1",
                    f"pass SolverLimits({f.name}=<an integer ≥ 1>), or leave it at its default {f.default!r}",
                ))
