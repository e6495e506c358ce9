"""A saved plan used again: rebuilt without solving, refused for another model or another size of it,
and re-costed under new costs beside the step it was saved with."""

from __future__ import annotations

import copy

import pytest
import torch

import autosplit
from autosplit.examples import GPT
from autosplit.report.text import plan_report
from benchmarks.workloads.models import MLP
from tests.helpers import small_gpt


def test_saved_plan_rebuilds_the_same_split_without_solving(tmp_path, monkeypatch):
    model, inputs = small_gpt()
    reference = copy.deepcopy(model)
    first = autosplit.autosplit(copy.deepcopy(model), ["cpu"] * 3, example_inputs=inputs, time_limit=2)
    first.plan.save(tmp_path / "plan.json")

    def no_solving(*args, **kwargs):
        raise AssertionError("a loaded plan must not be solved again")

    monkeypatch.setattr(autosplit.compiler.steps, "solve", no_solving)
    again = autosplit.autosplit(model, None, example_inputs=inputs, plan=str(tmp_path / "plan.json"))
    assert again.plan.assignment == first.plan.assignment
    assert [s.code for s in again.stages] == [s.code for s in first.stages]
    torch.testing.assert_close(again(*inputs), reference(*inputs))


def test_plan_for_another_model_is_rejected(tmp_path):
    model, inputs = small_gpt()
    autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2).save(tmp_path / "gpt.json")
    other = MLP((8, 16, 4))
    with pytest.raises(autosplit.errors.PlanMismatchError, match="not in the plan"):
        autosplit.autosplit(other, None, example_inputs=(torch.randn(2, 8),), plan=tmp_path / "gpt.json")


def test_plan_for_another_size_of_the_same_model_is_rejected(tmp_path):
    model, inputs = small_gpt()
    autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2).save(tmp_path / "gpt.json")
    wider = GPT(vocab=30, d_model=32, n_layers=3, n_heads=2, max_len=8)
    with pytest.raises(autosplit.errors.PlanMismatchError, match="different ops, edges or parameter shapes"):
        autosplit.autosplit(wider, None, example_inputs=inputs, plan=tmp_path / "gpt.json")


def test_step_prediction_is_broken_into_terms_and_a_recosted_plan_shows_both(tmp_path):
    model, inputs = small_gpt(batch=4)  # the global batch: 2 rows per copy
    plan = autosplit.plan(model, ["cpu"] * 4, example_inputs=inputs, time_limit=2, data_parallel=2)  # pp 2 × dp 2
    t = plan.terms
    assert t is not None and t.total == pytest.approx(plan.step_time)
    assert t.pipeline > 0 and t.optimizer > 0 and t.data_parallel >= 0
    assert plan.shared_params and plan.shared_params[0].name == "wte.weight"
    assert plan.shared_params[0].policy in ("replicate", "send")
    assert "shared parameter wte.weight" in plan_report(plan) and "optimizer" in plan_report(plan)
    plan.save(tmp_path / "plan.json")
    slower = autosplit.Planner(model, None, example_inputs=inputs, cost_overrides={"blocks.0": {"fwd": 1.0}}).plan(
        tmp_path / "plan.json"
    )
    assert slower.made_with == ("analytic (uncalibrated for cpu)", pytest.approx(plan.step_time))
    assert slower.step_time > plan.step_time + 0.5
    assert "as saved: step" in plan_report(slower)
