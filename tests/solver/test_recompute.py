"""Activation checkpointing as a decision of the solver: the split and the recomputed blocks chosen
together, optimal on planted problems (brute force over every assignment and every set of blocks)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autosplit.errors import InfeasiblePlanError, SolverError
from autosplit.solver import solve
from autosplit.solver.evaluation import evaluate
from autosplit.solver.problem import Recompute
from autosplit.solver.validate import violations
from tests.helpers import chain, make_problem


def brute_force(problem) -> int | None:
    """The best objective over every assignment, every set of blocks the problem allows, and every
    count of micro-batches each chosen block may keep on its stage (:attr:`Recompute.in_flight`)."""
    must, may = problem.forced
    free = [u for u in may if u not in must]
    best = None
    for k in range(len(free) + 1):
        for extra in itertools.combinations(free, k):
            chosen = (*must, *extra)
            for stage_of in itertools.product(range(problem.num_stages), repeat=len(problem.nodes)):
                if violations(problem, stage_of, memory=False):  # the rules no recomputation changes: most assignments break one
                    continue
                stage = {u: stage_of[problem.recompute[u].members[0]] for u in extra}
                keeps = [range(problem.recompute[u].in_flight[stage[u]] if problem.recompute[u].in_flight else 1) for u in extra]
                for counts in itertools.product(*keeps):
                    fixed = problem.fixed(chosen, {u: (stage[u], c) for u, c in zip(extra, counts) if c})
                    if not violations(fixed, stage_of):
                        obj = evaluate(fixed, stage_of).objective
                        best = obj if best is None else min(best, obj)
    return best


def _blocks(problem, spans, *, saves, compute, reserve, forced=None, in_flight=()):
    S = problem.num_stages
    return tuple(
        Recompute(f"layers.{i}", tuple(range(lo, hi)), (compute[i],) * S,
                  (min(saves[i], sum(problem.act_mem[n][0] for n in range(lo, hi))),) * S, reserve[i],
                  None if forced is None else forced[i], tuple(in_flight))
        for i, (lo, hi) in enumerate(spans)
    )


def test_recomputes_only_what_memory_forces():
    """Four equal layers on two stages: without recomputation nothing fits; the optimum recomputes
    just enough layers on each stage, and its objective is proven."""
    act = [0, 6, 6, 6, 6, 0]
    base = make_problem([1, 10, 10, 10, 10, 1], chain(6), stages=2, act=act, state=[1] * 6, capacity=[10, 10], micro_batches=4)
    problem = dataclasses.replace(base, recompute=_blocks(base, [(1, 2), (2, 3), (3, 4), (4, 5)], saves=[6] * 4,
                                                          compute=[4] * 4, reserve=[1] * 4))
    with pytest.raises(InfeasiblePlanError):
        solve(base, time_limit=5)
    found = solve(problem, time_limit=5)
    assert found.status == "OPTIMAL"
    assert found.objective == brute_force(problem)
    assert 0 < len(found.recompute) < 4  # some, not all: each stage keeps what fits
    fixed = problem.fixed(found.recompute)
    assert not violations(fixed, found.stage_of)
    assert found.objective < evaluate(problem.fixed(range(4)), found.stage_of).objective  # cheaper than recomputing all


def test_a_block_keeps_the_micro_batches_its_rank_can_hold():
    """GPipe holds all 4 micro-batches: a stage that cannot keep a layer's activations whole keeps
    those of as many micro-batches as fit and recomputes the rest — faster than the best plan that
    recomputes whole layers, within every cap, and no block the user asked to recompute keeps any."""
    base = make_problem([1, 10, 10, 10, 10, 1], chain(6), stages=2, act=[0, 8, 8, 8, 8, 0], state=[1] * 6, capacity=[10, 10],
                        micro_batches=4)
    blocks = tuple(Recompute(f"layers.{u}", (u + 1,), (4, 4), (8, 8), 1, None, (4, 4)) for u in range(4))
    found = solve(dataclasses.replace(base, recompute=blocks), time_limit=5)
    whole = dataclasses.replace(base, recompute=tuple(dataclasses.replace(b, in_flight=()) for b in blocks))
    assert found.partial and found.objective < brute_force(whole) == solve(whole, time_limit=5).objective
    partial = {u: (s, keep) for u, s, keep in found.partial}
    problem = dataclasses.replace(base, recompute=blocks)
    assert not violations(problem.fixed(found.recompute, partial), found.stage_of)
    assert evaluate(problem.fixed(found.recompute, partial), found.stage_of).objective == found.objective
    for u, (s, keep) in partial.items():
        assert s == found.stage_of[u + 1] and 0 < keep < 4
        assert violations(problem.fixed(found.recompute, {**partial, u: (s, keep + 1)}), found.stage_of), "one more would fit"
    assert found.status == "OPTIMAL" and found.objective == brute_force(problem)
    forced = solve(dataclasses.replace(base, recompute=tuple(dataclasses.replace(b, forced=True) for b in blocks)), time_limit=5)
    assert forced.recompute == (0, 1, 2, 3) and not forced.partial


def test_forced_choices_are_kept():
    base = make_problem([10, 10, 10], chain(3), stages=2, act=[3, 3, 3], capacity=[100, 100], micro_batches=2)
    blocks = _blocks(base, [(0, 1), (1, 2), (2, 3)], saves=[3] * 3, compute=[5] * 3, reserve=[0] * 3, forced=[True, None, False])
    found = solve(dataclasses.replace(base, recompute=blocks), time_limit=5)
    assert 0 in found.recompute and 2 not in found.recompute
    assert 1 not in found.recompute  # memory is plentiful: recomputing only costs time


@st.composite
def problems_with_blocks(draw):
    n = draw(st.integers(3, 6))
    S = draw(st.integers(2, 3))
    act = [draw(st.integers(0, 6)) for _ in range(n)]
    base = make_problem(
        [draw(st.integers(1, 12)) for _ in range(n)], chain(n), stages=S,
        transfer=[draw(st.integers(0, 4)) for _ in range(n)], state=[draw(st.integers(0, 4)) for _ in range(n)], act=act,
        capacity=[draw(st.integers(6, 30)) for _ in range(S)], micro_batches=draw(st.integers(1, 4)),
    )
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3)))
    spans = [span for span in itertools.pairwise([0, *cuts, n]) if draw(st.booleans())]
    M = base.micro_batches  # as GPipe (every micro-batch in flight) or 1F1B (S − s), or recomputed whole
    in_flight = draw(st.sampled_from([(), (M,) * S, tuple(min(M, S - s) for s in range(S))]))
    blocks = _blocks(base, spans, saves=[draw(st.integers(0, 12)) for _ in spans], compute=[draw(st.integers(0, 8)) for _ in spans],
                     reserve=[draw(st.integers(0, 3)) for _ in spans],
                     forced=[draw(st.sampled_from([None, None, True, False])) for _ in spans], in_flight=in_flight)
    return dataclasses.replace(base, recompute=blocks)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(problems_with_blocks())
def test_matches_brute_force(problem):
    """Split and blocks chosen together reach the brute-force optimum, or both find nothing."""
    best = brute_force(problem)
    if best is None:
        with pytest.raises((InfeasiblePlanError, SolverError)):
            solve(problem, time_limit=5)
        return
    found = solve(problem, time_limit=5)
    assert found.objective == best
    assert found.bound <= best
    must, may = problem.forced
    assert set(must) <= set(found.recompute) <= set(may)
    assert not violations(problem.fixed(found.recompute, {u: (s, k) for u, s, k in found.partial}), found.stage_of)
