"""Plans for torch's multi-stage schedules: several stages per rank, the replayed step and memory,
the replay's refinement of the solver's cuts, the ``"auto"`` search, and their plan files."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

import autosplit
from autosplit.compiler.costs import estimated
from autosplit.compiler.prediction import predict_step
from autosplit.compiler.refine import _layer_cuts, _rank_balanced, _relocate, refine
from autosplit.compiler.search import stage_problem
from autosplit.devices import resolve_devices
from autosplit.errors import InfeasiblePlanError
from autosplit.examples import GPT
from autosplit.plans import Plan
from autosplit.report import plan_report
from autosplit.report.timeline import timeline
from autosplit.solver.hybrid import ring_allreduce
from autosplit.solver.pipeline.dp import split_dp, topological_order

TORCH_RUN = {"gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev"}


def _planner(n_layers: int = 4, **options) -> autosplit.Planner:
    torch.manual_seed(0)
    model = GPT(vocab=128, d_model=32, n_layers=n_layers, n_heads=2, max_len=16)
    return autosplit.Planner(model, ["cpu"] * 2, example_inputs=(torch.randint(0, 128, (8, 16)),), time_limit=2, **options)


@pytest.mark.parametrize("schedule, placement", [("interleaved1f1b", (0, 1, 0, 1)), ("zbvzerobubble", (0, 1, 1, 0)),
                                                  ("dualpipev", (0, 1, 1, 0)), ("loopedbfs", (0, 1, 0, 1))])
def test_two_stages_per_rank_sit_where_torch_puts_them(schedule, placement):
    plan = _planner(schedule=schedule, stages_per_rank=2, micro_batches=4).plan()
    assert plan.stage_devices == placement and plan.stages_per_rank == 2
    assert sorted(set(plan.assignment.values())) == [0, 1, 2, 3], "several stages per rank: nodes map to stages"
    assert len(plan.rank_memory) == 2 and all(m > 0 for m in plan.rank_memory)
    for r in range(2):  # a rank's peak holds no more than its stages' own peaks together
        assert plan.rank_memory[r] <= sum(st.memory for s, st in enumerate(plan.stages) if placement[s] == r)
    tasks = timeline(plan)
    assert {t.row for t in tasks} == {0, 1}, "the chart has a row per rank"
    assert sum(t.kind == "optimizer" for t in tasks) == 4 and sum(t.kind == "forward" for t in tasks) == 4 * 4
    work = max(t.end for t in tasks if t.kind != "optimizer")
    assert work == pytest.approx(plan.terms.pipeline), "the chart is the replay the prediction made"


def test_split_backward_keeps_weight_only_nodes_on_the_first_stage():
    plan = _planner(schedule="interleavedzerobubble", stages_per_rank=2, micro_batches=4).plan()
    assert plan.module_stages["wte"] == (0,) and plan.module_stages["wpe"] == (0,)


@pytest.mark.parametrize("schedule", ["interleavedzerobubble", "zbvzerobubble"])
def test_the_first_stage_of_a_split_backward_runs_it_whole_in_its_weight_pass(schedule):
    """torch's first stage has no input gradient to compute: its input pass does nothing and its weight
    pass runs one whole backward, which does not pay for splitting (measured in the profile)."""
    planner = _planner(schedule=schedule, stages_per_rank=2, micro_batches=4, costs="measured")
    plan = planner.plan()
    first, *others = plan.stages
    assert first.backward_weight == first.backward > 0
    assert all(0 <= st.backward_weight < st.backward for st in others) and any(st.backward_weight > 0 for st in others)
    _, _, table, _, _ = estimated(planner.traced, planner.specs(), planner.options)
    members = [table.nodes.index(name) for name, s in plan.assignment.items() if s == 0]
    split = sum(table.bwd_time[n][0] for n in members)
    assert table.split_cost and first.backward == pytest.approx(split - sum(table.split_cost[n][0] for n in members))
    analytic = _planner(schedule=schedule, stages_per_rank=2, micro_batches=4).plan()
    assert analytic.stages[0].backward_weight == analytic.stages[0].backward > 0
    tasks = [t for t in timeline(plan) if t.stage == 0]
    inputs = [t.end - t.start for t in tasks if t.kind == "input"]
    assert inputs and inputs == pytest.approx([first.transfer / 2 / 4] * 4), "the chart's first-stage I: its transfer only"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_stage_per_rank_memory_is_each_stages(schedule):
    plan = _planner(schedule=schedule, micro_batches=4).plan()
    assert plan.rank_memory == pytest.approx([st.memory for st in plan.stages], abs=2048)


def _refining(schedule: str, n_layers: int = 4):
    """(problem, table, the DP's split (its ranks not balanced: the planted splits are the DP's), device order,
    options with cut_margin=0, the replayed step of a split)."""
    planner = _planner(schedule=schedule, stages_per_rank=2, micro_batches=4, cut_margin=0, n_layers=n_layers)
    _, M, table, _, rules = estimated(planner.traced, planner.specs(), planner.options)
    order, problem = stage_problem(table, 2, planner.options, M, rules)
    seed = split_dp(problem, topological_order(problem))

    def step(plan):
        return predict_step(problem, table, plan, order, planner.options)[0].total

    return problem, table, seed, order, planner.options, step


def _layer_splits(problem, table):
    """(the layer boundaries along the problem's topological order, every split into 4 stages at them)."""
    topo = topological_order(problem)
    layers = _layer_cuts(table.module_paths, topo)

    def split(chosen):
        out = [0] * len(topo)
        for s, (a, b) in enumerate(zip([0, *chosen], [*chosen, len(topo)])):
            for u in topo[a:b]:
                out[u] = s
        return tuple(out)

    return layers, [split(c) for c in itertools.combinations(layers, 3)]


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "interleavedzerobubble", "zbvzerobubble"])
def test_refining_by_the_replay_never_makes_the_step_slower(schedule):
    problem, table, seed, order, options, step = _refining(schedule)
    assert step(refine(problem, table, seed, order, options)) <= step(seed) + 1e-12
    kept = refine(problem, table, seed, order, options.replace(cut_margin=0.03))
    assert step(kept) <= step(seed) * 1.03 + 1e-12, "slower only for layer cuts, and by at most the margin"


