"""The makespan CP-SAT model (DESIGN §4.3; Pal et al.'s DLPlacer), over units and devices.

Variables, for unit u (a node or a block), device d and task t ∈ {F_u, B_u}:

- ``x[u, d] ∈ {0, 1}``: u runs on d; ``Σ_d x[u, d] = 1`` (``AddExactlyOne``);
- ``s_t, e_t ∈ [0, H]``: start and end; for each d an optional interval
  ``[s_t, e_t)`` of length ``dur_t[d]`` present iff ``x[u, d]`` — F and B of u share the
  presence literal, so the backward runs on its forward's device;
- ``δ_uv ≥ x[u, d] − x[v, d]`` for every d and data edge u → v: u and v on different devices;
- ``L``: the loss, after every output's forward; ``C``: the makespan.

Constraints:

    AddNoOverlap({interval(t, d) : t}) for every device d        (one task at a time)
    s_{F_v} ≥ e_{F_u} + c_u·δ_uv,  s_{B_u} ≥ e_{B_v} + c_u·δ_uv  for every data edge u → v
    s_{F_v} ≥ e_{F_u}                                            for every order edge
    s_{B_u} ≥ e_{F_u};  L ≥ e_{F_w},  s_{B_w} ≥ L                 for outputs w
    Σ_u x[u, d]·(state_u + act_u[d]) + Σ_u r[u, d]·recv_u[d] + reserve ≤ cap_d,
        r[u, d] ≥ x[v, d] − x[u, d] for every consumer v of u   (d receives u's output)
    x[u, d] = x[v, d] for units kept together; x[u, d] = 0 for forbidden pairs
    C ≥ e_{B_u} for every u;  minimise C

``c_u`` is u's one-way transfer (:func:`~.schedule.comm`); ``H`` the horizon, the warm
start's makespan when there is one (no optimal schedule is longer), else every task on its
slowest device plus every transfer. The warm start's assignment and times are the hint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

from autosplit.solver.makespan.schedule import Schedule, Task, comm, durations, task_graph
from autosplit.solver.pipeline.cpsat import cp_solver
from autosplit.solver.problem import Problem

__all__ = ["makespan_cpsat"]


@dataclass(frozen=True)
class _Vars:
    """The model's placement and timing variables."""

    x: list[list[cp_model.IntVar]]
    """[u][d]: unit u runs on device d."""
    start: list[cp_model.IntVar]
    """[t] start of task t (2u: F_u, 2u + 1: B_u)."""
    end: list[cp_model.IntVar]
    """[t] end of task t."""


def _horizon(hint: Schedule | None, fwd: list[list[int]], bwd: list[list[int]], c: list[int]) -> int:
    """No optimal schedule is longer: the warm start's makespan, else every task on its slowest
    device plus every transfer."""
    if hint is not None:
        return hint.makespan
    return sum(max(f) + max(b) for f, b in zip(fwd, bwd)) + 2 * sum(c)


def _add_tasks(m: cp_model.CpModel, problem: Problem, fwd: list[list[int]], bwd: list[list[int]], horizon: int) -> _Vars:
    """Each unit on exactly one device, its forward and backward an optional interval per device
    (sharing the unit's presence literal), and one task at a time on every device."""
    N, D = len(problem.nodes), problem.num_stages
    x = [[m.new_bool_var(f"x{u}_{d}") for d in range(D)] for u in range(N)]
    start = [m.new_int_var(0, horizon, f"s{t}") for t in range(2 * N)]
    end = [m.new_int_var(0, horizon, f"e{t}") for t in range(2 * N)]
    per_device: list[list] = [[] for _ in range(D)]
    for u in range(N):
        m.add_exactly_one(x[u])
        for t, dur in ((2 * u, fwd[u]), (2 * u + 1, bwd[u])):
            for d in range(D):
                per_device[d].append(m.new_optional_interval_var(start[t], dur[d], end[t], x[u][d], f"i{t}_{d}"))
    for d in range(D):
        m.add_no_overlap(per_device[d])
    return _Vars(x, start, end)


