"""Recomputation on many identical layers: the split at layer boundaries that costs each stage's
recomputation (autosplit.solver.pipeline.layers), the time bound that knows what the caps force every
plan to recompute (autosplit.solver.pipeline.recompute_bound), and the solver's time limit."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autosplit.errors import SolverError
from autosplit.options import SolverLimits
from autosplit.solver import solve
from autosplit.solver.evaluation import evaluate
from autosplit.solver.pipeline import strategy
from autosplit.solver.pipeline.dp import topological_order
from autosplit.solver.pipeline.layers import layer_split
from autosplit.solver.pipeline.recompute_bound import recompute_bound, saving_rates
from autosplit.solver.problem import Recompute, UserConstraint
from tests.helpers import chain, make_problem
from tests.solver.test_recompute import brute_force, problems_with_blocks


def _layers(n: int, stages: int, *, capacity: int, state: int = 1, act: int = 2, compute: int = 10, again: int = 4):
    """n identical one-node layers between an input and an output node, 1F1B: stage s holds S − s
    micro-batches (activations ``act`` each), M = S."""
    N, M = n + 2, stages
    held = [act * (stages - s) for s in range(stages)]
    base = make_problem([1, *[compute] * n, 1], chain(N), stages=stages, state=[0, *[state] * n, 0],
                        act=[[0] * stages, *[held] * n, [0] * stages], capacity=[capacity] * stages, micro_batches=M)
    blocks = tuple(Recompute(f"layers.{u}", (u + 1,), (again,) * stages, tuple(held), 0, None,
                             tuple(min(M, stages - s) for s in range(stages))) for u in range(n))
    return dataclasses.replace(base, recompute=blocks)


def test_fewer_layers_where_more_micro_batches_are_in_flight():
    # Four layers on two stages: two each would recompute on stage 0 (2 micro-batches in flight);
    # the split at layer boundaries that costs recomputation finds the best there is.
    problem = _layers(4, 2, capacity=6)
    plan = layer_split(problem, topological_order(problem))
    assert plan is not None
    found = solve(problem, time_limit=5)
    assert found.objective == brute_force(problem)
    choice = strategy._keep_what_fits(problem, plan, problem.forced[1])
    assert evaluate(problem.fixed(*choice), plan).objective == found.objective
    assert found.bound <= found.objective


def test_layers_that_differ_are_left_to_the_other_searches():
    problem = _layers(4, 2, capacity=20)
    blocks = (dataclasses.replace(problem.recompute[0], compute=(9, 9)), *problem.recompute[1:])
    assert layer_split(dataclasses.replace(problem, recompute=blocks), topological_order(problem)) is None


@st.composite
def with_buffers(draw):
    """:func:`problems_with_blocks` whose tensors also take memory to receive and to send on."""
    problem = draw(problems_with_blocks())
    N, S = len(problem.nodes), problem.num_stages
    recv = tuple((draw(st.integers(0, 3)),) * S for _ in range(N))
    send = tuple((draw(st.integers(0, 2)),) * S for _ in range(N))
    return dataclasses.replace(problem, recv_mem=recv, send_mem=send)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(with_buffers())
def test_the_recompute_bound_never_exceeds_the_optimum(problem):
    best = brute_force(problem)
    if best is None or problem.num_stages == 1:
        return
    fewest = problem.fixed(problem.forced[0])
    found = solve(problem, time_limit=5)
    known = max(evaluate(problem.fixed(found.recompute, {u: (s, k) for u, s, k in found.partial}), found.stage_of).time)
    assert recompute_bound(problem, fewest, upper=known) <= best


def test_saving_rates_take_the_cheapest_way_to_save():
    problem = _layers(2, 2, capacity=100)
    rates = saving_rates(problem)
    # Stage 0 holds 2 micro-batches: recomputing one of them saves half the memory for half the time
    # of 2 (M = 2): 2 / 2 = 1 ns per KiB, as recomputing it whole (4 / 4).
    assert rates == [1.0, 4 / 2]


def test_the_time_limit_counts_the_search_before_the_fallback(monkeypatch):
    # A split that no contiguous plan keeps (a user constraint), too large for CP-SAT to explain:
    # the dynamic programs take (on this fake clock) 25 s of time_limit=20; the message says so,
    # not "within 1.0s" (what it said when the fallback got a second of its own).
    base = _layers(4, 2, capacity=100)
    problem = dataclasses.replace(base, constraints=(UserConstraint("avoid 0 on stage 0", forbid=((0, 0),)),))
    clock = [0.0]
    real = strategy.dp_plan

    def slow(*args, **kwargs):
        clock[0] += 12.5
        return real(*args, **kwargs)

    monkeypatch.setattr(strategy, "dp_plan", slow)
    monkeypatch.setattr(strategy.time, "perf_counter", lambda: clock[0])
    with pytest.raises(SolverError) as e:
        solve(problem, time_limit=20, limits=SolverLimits(cpsat_vars=1))
    assert "1.0s" not in str(e.value) and "time_limit=20s" in str(e.value)