@pytest.mark.parametrize("schedule, planted", [("loopedbfs", "faster"), ("zbvzerobubble", "tied")])
def test_a_split_inside_a_layer_must_beat_the_layer_cuts_by_the_margin(schedule, planted):
    """Planted: the tiny GPT's fastest split by the replay cuts inside a layer (loopedbfs), or ties,
    to rounding, with one at layer boundaries (ZBV). It is chosen only with a margin below its gain
    over every split at layer boundaries (all replayed here); within the margin, refine returns the
    fastest of those — also when they are too many to replay and it descends along them."""
    problem, table, seed, order, options, step = _refining(schedule)
    topo = topological_order(problem)
    layers, splits = _layer_splits(problem, table)

    def cuts(plan):
        return {p for p in range(1, len(topo)) if plan[topo[p]] != plan[topo[p - 1]]}

    aligned = min(map(step, splits))
    free = refine(problem, table, seed, order, options)
    gain = aligned / step(free) - 1
    assert not cuts(free) <= set(layers), "the planted optimum cuts inside a layer"
    assert gain > 1e-3 if planted == "faster" else 0 <= gain < 1e-12
    if planted == "faster":
        assert refine(problem, table, seed, order, options.replace(cut_margin=gain * 0.99)) == free
    gain = max(gain, 1e-9)
    for replays in (400, 8):  # 10 splits at layer cuts: replayed all, or (8 replays) descended along
        kept = refine(problem, table, seed, order, options.replace(cut_margin=gain * 1.01), replays=replays)
        assert cuts(kept) <= set(layers) and step(kept) == pytest.approx(aligned)


