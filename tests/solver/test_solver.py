"""The solver on plain Problems with known optima; validation without a solver; the arrays a Problem
built from a cost table caches."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autosplit.devices import resolve_devices
from autosplit.errors import InfeasiblePlanError, PlanValidationError
from autosplit.options import SolverLimits
from autosplit.passes.capture import capture, flat_inputs
from autosplit.solver import validate
from autosplit.solver.evaluation import evaluate
from autosplit.solver.pipeline.dp import split_dp, topological_order
from autosplit.solver.pipeline.strategy import solve
from autosplit.solver.validate import violations
from tests.helpers import brute_force, chain, make_problem, random_problems, valid


def test_planted_chain_split_is_found_and_proven():
    # 3 stages of exactly 10: [4, 6] [5, 5] [7, 3]; any other contiguous split has a stage > 10.
    problem = make_problem([4, 6, 5, 5, 7, 3], chain(6), stages=3, micro_batches=8)
    sol = solve(problem, time_limit=5)
    assert sol.stage_of == (0, 0, 1, 1, 2, 2)
    assert sol.status == "OPTIMAL" and sol.objective == sol.bound == 30 + 7 * 10
    validate(problem, sol.stage_of)


def test_transfers_move_the_cut_to_the_small_tensor():
    # Equal compute; cutting after node 1 sends 100, after node 2 sends 1 (both balanced enough).
    problem = make_problem([5, 5, 5, 5], chain(4), stages=2, transfer=[100, 100, 1, 100], micro_batches=1)
    sol = solve(problem, time_limit=5)
    assert sol.stage_of == (0, 0, 0, 1)
    assert sol.objective == brute_force(problem)


def test_memory_cap_pushes_nodes_off_a_device():
    # Balanced would be 2 + 2, but device 0 holds only one node's state.
    problem = make_problem([1, 1, 1, 1], chain(4), stages=2, state=[10] * 4, capacity=[15, 100], micro_batches=4)
    sol = solve(problem, time_limit=5)
    assert sol.stage_of == (0, 1, 1, 1)
    assert evaluate(problem, sol.stage_of).memory == (10, 30)


def test_faster_device_takes_more_work():
    # Device 1 runs every node twice as fast: the best split gives it 4 of 6 nodes.
    compute = [(4, 2)] * 6
    problem = make_problem(compute, chain(6), stages=2, micro_batches=16)
    sol = solve(problem, time_limit=5)
    assert sol.stage_of.count(1) == 4
    assert sol.objective == brute_force(problem)


def test_colocated_nodes_share_a_stage():
    # Nodes 0 and 3 share a parameter (tied weights): they must sit together.
    problem = make_problem([1, 5, 5, 1, 5], chain(5), stages=2, colocate=[(0, 3)], micro_batches=4)
    sol = solve(problem, time_limit=5)
    assert sol.stage_of[0] == sol.stage_of[3] == 0
    assert sol.objective == brute_force(problem)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems())
def test_solver_matches_brute_force_on_random_dags(problem):
    best = brute_force(problem)
    if best is None:
        with pytest.raises(InfeasiblePlanError):
            solve(problem, time_limit=5)
        return
    sol = solve(problem, time_limit=5)
    assert not violations(problem, sol.stage_of)
    assert sol.status == "OPTIMAL"
    assert sol.objective == best
    assert sol.bound <= best


def test_infeasible_memory_names_device_cap_and_least_need():
    problem = make_problem([1, 1, 1, 1], chain(4), stages=2, state=[1000] * 4, capacity=[1500, 1500])
    with pytest.raises(InfeasiblePlanError) as err:
        solve(problem, time_limit=5)
    message = str(err.value)
    assert "dev0" in message or "dev1" in message
    assert "1.46 MiB" in message  # the cap, 1500 KiB
    assert "1.95 MiB" in message  # least any plan needs on its fullest device: 2 × 1000 KiB
    assert "Try:" in message


def test_a_node_larger_than_every_device_is_named():
    problem = make_problem([1, 1, 1], chain(3), stages=2, state=[10, 500, 10], capacity=[100, 100])
    with pytest.raises(InfeasiblePlanError, match="node 'n1' \\(module 'mod1'\\) alone needs"):
        solve(problem, time_limit=5)


def test_more_devices_than_nodes_is_a_clear_error():
    with pytest.raises(InfeasiblePlanError, match="3 devices but only 2 graph nodes"):
        solve(make_problem([1, 1], chain(2), stages=3))


def test_same_problem_same_plan():
    problem = make_problem([3, 1, 4, 1, 5, 9, 2, 6], chain(8), stages=3, micro_batches=4)
    assert solve(problem, seed=7).stage_of == solve(problem, seed=7).stage_of


@pytest.mark.parametrize(
    "stage_of, rule",
    [
        ((0, 1, 0, 1), "runs backwards"),
        ((0, 0, 0), "places 3 nodes"),
        ((0, 0, 0, 0), "stages [1] are empty"),
        ((0, 0, 1, 5), "outside 0..1"),
        ((1, 1, 1, 1), "stages [0] are empty"),
    ],
)
def test_validate_rejects_broken_plans(stage_of, rule):
    problem = make_problem([1, 1, 1, 1], chain(4), stages=2)
    with pytest.raises(PlanValidationError, match=rule.replace("[", "\\[").replace("]", "\\]")):
        validate(problem, stage_of)


def test_validate_checks_memory_and_colocation_without_a_solver():
    problem = make_problem([1, 1, 1, 1], chain(4), stages=2, state=[10, 10, 10, 10], capacity=[15, 100], colocate=[(1, 2)])
    found = violations(problem, (0, 0, 1, 1))
    assert any("over its cap" in v for v in found)
    assert any("sit on stages [0, 1]" in v for v in found)
    assert violations(problem, (0, 1, 1, 1)) == []


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems())
def test_lower_bounds_never_exceed_the_optimum(problem):
    from autosplit.solver.pipeline.bounds import chain_bound, lower_bound

    best = brute_force(problem)
    if best is None:
        return
    assert lower_bound(problem) <= best
    slowest = min(
        max(evaluate(problem, so).time)
        for so in itertools.product(range(problem.num_stages), repeat=len(problem.nodes))
        if valid(problem, so)
    )
    assert chain_bound(problem) <= slowest


def test_chain_bound_sees_expensive_cuts_that_balance_ignores():
    from autosplit.solver.pipeline.bounds import chain_bound

    # Two stages, four equal nodes; only the middle link is cheap to cut.
    problem = make_problem([10, 10, 10, 10], chain(4), stages=2, transfer=[50, 0, 50, 0])
    assert chain_bound(problem) == 20  # cut at the cheap link: 20 + 0
    # Every inner cut moves 50: the bound allows one stage to take the whole chain (40),
    # still far above ⌈total / S⌉ = 20; the real best split pays 30 + 50.
    costly = make_problem([10, 10, 10, 10], chain(4), stages=2, transfer=[50, 50, 50, 0])
    assert chain_bound(costly) == 40
    assert max(evaluate(costly, solve(costly, time_limit=5).stage_of).time) == 80


def test_chain_bound_charges_the_residual_beside_the_chain_link():
    from autosplit.solver.pipeline.bounds import chain_bound, crossing_floor, lower_bound

    # a → b → c → d with a skip a → c (a residual): a cut between b and c moves b's output and
    # a's (4 + 1), one between a and b a's (4), one between c and d c's (5).
    problem = make_problem([10, 10, 10, 10], [*chain(4), (0, 2)], stages=2, transfer=[4, 1, 5, 0], micro_batches=4)
    assert chain_bound(problem) == 25  # two stages of 20 and the middle cut's 5 each, not 20 + 1
    assert crossing_floor(problem) == 2 * 4  # the cheapest cut, charged to both its stages
    # The best plan cuts in the middle: Σ t = 50, max t = 25, so 50 + 3 · 25. Cutting at the cheap
    # link instead would leave stages of 10 + 4 and 30 + 4: the traded bound proves the middle best.
    assert lower_bound(problem) == brute_force(problem) == 50 + 3 * 25


def test_chain_bound_charges_the_branch_beside_the_chain():
    from autosplit.solver.pipeline.bounds import chain_bound

    # q → s → o on the chain, q → v → o beside it (attention's value path): v may sit on
    # either side of a cut between s and o, so the cut carries s's output and, besides, q's
    # output or v's, whichever is cheaper (3), never s's alone (2).
    problem = make_problem([10, 20, 1, 10], [(0, 1), (0, 2), (1, 3), (2, 3)], stages=2, transfer=[7, 2, 3, 0])
    assert chain_bound(problem) == 10 + 20 + 2 + 3
    assert min(max(evaluate(problem, so).time) for so in ((0, 0, 0, 1), (0, 0, 1, 1), (0, 1, 1, 1))) == 36
    # Two branches read q (cheap, 1) and carry 10 each: both go after the cut and q's tensor
    # is paid once, as the best plan pays it: the bound is tight.
    towers = make_problem([10, 10, 0, 0, 20], [(0, 1), (0, 2), (0, 3), (1, 4), (2, 4), (3, 4)], stages=2,
                          transfer=[1, 2, 10, 10, 0])
    assert chain_bound(towers) == 20 + 2 + 1 == max(evaluate(towers, (0, 0, 1, 1, 1)).time)


@st.composite
def branchy_problems(draw):
    """A chain with side branches that rejoin it (towers, attention's value path), sometimes in
    several steps, and a tensor read by several side nodes: the detours the bound must price."""
    n = length = draw(st.integers(4, 6))
    edges = set(chain(n))
    for _ in range(draw(st.integers(1, 3))):
        u = draw(st.integers(0, length - 3))
        v = draw(st.integers(u + 2, length - 1))
        side = list(range(n, n + draw(st.integers(1, 2))))
        if side[-1] >= 8:
            break
        edges |= {(u, side[0]), *itertools.pairwise(side), (side[-1], v)}
        n += len(side)
    S = draw(st.integers(2, 3))
    position = {x: i for i, x in enumerate(_topological(edges))}  # Problem nodes are in topological order
    edges = sorted((position[a], position[b]) for a, b in edges)
    return make_problem(
        [draw(st.integers(0, 12)) for _ in range(n)], edges, stages=S,
        transfer=[draw(st.integers(0, 8)) for _ in range(n)], micro_batches=draw(st.integers(1, 5)),
        latency=draw(st.integers(0, 2)),
    )


def _topological(edges):
    import networkx as nx

    return list(nx.lexicographical_topological_sort(nx.DiGraph(sorted(edges))))


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(branchy_problems())
def test_bounds_hold_on_branches_beside_the_chain(problem):
    from autosplit.solver.pipeline.bounds import chain_bound, lower_bound
    from autosplit.solver.pipeline.chain import chain_of

    plans = [evaluate(problem, so) for so in itertools.product(range(problem.num_stages), repeat=len(problem.nodes))
             if valid(problem, so)]
    best, slowest = min(e.objective for e in plans), min(max(e.time) for e in plans)
    for span in (SolverLimits().free_span, 1, 2):  # 1, 2: free nodes spanning more positions are left out
        limits = SolverLimits(free_span=span)
        assert lower_bound(problem, limits=limits) <= best
        assert chain_bound(problem, chain=chain_of(problem, limits)) <= slowest


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems())
def test_memory_floors_never_exceed_the_least_fullest_stage(problem):
    from autosplit.solver.pipeline.memory import memory_chain_floor, memory_floor, memory_proof

    # Every plan that keeps the rules memory does not decide: edges forward, no empty stage, colocated
    # nodes together (a parameter stays with its reader); its fullest stage as the model charges it.
    kept = ("runs backwards", "empty", "sharing parameters")
    plans = list(itertools.product(range(problem.num_stages), repeat=len(problem.nodes)))
    orderly = [max(evaluate(problem, so).memory) for so in plans
               if not any(k in v for v in violations(problem, so, memory=False) for k in kept)]  # the caps: not kept
    if orderly:
        assert memory_floor(problem) <= min(orderly)
        assert memory_chain_floor(problem) <= min(orderly)
        assert memory_proof(problem) <= min(orderly)


def test_layers_kept_whole_prove_a_model_infeasible_that_spreads_into_the_caps():
    # Three layers of 6 KiB on two devices of 10: spread evenly they would fit (9 each), whole they cannot.
    problem = make_problem([1, 1, 1], chain(3), stages=2, state=[6, 6, 6], capacity=[10, 10])
    from autosplit.solver.pipeline.bounds import memory_chain_floor, memory_floor

    assert memory_floor(problem) == 9 and memory_chain_floor(problem) == 12
    no_cpsat = SolverLimits(cpsat_vars=1)  # the DP finds nothing; no CP-SAT to explain it
    with pytest.raises(InfeasiblePlanError,
                       match=r"needs at least 12.00 KiB on its fullest device.*proven over 2 devices: layers kept whole"):
        solve(problem, time_limit=1, limits=no_cpsat)


def test_large_infeasible_problem_reports_the_memory_floor():
    problem = make_problem([1] * 6, chain(6), stages=2, state=[100] * 6, capacity=[250, 250])
    too_large = SolverLimits(cpsat_vars=1)  # take the path of graphs too large for CP-SAT
    with pytest.raises(InfeasiblePlanError, match=r"any plan needs at least 300\.00 KiB on its fullest device"):
        solve(problem, time_limit=2, limits=too_large)


def test_build_problem_caches_the_arrays_its_tuples_hold():
    import numpy as np

    from autosplit.examples import GPT
    from autosplit.passes.annotate import annotate
    from autosplit.passes.costs import estimate
    from autosplit.solver.build import build_problem
    from autosplit.solver.problem import Problem

    model, ids = GPT(vocab=50, d_model=16, n_layers=2, n_heads=2, max_len=8), torch.randint(0, 50, (2, 8))
    captured = capture(model, (ids,))
    annotate(captured, flat_inputs(captured, (ids,), {}))
    problem = build_problem(estimate(captured.gm, resolve_devices(["cpu"] * 3)), micro_batches=6, schedule="1f1b")
    derived = Problem.arrays.func(problem)  # from the tuples, as a Problem made by hand gets them
    for field in ("compute", "transfer", "state", "act", "recv", "send", "producer", "consumer"):
        assert np.array_equal(getattr(problem.arrays, field), getattr(derived, field)), field


def test_interleaved_stages_share_their_ranks_cap_as_an_even_split_needs():
    """Two ranks, two stages each (a loop): the early stages hold three micro-batches in flight, the
    late ones one, and a rank keeps one transient reserve. Splitting each rank's cap equally between
    its stages (each paying the reserve) leaves room for 6 of the 8 layers; rooms in proportion to
    what an even split costs each stage find the even split, which fits both ranks."""
    problem = dataclasses.replace(
        make_problem([1] * 8, chain(8), stages=4, state=[1] * 8, act=[[3, 3, 1, 1]] * 8, capacity=[16] * 4, micro_batches=4),
        transient_mem=4, rank_of=(0, 1, 0, 1))
    stage_of = split_dp(problem, topological_order(problem))
    assert stage_of == (0, 0, 1, 1, 2, 2, 3, 3)
    assert not violations(problem, stage_of) and evaluate(problem, stage_of).rank_memory == (16, 16)
