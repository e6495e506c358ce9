"""The makespan objective (DLPlacer): planted optima, schedules that keep every rule, bounds."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_solver import chain, make_problem

import autosplit
from autosplit.compiler.steps import codegen
from autosplit.errors import CodegenError, InfeasiblePlanError
from autosplit.options import SolverLimits
from autosplit.plans import Plan
from autosplit.report.html import write_html
from autosplit.report.timeline import timeline
from autosplit.runtime.makespan import MakespanRunner
from autosplit.solver.makespan import makespan_bound, solve_makespan
from autosplit.solver.makespan.schedule import comm, durations, list_schedule, memory_of, run_key, task_graph
from autosplit.solver.problem import UserConstraint


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


class TwoTowers(nn.Module):
    """Two independent towers of four Linear layers, joined at the end."""

    def __init__(self, width: int = 512):
        super().__init__()
        self.left = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
        self.right = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])

    def forward(self, x):
        return self.left(x) + self.right(x)


def test_a_makespan_plan_puts_the_towers_side_by_side_and_round_trips(tmp_path):
    torch.manual_seed(0)
    model, x = TwoTowers(), torch.randn(256, 512)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(x,), objective="makespan", time_limit=5)
    plan = planner.plan()
    assert plan.schedule == "makespan" and plan.micro_batches == 1
    left = {plan.assignment[n] for n in plan.assignment if n.startswith("left")}
    right = {plan.assignment[n] for n in plan.assignment if n.startswith("right")}
    assert len(left) == len(right) == 1 and left != right, "each tower on its own device"
    one = autosplit.plan(model, ["cpu"], example_inputs=(x,), objective="makespan", time_limit=5)
    assert plan.step_time < 0.6 * one.step_time, "the towers' time is halved"
    assert plan.step_time == pytest.approx(plan.solver.objective) and plan.solver.bound <= plan.solver.objective
    # Every task is on its node's device, and each device runs one task at a time.
    assert {(t.node, t.device) for t in plan.tasks} <= set(plan.assignment.items())
    for d in plan.stage_devices:
        on = sorted((t for t in plan.tasks if t.device == d), key=lambda t: t.start)
        assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(on))
    assert len(timeline(plan)) == len(plan.tasks) == 2 * len(plan.assignment)

    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan
    again = planner.plan(tmp_path / "plan.json")  # re-timed under the same costs: the same step
    assert again.assignment == plan.assignment and again.step_time == pytest.approx(plan.step_time)
    write_html(tmp_path / "report.html", plan)
    assert "makespan" in (tmp_path / "report.html").read_text()
    assert isinstance(planner.build(plan), MakespanRunner)
    with pytest.raises(CodegenError, match=r"run it with Planner\.build"):
        codegen(planner.traced, plan)
    with pytest.raises(autosplit.errors.ConstraintError, match="objective='sideways'"):
        autosplit.plan(model, ["cpu"] * 2, example_inputs=(x,), objective="sideways")


def _inception():
    from benchmarks.models import InceptionA

    return InceptionA(8, 4, 0.125), torch.randn(4, 8, 9, 9), {"b1": 0, "b3": 1}


def _towers():
    return TwoTowers(32), torch.randn(16, 32), {"left": 0, "right": 1}


class _Residual(nn.Module):
    """Two residual branches writing in place (``ReLU(inplace=True)``, ``out += identity``)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, width))
        self.b = nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, width))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = self.act(x * 1.0)
        out = self.a(identity)
        out += identity
        other = self.b(identity)
        other += out
        return self.act(other)


def _residual():
    return _Residual(), torch.randn(8, 16), {"a": 0, "b": 1}


@pytest.mark.parametrize("make", [_towers, _inception, _residual], ids=["two towers", "inception block", "in-place residual"])
def test_the_makespan_runtime_trains_like_the_unsplit_model(make):
    torch.manual_seed(0)
    model, x, pin = make()
    model, x = model.double(), x.double()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        target = torch.randn_like(copy.deepcopy(model)(x))  # a copy: BatchNorm's running statistics move
    loss_fn = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    runner = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(x,), objective="makespan", pin=pin, time_limit=5)
    assert isinstance(runner, MakespanRunner) and len(runner.plan.stage_devices) == 2
    opt, ref_opt = runner.optimizer(torch.optim.Adam, lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
    assert len(opt.optimizers) == 2, "one optimizer per device"
    assert sum(len(g["params"]) for o in opt.optimizers.values() for g in o.param_groups) == len(list(model.parameters()))
    for step in range(3):
        loss = runner.step(x, target=target, loss_fn=loss_fn)
        expected = loss_fn(reference(x), target)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}, {name}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=name)
    torch.testing.assert_close(runner(x), reference(x))


def test_compare_shows_both_objectives_and_measures_the_makespan_runtime(tmp_path):
    from benchmarks.models import make

    torch.manual_seed(0)
    model, (q, i) = make("two_tower", "tiny")
    target = torch.arange(q.shape[0])
    cmp = autosplit.compare(
        model, ["cpu"] * 2, example_inputs=(q, i), manual={"deepspeed": "parameters"}, measure=True, steps=2, warmup=1,
        loss_fn=torch.nn.functional.cross_entropy, target=target, objective="makespan", time_limit=5,
    )
    names = [c.name for c in cmp.candidates]
    assert names == ["autosplit makespan", "autosplit pipeline", "deepspeed"]
    makespan, pipeline, manual = (c.plan for c in cmp.candidates)
    assert makespan.schedule == "makespan" and pipeline.schedule == manual.schedule == "gpipe"
    assert pipeline.micro_batches == manual.micro_batches == 8
    runtimes = [c.measured.runtime for c in cmp.candidates]
    assert runtimes == ["makespan", "local", "local"]
    assert cmp.candidates[0].measured.predicted == makespan.step_time
    text = cmp.table()
    assert "makespan, 1 micro-batch" in text and "gpipe × 8" in text
    assert "no makespan plan's objective" in text and "no pipeline plan's objective" in text
    cmp.to_html(tmp_path / "compare.html")
    html = (tmp_path / "compare.html").read_text()
    assert "no makespan plan&#39;s objective" in html or "no makespan plan's objective" in html