def test_a_rank_running_several_stages_gets_the_even_share_of_layers():
    """Planted: an embedding (0.1), eight layers (1 each) and a head (1.2), one piece each, over 4 stages
    looped on 2 ranks. Equal work per stage gives rank 1 the head and a layer more (5.2 against 4.1); one
    layer moves off its last stage onto rank 0's second, the stage between keeping its two (5.1 against 4.2),
    and nothing further lowers the busiest rank."""
    work = list(itertools.accumulate([0.1, *[1.0] * 8, 1.2]))
    assert _rank_balanced(list(range(1, 10)), work, 4, lambda s: s % 2) == [[3, 5, 8]]


def test_relocating_a_surplus_layer_follows_the_replay():
    """Planted: 11 one-position pieces over 5 stages, one stage holding a third piece, and a replay that
    prefers that stage late (any other shape far slower). The descent walks the extra piece to the last
    stage, one gaining move at a time, and spends no more replays than it is given."""
    cuts = list(range(1, 11))

    def split(chosen):
        return tuple(s for s, (a, b) in enumerate(itertools.pairwise([0, *chosen, 11])) for _ in range(a, b))

    def counts(cuts):
        plan = split(cuts)
        return tuple(plan.count(s) for s in range(5))

    def step(plan):
        c = tuple(plan.count(s) for s in range(5))
        return 10.0 - c.index(3) if sorted(c) == [2, 2, 2, 2, 3] else 100.0

    start = [3, 5, 7, 9]
    assert counts(start) == (3, 2, 2, 2, 2)
    assert counts(_relocate(start, cuts, split, step, replays=100)) == (2, 2, 2, 2, 3)
    assert counts(_relocate(start, cuts, split, step, replays=3)) == (2, 3, 2, 2, 2), "the start, one gain, one loss"


def test_splits_the_replay_ties_go_to_the_evener():
    """Planted: on an 8-layer GPT under ZBV, rank 1's two stages hold layers 2–5 as [2][3–5] or
    [2–3][4–5], which the replay ties; refine returns the one whose slowest stage computes least."""
    problem, table, _, order, options, step = _refining("zbvzerobubble", n_layers=8)
    _, splits = _layer_splits(problem, table)

    def slowest(plan):
        return max(sum(problem.fastest[n] for n, s in enumerate(plan) if s == stage) for stage in range(4))

    best = min(map(step, splits))
    ties = [p for p in splits if step(p) <= best * (1 + 1e-9)]
    assert len({slowest(p) for p in ties}) > 1, "planted: tied splits of unequal stages"
    for given in ties:
        kept = refine(problem, table, given, order, options)
        assert step(kept) == pytest.approx(best, rel=1e-6) and slowest(kept) == min(map(slowest, ties))


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "zbvzerobubble", "dualpipev"])
def test_no_split_replays_below_the_proven_step_bound(schedule):
    """The replayed step's bound (all the work spread evenly over the ranks) holds for every split,
    with the runtime's overhead per micro-batch counted, and the plan reports it beside its gap."""
    cpu = dataclasses.replace(resolve_devices(["cpu"])[0], microbatch_overhead=2e-3)
    torch.manual_seed(0)
    model = GPT(vocab=128, d_model=32, n_layers=4, n_heads=2, max_len=16)
    planner = autosplit.Planner(model, [cpu, cpu], example_inputs=(torch.randint(0, 128, (8, 16)),), time_limit=2,
                                schedule=schedule, stages_per_rank=2, micro_batches=4)
    plan = planner.plan()
    bound = plan.solver.step_bound
    assert bound is not None and 0 < bound <= plan.step_time and plan.step_gap == pytest.approx(1 - bound / plan.step_time)
    assert f"step gap {plan.step_gap:.2%}" in plan_report(plan)
    _, M, table, _, rules = estimated(planner.traced, planner.specs(), planner.options)
    order, problem = stage_problem(table, 2, planner.options, M, rules)
    nodes = topological_order(problem)
    rng = random.Random(0)
    steps = []
    for _ in range(60):  # contiguous splits of the node order into 4 stages, cut anywhere
        cuts = sorted(rng.sample(range(1, len(nodes)), 3))
        stage_of = [0] * len(nodes)
        for s, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(nodes)])):
            for u in nodes[a:b]:
                stage_of[u] = s
        steps.append(predict_step(problem, table, stage_of, order, planner.options)[0].total)
    assert min(steps) >= bound, "a split replayed below the bound: it does not bound"
    assert min(steps) <= 2 * bound, "the bound is within 2x of the splits it bounds"
    by_hand = planner.manual([["wte", "wpe", "blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3", "ln_f", "head"]])
    assert by_hand.solver.step_bound == pytest.approx(bound) and by_hand.step_time >= bound, "a hand split: the same bound"
    assert "replayed step bound" in plan_report(by_hand)
    assert _planner(schedule="1f1b", micro_batches=4).plan().solver.step_bound is None, "1F1B's closed form bounds its step"


