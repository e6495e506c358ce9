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

from ortools.sat.python import cp_model

from autosplit.solver.makespan.schedule import Schedule, Task, comm, durations, task_graph
from autosplit.solver.pipeline.cpsat import cp_solver
from autosplit.solver.problem import Problem

__all__ = ["makespan_cpsat"]


def makespan_cpsat(
    problem: Problem, hint: Schedule | None, *, time_limit: float, seed: int = 0, workers: int | None = None,
) -> tuple[str, Schedule | None, float]:
    """(status name, the best schedule found or None, the proven lower bound on the makespan)."""
    N, D = len(problem.nodes), problem.num_stages
    fwd, bwd = durations(problem)
    c = comm(problem)
    prec = task_graph(problem)  # the loss edges included
    horizon = hint.makespan if hint is not None else (
        sum(max(f) + max(b) for f, b in zip(fwd, bwd)) + 2 * sum(c)
    )
    m = cp_model.CpModel()
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

    apart: dict[tuple[int, int], cp_model.IntVar] = {}
    for u, v in problem.edges:
        if (u, v) not in apart:
            delta = apart[u, v] = m.new_bool_var(f"d{u}_{v}")
            for d in range(D):
                m.add(delta >= x[u][d] - x[v][d])
    for a, b, w in prec:
        if w >= 0 and c[w] > 0:
            u, v = (a // 2, b // 2) if a % 2 == 0 else (b // 2, a // 2)
            m.add(start[b] >= end[a] + c[w] * apart[u, v])
        else:
            m.add(start[b] >= end[a])

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
    for members in [*problem.colocate, *(k.together for k in problem.constraints)]:
        for n in members[1:]:
            for d in range(D):
                m.add(x[n][d] == x[members[0]][d])
    for k in problem.constraints:
        for n, d in k.forbid:
            m.add(x[n][d] == 0)

    makespan = m.new_int_var(0, horizon, "C")
    for t in range(2 * N):
        m.add(makespan >= end[t])
    m.minimize(makespan)

    if hint is not None:
        for u, d in enumerate(hint.device_of):
            for dd in range(D):
                m.add_hint(x[u][dd], int(dd == d))
        for task in hint.tasks:
            t = 2 * task.unit + (task.kind == "backward")
            m.add_hint(start[t], task.start)
            m.add_hint(end[t], task.end)
        m.add_hint(makespan, hint.makespan)

    solver = cp_solver(max(time_limit, 0.01), seed, workers)  # deterministic: every rank plans the same
    status = solver.solve(m)
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return name, None, solver.best_objective_bound if status != cp_model.INFEASIBLE else math.inf
    device_of = tuple(next(d for d in range(D) if solver.value(x[u][d])) for u in range(N))
    tasks = tuple(
        Task(t // 2, "backward" if t % 2 else "forward", device_of[t // 2], solver.value(start[t]), solver.value(end[t]))
        for t in range(2 * N)
    )
    return name, Schedule(device_of, tasks), solver.best_objective_bound

