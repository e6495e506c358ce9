"""The makespan objective (DESIGN §4.3; Pal et al.'s DLPlacer): place units on devices with
start times so that parallel branches run at the same time; minimise one step's makespan.

- :mod:`.schedule` — tasks, timing an assignment, the list scheduler (HEFT) and a local
  search that pins heavy groups to other devices around it;
- :mod:`.cpsat` — the CP-SAT model (its mathematics in the module docstring);
- :func:`solve_makespan` — how they combine: HEFT, its pinned search (a quarter of the time
  limit), coarsening of a large graph
  (:attr:`~autosplit.options.SolverLimits.makespan_units`), CP-SAT with the better of
  the two as hint, the best schedule timed on the nodes, and a bound.

Usage::

    solution = solve_makespan(build_problem(table, micro_batches=1, schedule="sequential"), time_limit=10)
    solution.schedule.order(0)        # device 0's tasks, in order, with start and end (ns)
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from autosplit.errors import InfeasiblePlanError, advice
from autosplit.options import SolverLimits
from autosplit.solver.coarsen import coarse_problem, coarsen
from autosplit.solver.makespan.cpsat import makespan_cpsat
from autosplit.solver.makespan.schedule import Schedule, Task, durations, list_schedule, memory_of, pinned_search, schedule_of
from autosplit.solver.pipeline.dp import topological_order
from autosplit.solver.problem import KIB, Problem
from autosplit.units import format_bytes

__all__ = ["MakespanSolution", "Schedule", "Task", "list_schedule", "makespan_bound", "schedule_of", "solve_makespan"]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class MakespanSolution:
    schedule: Schedule
    """Every node's device, every task timed (ns)."""
    status: str
    """``OPTIMAL`` (meets the bound) or ``FEASIBLE``."""
    objective: int
    """The makespan, ns."""
    bound: int
    wall_time: float
    solver: str
    """``"cp-sat"``, ``"heft"`` or ``"heft, pinned"`` (HEFT around the groups :func:`pinned_search`
    pinned): which produced the schedule."""
    baseline: int | None
    """HEFT's makespan on the nodes (None when it found no schedule within the caps)."""
    units: int

    @property
    def gap(self) -> float:
        return 0.0 if self.objective <= 0 else max(0.0, (self.objective - self.bound) / self.objective)


def makespan_bound(problem: Problem) -> int:
    """No schedule is shorter than its critical path — the longest chain of forwards to the
    loss, then the longest chain of backwards from an output to an input, every task on its
    fastest device, no transfers — or than the total work (each unit at its cheapest) shared
    by every device."""
    fwd, bwd = durations(problem)
    N, D = len(problem.nodes), problem.num_stages
    f, b = [min(row) for row in fwd], [min(row) for row in bwd]
    consumers: list[list[int]] = [[] for _ in range(N)]
    producers: list[list[int]] = [[] for _ in range(N)]
    for u, v in problem.edges:
        consumers[u].append(v)
        producers[v].append(u)
    for u, v in problem.order_edges:
        consumers[u].append(v)
    order = topological_order(problem)
    forward = [0] * N  # longest chain of forwards ending with u's
    for u in order:
        forward[u] += f[u]
        for v in consumers[u]:
            forward[v] = max(forward[v], forward[u])
    backward = [0] * N  # longest chain of backwards ending with u's (consumers' run first)
    for v in reversed(order):
        backward[v] += b[v]
        for u in producers[v]:
            backward[u] = max(backward[u], backward[v])
    path = max(forward, default=0) + max(backward, default=0)
    return max(path, math.ceil(sum(problem.fastest) / D))


def solve_makespan(
    problem: Problem, *, time_limit: float = 10.0, seed: int = 0, workers: int | None = None, limits: SolverLimits = SolverLimits()
) -> MakespanSolution:
    """The shortest step found within ``time_limit`` seconds, with its bound; a graph of more than
    ``limits.makespan_units`` nodes is scheduled as about that many blocks (:class:`SolverLimits`)."""
    t0 = time.perf_counter()
    N = len(problem.nodes)
    heft = list_schedule(problem)
    candidates: dict[str, Schedule] = {"heft": heft} if heft else {}
    if heft is not None:
        candidates["heft, pinned"] = pinned_search(problem, heft, deadline=t0 + time_limit / 4)
    target, c = problem, None
    if N > limits.makespan_units:
        total = sum(sum(row) / len(row) for row in problem.compute)
        c = coarsen(problem, topological_order(problem), max_cost=total / limits.makespan_units)
        target = coarse_problem(problem, c)
        log.info("makespan: coarsened %d nodes into %d blocks", N, c.num_blocks)
    hint = min(candidates.values(), key=lambda s: s.makespan, default=None) if c is None else list_schedule(target)
    remaining = max(0.0, time_limit - (time.perf_counter() - t0))
    name, found, cp_bound = makespan_cpsat(target, hint, time_limit=remaining, seed=seed, workers=workers)
    if found is not None:
        candidates["cp-sat"] = found if c is None else schedule_of(problem, c.to_nodes(found.device_of))
    bound = makespan_bound(problem)
    if c is None and math.isfinite(cp_bound):
        bound = max(bound, math.ceil(cp_bound))
    valid = {k: s for k, s in candidates.items() if _fits(problem, s)}
    if not valid:
        need = max(math.ceil(sum(problem.state_mem) / problem.num_stages), max(problem.state_mem))
        raise InfeasiblePlanError(advice(
            f"no placement of {N} nodes on {problem.num_stages} devices fits the memory caps (CP-SAT: {name}); the model "
            f"state alone needs at least {format_bytes(need * KIB)} per device against the largest cap "
            f"{format_bytes(max(problem.capacity) * KIB)}",
            "the makespan objective keeps every activation of the step until its backward (one micro-batch)",
            "more devices or memory, a smaller batch, or objective='pipeline' with more micro-batches",
        ))
    solver, schedule = min(valid.items(), key=lambda kv: (kv[1].makespan, kv[0] != "heft"))
    objective = schedule.makespan
    bound = min(bound, objective)
    return MakespanSolution(
        schedule, "OPTIMAL" if bound == objective else "FEASIBLE", objective, bound, time.perf_counter() - t0, solver,
        heft.makespan if heft else None, N if c is None else c.num_blocks,
    )


def _fits(problem: Problem, schedule: Schedule) -> bool:
    forbidden = {(n, d) for k in problem.constraints for n, d in k.forbid}
    together = [*problem.colocate, *(k.together for k in problem.constraints)]
    d = schedule.device_of
    return (
        all(m <= cap for m, cap in zip(memory_of(problem, d), problem.capacity))
        and not any((n, d[n]) in forbidden for n in range(len(d)))
        and all(len({d[n] for n in group}) <= 1 for group in together)
    )
