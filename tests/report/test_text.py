"""The text report: every device and the solver's figures, and what the predictions rest on
(uncalibrated costs, a split made by hand, a loss not costed)."""

from __future__ import annotations

import autosplit
from autosplit.report.text import plan_report
from tests.helpers import small_gpt


def test_report_shows_every_device_and_the_solver(tmp_path):
    model, inputs = small_gpt()
    plan = autosplit.plan(model, ["cpu"] * 3, example_inputs=inputs, memory={"cpu": "64MiB"}, time_limit=2)
    text = plan_report(plan)
    for s in range(3):
        assert f"│     {s} │ {s}: cpu" in text
    for word in ("nodes", "params", "memory / cap", "64.00 MiB", "compute", "transfers", "bottleneck", "gap", "bound"):
        assert word in text
    assert plan.solver.status in ("OPTIMAL", "FEASIBLE")
    assert plan.solver.bound <= plan.solver.objective
    assert sum(s.nodes for s in plan.stages) == len(plan.assignment)
    assert sum(s.params for s in plan.stages) == sum(p.numel() for p in model.parameters())


def test_the_report_says_when_predictions_are_uncalibrated_and_when_a_split_was_made_by_hand():
    model, inputs = small_gpt()
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2)
    report = plan_report(planner.plan())
    assert "costs analytic (uncalibrated for cpu)" in report and "before trusting them" in report
    assert "uncalibrated" not in plan_report(autosplit.plan(model, ["A100-80GB"] * 2, example_inputs=inputs, time_limit=2))
    from autosplit.compiler.manual import manual_plan

    by_hand = plan_report(manual_plan(planner, [["wte", "wpe", "blocks.0"], ["blocks.1", "ln_f", "head"]]))
    assert "split by hand (manual), no solver ran" in by_hand
    assert "bound" not in by_hand and "found no split" not in by_hand


def test_the_report_says_when_the_loss_is_not_costed():
    """Without ``loss_fn`` and ``example_target`` the stage returning the output holds the loss's saved
    tensors beyond its figures (under GPipe one per micro-batch, all of them at once): the report says so."""
    import torch.nn.functional as F

    model, inputs = small_gpt()
    uncosted = plan_report(autosplit.plan(model, ["A100-80GB"] * 2, example_inputs=inputs, time_limit=2))
    assert "the loss is not costed" in uncosted and "loss_fn= and example_target=" in uncosted
    tokens = inputs[0]
    costed = plan_report(autosplit.plan(model, ["A100-80GB"] * 2, example_inputs=inputs, time_limit=2, example_target=tokens,
                                        loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())))
    assert "not costed" not in costed and "loss costed on the output's stage" in costed


def test_a_stage_without_a_repeated_layer_is_explained_in_layers():
    # Three layers and the head by hand on two devices: the head's stage holds no layer, and the report says what it weighs.
    from autosplit.report.text import layerless_notes

    model, inputs = small_gpt()
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2)
    from autosplit.compiler.manual import manual_plan

    plan = manual_plan(planner, [["wte", "wpe", "blocks.0", "blocks.1", "blocks.2"], ["ln_f", "head"]])
    notes = layerless_notes(plan)
    assert len(notes) == 1 and notes[0].startswith("stage 1 holds no repeated layer, only ln_f: its compute")
    assert "the slowest stage, 0, holds 3 layer(s)" in notes[0] and "(a split by hand)" in notes[0]
    assert "weighs as much as" in notes[0] and "stage 1 holds no repeated layer" in plan_report(plan)
    assert layerless_notes(autosplit.plan(model, ["cpu"], example_inputs=inputs, time_limit=2)) == []
