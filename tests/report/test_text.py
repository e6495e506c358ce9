"""The text report: every device and the solver's figures, and what the predictions rest on
(uncalibrated costs, a split made by hand)."""

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
