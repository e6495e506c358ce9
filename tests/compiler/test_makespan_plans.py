"""A makespan plan (DLPlacer's objective) made from a model: towers side by side, the step it
predicts, its round trip through a plan file, the report and the build."""

from __future__ import annotations

import itertools

import pytest
import torch

import autosplit
from autosplit.compiler.steps import codegen
from autosplit.errors import CodegenError
from autosplit.plans import Plan
from autosplit.report.html import write_html
from autosplit.report.timeline import timeline
from autosplit.runtime.makespan import MakespanRunner
from benchmarks.workloads.models import BigLSTM
from tests.helpers import TwoTowers


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


def test_lstm_layers_in_time_pieces_run_as_a_wavefront():
    """A stack of LSTMs over time pieces (``benchmarks.workloads.models.recur``) computes what one call per
    layer does; its makespan plan on two GPUs puts the layers on different devices, overlapping
    piece by piece, where one call per layer gains next to nothing from the second device."""
    torch.manual_seed(0)
    small = dict(vocab=40, embed=8, hidden=12, proj=6)
    whole, cut = BigLSTM(**small), BigLSTM(**small, chunks=4, shards=3)
    state = whole.state_dict()
    for name, value in cut.state_dict().items():
        if name.startswith("softmax."):  # the vocabulary slices of whole's softmax
            part, tensor = int(name.split(".")[2]), name.split(".")[3]
            value.copy_(state[f"softmax.{tensor}"].tensor_split(3)[part])
        else:
            value.copy_(state[name])
    tokens = torch.randint(0, 40, (3, 9))
    torch.testing.assert_close(cut(tokens), whole(tokens))

    gpus = autosplit.Cluster.dgx1().replica_devices(2)
    plans = {}
    for chunks, k in itertools.product((1, 16), (1, 2)):
        with torch.device("meta"):
            model = BigLSTM(vocab=8000, embed=512, hidden=2048, proj=512, chunks=chunks)
            tokens = torch.zeros(64, 16, dtype=torch.long)
        plans[chunks, k] = autosplit.plan(model, gpus[:k], example_inputs=(tokens,), objective="makespan", time_limit=5)
    step = {key: plan.step_time for key, plan in plans.items()}
    wave = plans[16, 2].assignment
    layers = [{d for n, d in wave.items() if n.startswith(name)} for name in ("lstm1", "lstm2")]
    assert len(layers[0]) == len(layers[1]) == 1 and layers[0] != layers[1]
    assert step[16, 2] < 0.75 * step[16, 1] and step[1, 2] > 0.9 * step[1, 1], step
