"""The memory floors and the proof that no plan fits (autosplit.solver.pipeline.memory), on planted and random problems."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autosplit.errors import InfeasiblePlanError
from autosplit.options import SolverLimits
from autosplit.solver.evaluation import evaluate
from autosplit.solver.pipeline.memory import fits_under, memory_chain_floor, memory_floor, memory_proof
from autosplit.solver.pipeline.strategy import prove_over_caps, solve
from autosplit.solver.validate import violations
from tests.helpers import make_problem

KEPT = ("runs backwards", "empty", "sharing parameters")
"""The rules every plan keeps that memory does not decide."""


def _least_fullest(problem) -> int | None:
    plans = itertools.product(range(problem.num_stages), repeat=len(problem.nodes))
    fullest = [max(evaluate(problem, so).memory) for so in plans
               if not any(k in v for v in violations(problem, so, memory=False) for k in KEPT)]  # the caps: not kept
    return min(fullest, default=None)


@st.composite
def layered_problems(draw):
    """A chain of layers, some with a weight read through a colocated node, others with a weight free
    before the chain (a source node whose reader is a layer), activations held per stage as 1F1B holds
    them (stage s: S − s micro-batches)."""
    S = draw(st.integers(2, 3))
    layers = draw(st.integers(2, 4))
    nodes, edges, colocate, state, act, recv = 0, [], [], [], [], []
    previous = None
    for _ in range(layers):
        kind = draw(st.sampled_from(["plain", "colocated", "free"]))
        layer = nodes
        nodes += 1
        state.append(draw(st.integers(0, 4)))
        per = draw(st.integers(0, 3))
        act.append([per * (S - s) for s in range(S)])
        recv.append(draw(st.integers(0, 4)))
        if previous is not None:
            edges.append((previous, layer))
        if kind != "plain":
            weight = nodes
            nodes += 1
            state.append(draw(st.integers(1, 8)))
            act.append([0] * S)
            recv.append(draw(st.integers(0, 6)))
            edges.append((weight, layer))
            if kind == "colocated":
                colocate.append((weight, layer))
        previous = layer
    order = sorted(range(nodes), key=lambda n: n)  # weights numbered after their layer: renumber topologically
    rank = {n: i for i, n in enumerate(sorted(order, key=lambda n: (min([v for u, v in edges if u == n] or [n]) - 0.5
                                                                          if n not in {v for _, v in edges} and n else n)))}
    relabel = lambda n: rank[n]  # noqa: E731
    inverse = sorted(range(nodes), key=relabel)
    return make_problem(
        [0] * nodes, sorted((relabel(u), relabel(v)) for u, v in edges), stages=S,
        state=[state[n] for n in inverse], act=[act[n] for n in inverse], recv=[recv[n] for n in inverse],
        colocate=[tuple(sorted(map(relabel, g))) for g in colocate], capacity=[10**6] * S, micro_batches=S,
    )


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(layered_problems())
def test_no_floor_exceeds_the_least_fullest_stage_and_the_least_fits(problem):
    least = _least_fullest(problem)
    if least is None:
        return
    assert max(memory_floor(problem), memory_chain_floor(problem), memory_proof(problem)) <= least
    assert fits_under(problem, least)  # the best plan fits under its own fullest stage


def test_a_weight_free_before_its_layer_counts_on_the_stage_that_receives_it():
    # Chain n0 → n2 → n3; n1, a weight of 8 KiB whose output takes 5 KiB to receive, is read by n2 and
    # follows nothing: n2's stage holds it, or receives it, so at least 5 of it.
    from autosplit.solver.pipeline.memory import along_chain

    problem = make_problem([1] * 4, [(0, 2), (1, 2), (2, 3)], stages=2, state=[9, 8, 1, 1], recv=[0, 5, 0, 0],
                           capacity=[100, 100])
    along = along_chain(problem)
    assert along.read[:, 0].tolist() == [0, 9, 15, 16]  # h_1 = n0 (9), h_2 = n2 (1 + 5), h_3 = n3 (1)
    assert along.chain[:, 0].tolist() == [0, 9, 10, 11]
    assert memory_chain_floor(problem) <= _least_fullest(problem) == 10


def test_stages_that_must_hold_everything_before_them_prove_what_one_stage_cannot():
    # Three layers (n1, n3, n5) in a chain on two stages, 1F1B: stage 0 holds two micro-batches'
    # activations. Weights n0, n2, n4 follow nothing: each may sit on any stage up to its layer's. No
    # one stage must hold more than 14 KiB, yet every plan holds 16 on one: whatever lies before the
    # last layer's stage must fit into the stages up to it, together.
    problem = make_problem(
        [1] * 6, [(0, 1), (1, 3), (2, 3), (3, 5), (4, 5)], stages=2, state=[3, 1, 6, 1, 7, 3],
        act=[[0, 0], [6, 3], [0, 0], [2, 1], [0, 0], [6, 3]], recv=[2, 0, 1, 0, 4, 0], capacity=[15, 15], micro_batches=2,
    )
    assert _least_fullest(problem) == 16
    assert max(memory_floor(problem), memory_chain_floor(problem)) == 14
    assert fits_under(problem, 16) and not fits_under(problem, 15)
    assert memory_proof(problem) == 16
    with pytest.raises(InfeasiblePlanError, match=r"any plan needs at least 16\.00 KiB on its fullest device, but the largest cap is "
                                                  r"15\.00 KiB \(proven over 2 devices: .*stages before each"):
        solve(problem, time_limit=1, limits=SolverLimits(cpsat_vars=1, dp_work=1))
    # On one stage the only split's memory is exact: over the cap by a KiB, proven so before any DP; at it, not.
    one = make_problem([1] * 6, [(0, 1), (1, 3), (2, 3), (3, 5), (4, 5)], stages=1, state=[3, 1, 6, 1, 7, 3],
                       act=[[0], [6], [0], [2], [0], [6]], recv=[0] * 6, capacity=[10**6], micro_batches=2)
    need = evaluate(one, [0] * 6).memory[0]
    prove_over_caps(dataclasses.replace(one, capacity=(need,)), cheap=True)
    with pytest.raises(InfeasiblePlanError, match=rf"its one stage needs {need}\.00 KiB.*holds {need - 1}\.00 KiB"):
        prove_over_caps(dataclasses.replace(one, capacity=(need - 1,)), cheap=True)
