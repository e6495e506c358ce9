"""The option records a :class:`~autosplit.options.PlanOptions` holds: the solver's size limits and
how to measure costs (both re-exported by :mod:`autosplit.options`).

Usage::

    PlanOptions(costs=ProfileOptions(threads=1, cores=(0,)), limits=SolverLimits(cpsat_vars=40_000))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autosplit.errors import ConstraintError, advice

__all__ = ["ProfileOptions", "SolverLimits"]


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


@dataclass(frozen=True)
class ProfileOptions:
    """How to measure. ``costs="measured"`` means ``ProfileOptions()``."""

    warmup: int = 2
    """Untimed runs per node first (caches, lazy initialisation, allocator warm-up)."""
    repeats: int = 5
    """Timed runs per node; the median is kept."""
    threads: int | None = None
    """Intra-op threads while profiling; ``None`` keeps ``torch.get_num_threads()``. Set it
    to what each stage will run with (one process per CPU core: 1)."""
    cores: tuple[int, ...] | None = None
    """CPU cores to pin the profiling thread(s) to (Linux); ``None`` leaves affinity alone."""
    beside: tuple[int, ...] = ()
    """CPU cores that run the same passes while the CPU profile is taken (Linux; one forked process
    per core, ``threads`` each): the other pipeline ranks of this host. Cores that share caches,
    memory bandwidth or a physical core run slower together than alone, and a pipeline's ranks
    compute together; ``()`` profiles on an otherwise idle host."""
    cache_dir: str | None = None
    """Where profiles are kept; ``None``: ``$AUTOSPLIT_CACHE`` or ``~/.cache/autosplit``."""
    use_cache: bool = True