def test_auto_returns_the_fastest_configuration_that_fits_and_the_others():
    plan = _planner(schedule="auto", stages_per_rank="auto", micro_batches="auto").plan()
    rows = plan.alternatives
    assert len(rows) > 10 and {r.schedule for r in rows} == TORCH_RUN
    assert [r.step_time for r in rows] == sorted(r.step_time for r in rows)
    best = rows[0]
    assert (plan.schedule, plan.stages_per_rank, plan.micro_batches) == (best.schedule, best.stages_per_rank, best.micro_batches)
    assert all(r.micro_batches % 1 == 0 and 8 % r.micro_batches == 0 for r in rows)
    assert "configurations tried" in plan_report(plan) and "search" in plan.timings
    # the gap covers every configuration: each row's bound holds for it, and the plan's bound for all of them
    assert all(r.bound is not None and r.bound <= r.step_time * (1 + 1e-9) for r in rows)
    assert plan.solver.step_bound <= min(r.step_time for r in rows) * (1 + 1e-9) and plan.step_gap is not None


def test_auto_passes_over_only_configurations_that_cannot_beat_the_best_and_chooses_as_judging_all_would():
    """The search splits the most micro-batches first and passes over a configuration whose bound
    (with 1F1B's and GPipe's fill and drain) is no less than the fastest step found: the one it chooses
    is the one splitting every configuration chooses."""
    from autosplit.compiler.search import _judge, configurations, search

    torch.manual_seed(0)
    model = GPT(vocab=128, d_model=128, n_layers=4, n_heads=2, max_len=64)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(torch.randint(0, 128, (8, 64)),), time_limit=2,
                                schedule="auto", stages_per_rank="auto", micro_batches="auto")
    specs = planner.specs()
    chosen, rows = search(planner.traced, specs, planner.options)
    every = {(r.schedule, r.stages_per_rank, r.micro_batches): r for r in (
        _judge(planner.traced, specs, c) for c in configurations(planner.options, 2, 8))}
    fastest = min(every.values(), key=lambda r: r.step_time)
    assert (chosen.schedule, chosen.rank_stages, chosen.micro_batches) == (fastest.schedule, fastest.stages_per_rank,
                                                                           fastest.micro_batches)
    passed = [r for r in rows if r.note.startswith("not split")]
    assert passed, "this GPT's search passes some over"
    assert all(r.bound >= fastest.step_time for r in passed)


def test_auto_respects_a_memory_cap_that_rules_out_gpipe():
    free = _planner(schedule="auto", micro_batches=8).plan()
    gpipe = next(r for r in free.alternatives if r.schedule == "gpipe")
    one_f = next(r for r in free.alternatives if r.schedule == "1f1b")
    assert max(one_f.rank_memory) < max(gpipe.rank_memory)
    cap = (max(one_f.rank_memory) + max(gpipe.rank_memory)) // 2
    capped = _planner(schedule="auto", micro_batches=8, memory={0: cap, 1: cap}).plan()
    assert capped.schedule != "gpipe" and max(capped.rank_memory) <= cap
    assert not next(r for r in capped.alternatives if r.schedule == "gpipe").fits
    with pytest.raises(InfeasiblePlanError, match="proven"):  # a cap no split fits: each configuration proven over it
        _planner(schedule="auto", micro_batches=8, memory={0: 1024, 1: 1024}).plan()