def _add_precedence(m: cp_model.CpModel, problem: Problem, var: _Vars, c: list[int]) -> None:
    """Every task after its predecessors (the loss edges included), plus the unit's one-way
    transfer across a data edge whose ends sit on different devices (δ_uv)."""
    D = problem.num_stages
    apart: dict[tuple[int, int], cp_model.IntVar] = {}
    for u, v in problem.edges:
        if (u, v) not in apart:
            delta = apart[u, v] = m.new_bool_var(f"d{u}_{v}")
            for d in range(D):
                m.add(delta >= var.x[u][d] - var.x[v][d])
    for a, b, w in task_graph(problem):
        if w >= 0 and c[w] > 0:
            u, v = (a // 2, b // 2) if a % 2 == 0 else (b // 2, a // 2)
            m.add(var.start[b] >= var.end[a] + c[w] * apart[u, v])
        else:
            m.add(var.start[b] >= var.end[a])


def _add_memory(m: cp_model.CpModel, problem: Problem, x: list[list[cp_model.IntVar]]) -> None:
    """Every device's state, activations, received outputs (r[u, d]: d holds u's output for a
    consumer) and reserve within its capacity."""
    N, D = len(problem.nodes), problem.num_stages
    receives: dict[tuple[int, int], cp_model.IntVar] = {}
    for u, v in problem.edges:
        for d in range(D):
            if (u, d) not in receives:
                receives[u, d] = m.new_bool_var(f"r{u}_{d}")
            m.add(receives[u, d] >= x[v][d] - x[u][d])
    for d in range(D):
        m.add(
            sum((problem.state_mem[u] + problem.act_mem[u][d]) * x[u][d] for u in range(N))
            + sum(problem.recv_mem[u][d] * r for (u, dd), r in receives.items() if dd == d)
            + problem.transient_mem
            <= problem.capacity[d]
        )


def _add_placement(m: cp_model.CpModel, problem: Problem, x: list[list[cp_model.IntVar]]) -> None:
    """Units kept together share a device; the user's forbidden (unit, device) pairs are left out."""
    D = problem.num_stages
    for members in [*problem.colocate, *(k.together for k in problem.constraints)]:
        for n in members[1:]:
            for d in range(D):
                m.add(x[n][d] == x[members[0]][d])
    for k in problem.constraints:
        for n, d in k.forbid:
            m.add(x[n][d] == 0)


def _add_hint(m: cp_model.CpModel, problem: Problem, hint: Schedule, var: _Vars, makespan: cp_model.IntVar) -> None:
    """The warm start's assignment, task times and makespan as the solver's hint."""
    for u, d in enumerate(hint.device_of):
        for dd in range(problem.num_stages):
            m.add_hint(var.x[u][dd], int(dd == d))
    for task in hint.tasks:
        t = 2 * task.unit + (task.kind == "backward")
        m.add_hint(var.start[t], task.start)
        m.add_hint(var.end[t], task.end)
    m.add_hint(makespan, hint.makespan)


def _read_schedule(solver: cp_model.CpSolver, problem: Problem, var: _Vars) -> Schedule:
    """The schedule of the solver's best solution: each unit's device and each task's times."""
    N, D = len(problem.nodes), problem.num_stages
    device_of = tuple(next(d for d in range(D) if solver.value(var.x[u][d])) for u in range(N))
    tasks = tuple(
        Task(t // 2, "backward" if t % 2 else "forward", device_of[t // 2], solver.value(var.start[t]), solver.value(var.end[t]))
        for t in range(2 * N)
    )
    return Schedule(device_of, tasks)


def makespan_cpsat(
    problem: Problem, hint: Schedule | None, *, time_limit: float, seed: int = 0, workers: int | None = None,
) -> tuple[str, Schedule | None, float]:
    """(status name, the best schedule found or None, the proven lower bound on the makespan)."""
    fwd, bwd = durations(problem)
    c = comm(problem)
    horizon = _horizon(hint, fwd, bwd, c)
    from ortools.sat.python import cp_model  # deferred: OR-Tools (and the pandas it imports) load when a search first runs

    m = cp_model.CpModel()
    var = _add_tasks(m, problem, fwd, bwd, horizon)
    _add_precedence(m, problem, var, c)
    _add_memory(m, problem, var.x)
    _add_placement(m, problem, var.x)
    makespan = m.new_int_var(0, horizon, "C")
    for end in var.end:
        m.add(makespan >= end)
    m.minimize(makespan)
    if hint is not None:
        _add_hint(m, problem, hint, var, makespan)

    solver = cp_solver(max(time_limit, 0.01), seed, workers)  # deterministic: every rank plans the same
    name = solver.status_name(solver.solve(m))
    if name not in ("OPTIMAL", "FEASIBLE"):
        return name, None, solver.best_objective_bound if name != "INFEASIBLE" else math.inf
    return name, _read_schedule(solver, problem, var), solver.best_objective_bound
