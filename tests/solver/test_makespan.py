"""The makespan objective's solver (DLPlacer): planted optima, schedules that keep every rule,
bounds, and large graphs coarsened."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autosplit.errors import InfeasiblePlanError
from autosplit.options import SolverLimits
from autosplit.solver.makespan import makespan_bound, solve_makespan
from autosplit.solver.makespan.schedule import comm, durations, list_schedule, memory_of, pinned_search, run_key, task_graph
from autosplit.solver.problem import UserConstraint
from tests.helpers import chain, make_problem


def check(problem, schedule):
    """Every rule of the task model holds: durations, devices, precedence with transfers, one task at a time."""
    fwd, bwd = durations(problem)
    c = comm(problem)
    dev = schedule.device_of
    task = {(t.unit, t.kind): t for t in schedule.tasks}
    assert len(task) == 2 * len(problem.nodes)
    for (u, kind), t in task.items():
        assert t.device == dev[u] and t.end - t.start == (fwd if kind == "forward" else bwd)[u][dev[u]]
    prec = task_graph(problem)
    for a, b, w in prec:
        first, then = task[a // 2, "backward" if a % 2 else "forward"], task[b // 2, "backward" if b % 2 else "forward"]
        apart = w >= 0 and dev[a // 2] != dev[b // 2]
        assert then.start >= first.end + (c[w] if apart else 0), (first, then)
        # Devices running their tasks in run_key order never wait on a task that comes later.
        assert run_key(first.start, first.end, first.kind, first.unit) < run_key(then.start, then.end, then.kind, then.unit)
    for d in range(problem.num_stages):
        on = schedule.order(d)
        assert all(x.end <= y.start for x, y in itertools.pairwise(on)), f"device {d} runs two tasks at once"
    assert all(m <= cap for m, cap in zip(memory_of(problem, dev), problem.capacity))


def towers(transfer=0, **kw):
    """src → two towers of three nodes → join; forward and backward 10 ns per tower node."""
    compute = [2, 20, 20, 20, 20, 20, 20, 2]
    edges = [(0, 1), (1, 2), (2, 3), (3, 7), (0, 4), (4, 5), (5, 6), (6, 7)]
    return make_problem(compute, edges, stages=2, transfer=[transfer] * 8, **kw)


def test_two_equal_towers_on_two_devices_halve_the_branch_time():
    problem = towers()
    sol = solve_makespan(problem, time_limit=5)
    check(problem, sol.schedule)
    # Forward 1 + 30 (towers side by side) + 1, then backward the same: 64 against 124 on one device.
    assert sol.objective == 64 and sol.bound == 64 and sol.status == "OPTIMAL"
    assert {sol.schedule.device_of[u] for u in (1, 2, 3)} != {sol.schedule.device_of[u] for u in (4, 5, 6)}


def test_transfers_delay_the_consumer_and_the_solver_weighs_them():
    problem = towers(transfer=4)  # 2 ns each way
    sol = solve_makespan(problem, time_limit=5)
    check(problem, sol.schedule)
    # By hand: tower B on the other device pays 2 ns four times (out, in, and back): 72 < 124.
    assert sol.bound <= sol.objective <= 72
    expensive = towers(transfer=200)  # a transfer costs more than a tower: one device is best
    sol = solve_makespan(expensive, time_limit=5)
    check(expensive, sol.schedule)
    assert sol.objective == 124 and len(set(sol.schedule.device_of)) == 1


def test_a_chain_gains_nothing():
    problem = make_problem([2, 4, 6, 8, 10, 12], chain(6), stages=3)
    sol = solve_makespan(problem, time_limit=5)
    check(problem, sol.schedule)
    assert sol.objective == sum([2, 4, 6, 8, 10, 12]) == sol.bound and sol.status == "OPTIMAL"


def test_a_stack_of_recurrences_runs_as_a_wavefront():
    """Two LSTM layers called once per time piece, each layer's calls one colocated group, the
    upper one heavier: HEFT puts it beside the lower one for want of one transfer; the pinned
    search moves it to the other device, where the layers overlap piece by piece."""
    n = 6
    a, b = list(range(n)), list(range(n, 2 * n))
    edges = [*((a[t], a[t + 1]) for t in range(n - 1)), *((b[t], b[t + 1]) for t in range(n - 1)), *zip(a, b)]
    problem = make_problem([20] * n + [30] * n, edges, stages=2, transfer=[2] * 2 * n, colocate=[tuple(a), tuple(b)])
    heft = list_schedule(problem)
    assert len(set(heft.device_of)) == 1 and heft.makespan == 300
    # By hand, the critical path: a0, 1 ns of transfer, b0 … b5 (10 + 1 + 6 × 15), and the
    # backward the same way back: 2 × 101.
    pinned = pinned_search(problem, heft, deadline=math.inf)
    check(problem, pinned)
    assert pinned.makespan == 202 and pinned.device_of[a[0]] != pinned.device_of[b[0]]
    sol = solve_makespan(problem, time_limit=5)
    check(problem, sol.schedule)
    assert sol.objective == 202 and sol.baseline == 300


def test_memory_and_constraints_are_kept():
    # Each tower's state fills most of a device: they must sit apart, whatever the time.
    problem = towers(state=[0, 30, 30, 30, 30, 30, 30, 0], capacity=[100, 100], transfer=200)
    sol = solve_makespan(problem, time_limit=5)
    check(problem, sol.schedule)
    assert len(set(sol.schedule.device_of)) == 2
    pinned = dataclasses.replace(towers(), constraints=(
        UserConstraint("keep 1 and 4 together", together=(1, 4)), UserConstraint("avoid 0 on 1", forbid=((0, 1),)),
    ))
    sol = solve_makespan(pinned, time_limit=5)
    check(pinned, sol.schedule)
    dev = sol.schedule.device_of
    assert dev[1] == dev[4] and dev[0] == 0
    with pytest.raises(InfeasiblePlanError, match="no placement of 8 nodes on 2 devices fits"):
        solve_makespan(towers(state=[0, 90, 90, 90, 90, 90, 90, 0], capacity=[100, 100]), time_limit=2)


@st.composite
def dags(draw):
    n = draw(st.integers(2, 9))
    edges = sorted({(u, v) for v in range(1, n) for u in draw(st.sets(st.integers(0, v - 1), min_size=1, max_size=2))})
    compute = [draw(st.integers(0, 30)) for _ in range(n)]
    transfer = [draw(st.integers(0, 12)) for _ in range(n)]
    return make_problem(compute, edges, stages=draw(st.integers(1, 3)), transfer=transfer)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_schedules_keep_every_rule_and_cp_sat_improves_on_heft(problem):
    heft = list_schedule(problem)
    check(problem, heft)
    sol = solve_makespan(problem, time_limit=2, workers=1)
    check(problem, sol.schedule)
    assert makespan_bound(problem) <= sol.bound <= sol.objective <= heft.makespan == sol.baseline


def test_large_graphs_are_coarsened_and_timed_on_their_nodes():
    problem = make_problem([5] * 20, [*chain(10), *((10 + i, 11 + i) for i in range(9)), (0, 10), (9, 19)], stages=2)
    sol = solve_makespan(problem, time_limit=5, limits=SolverLimits(makespan_units=6))
    check(problem, sol.schedule)
    assert sol.units < 20 and sol.objective < 200  # the two chains overlap