def test_a_multi_stage_plan_file_round_trips_and_recosts(tmp_path):
    planner = _planner(schedule="zbvzerobubble", micro_batches=4)
    plan = planner.plan()
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan
    again = _planner(schedule="gpipe").plan(tmp_path / "plan.json")  # the file fixes schedule and stages per rank
    assert again.schedule == "zbvzerobubble" and again.stages_per_rank == 2
    assert again.step_time == pytest.approx(plan.step_time) and again.rank_memory == plan.rank_memory


def test_a_tied_weight_is_all_reduced_between_ranks_with_the_measured_all_reduce():
    """The GPT's embedding and head: on two ranks (1F1B) their gradients are all-reduced at the
    devices' measured all-reduce figures; in a V both sit on rank 0 and are summed in place, free."""
    cpu = resolve_devices(["cpu"])[0]
    spec = dataclasses.replace(cpu, allreduce_bandwidth=1e9, allreduce_latency=2e-3)
    torch.manual_seed(0)
    model = GPT(vocab=128, d_model=32, n_layers=4, n_heads=2, max_len=16)
    inputs = (torch.randint(0, 128, (8, 16)),)
    linear = autosplit.Planner(model, [spec] * 2, example_inputs=inputs, time_limit=2, schedule="1f1b", micro_batches=4).plan()
    (tied,) = linear.shared_params
    assert tied.stages == (0, 1)
    assert tied.replicate == pytest.approx(ring_allreduce(128 * 32 * 4, 2, 1e9, 2e-3))
    assert linear.terms.tied_sync == (tied.replicate if tied.policy == "replicate" else 0.0)
    v = autosplit.Planner(model, [spec] * 2, example_inputs=inputs, time_limit=2, schedule="zbvzerobubble",
                          stages_per_rank=2, micro_batches=4).plan()
    (tied,) = v.shared_params
    assert tied.stages == (0, 3) and v.stage_devices[0] == v.stage_devices[3] == 0
    assert tied.replicate == 0.0 and tied.policy == "replicate" and v.terms.tied_sync == 0.0


def test_layer_cuts_are_where_the_repeated_layer_changes():
    """torchtitan's cuts: into the first layer, between layers, out into the head; helper nodes of no module change nothing."""
    paths = ["", "wte", "wpe", "blocks.0.ln", "blocks.0.attn", "", "blocks.1.ln", "blocks.1.mlp.fc", "ln_f", "", "head"]
    assert _layer_cuts(paths, list(range(len(paths)))) == [3, 6, 8]
    assert _layer_cuts(["a", "b.c", ""], [0, 1, 2]) == []  # no numbered layers: none


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "zbvzerobubble", "dualpipev"])
def test_the_solver_holds_a_rank_to_no_less_than_its_plan_reports(schedule):
    """Several stages per rank: the memory the solver held each rank to (its worst moment, ``Evaluation.rank_memory``)
    is no less than the plan reports (``rank_peaks``, the replayed action lists: a plan the solver accepts fits)
    and no more than its stages' own peaks summed with one reserve (what it held a rank to before)."""
    import numpy as np

    from autosplit.solver.evaluation import evaluate
    from autosplit.solver.problem import KIB

    planner = _planner(schedule=schedule, stages_per_rank=2, micro_batches=4)
    plan = planner.plan()
    _, M, table, _, rules = estimated(planner.traced, planner.specs(), planner.options)
    _, problem = stage_problem(table, 2, planner.options, M, rules)
    ev = evaluate(problem, [plan.assignment[name] for name in problem.nodes])
    summed = np.bincount([problem.rank(s) for s in range(4)], weights=np.asarray(ev.memory) - ev.transient_mem) + ev.transient_mem
    for reported, held, most in zip(plan.rank_memory, ev.rank_memory, summed):
        assert reported <= held * KIB and held <= most
