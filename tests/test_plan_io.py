"""Reports and plan files: versioned JSON, rebuild without solving, mismatch errors (issue #2, item 9)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import autosplit
from autosplit.examples import GPT
from autosplit.report.text import plan_report
from benchmarks.models import MLP


def _gpt():
    return GPT(vocab=30, d_model=16, n_layers=3, n_heads=2, max_len=8), (torch.randint(0, 30, (2, 8)),)


def test_report_shows_every_device_and_the_solver(tmp_path):
    model, inputs = _gpt()
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


def test_plan_round_trips_through_json(tmp_path):
    model, inputs = _gpt()
    plan = autosplit.plan(model, ["cpu", "A100-80GB"], example_inputs=inputs, time_limit=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 3 and data["objective"] == "pipeline" and data["fingerprint"] == plan.fingerprint
    assert {"torch", "ortools"} <= set(data["versions"])
    loaded = autosplit.Plan.load(path)
    assert loaded == plan


def test_saved_plan_rebuilds_the_same_split_without_solving(tmp_path, monkeypatch):
    model, inputs = _gpt()
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
    model, inputs = _gpt()
    autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2).save(tmp_path / "gpt.json")
    other = MLP((8, 16, 4))
    with pytest.raises(autosplit.errors.PlanMismatchError, match="not in the plan"):
        autosplit.autosplit(other, None, example_inputs=(torch.randn(2, 8),), plan=tmp_path / "gpt.json")


def test_plan_for_another_size_of_the_same_model_is_rejected(tmp_path):
    model, inputs = _gpt()
    autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2).save(tmp_path / "gpt.json")
    wider = GPT(vocab=30, d_model=32, n_layers=3, n_heads=2, max_len=8)
    with pytest.raises(autosplit.errors.PlanMismatchError, match="different ops, edges or parameter shapes"):
        autosplit.autosplit(wider, None, example_inputs=inputs, plan=tmp_path / "gpt.json")


def test_unknown_schema_version_is_rejected(tmp_path):
    model, inputs = _gpt()
    plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2)
    data = plan.to_dict() | {"schema_version": 99}
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(autosplit.errors.PlanFileError, match="schema version 99"):
        autosplit.Plan.load(tmp_path / "p.json")


def test_plan_for_absent_hardware_and_memory_infeasibility():
    model, inputs = _gpt()
    plan = autosplit.plan(model, ["H100-80GB"] * 2, example_inputs=inputs, time_limit=2)
    assert [d.name for d in plan.devices] == ["H100-80GB"] * 2
    with pytest.raises(autosplit.errors.DeviceError, match="presets describe hardware to plan for"):
        autosplit.autosplit(model, ["H100-80GB"] * 2, example_inputs=inputs)
    with pytest.raises(autosplit.errors.InfeasiblePlanError, match="least memory any plan needs") as err:
        autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, memory={"cpu": "40KiB"}, time_limit=2)
    assert "cap 40.00 KiB" in str(err.value)


def test_generated_source_is_readable():
    model, inputs = _gpt()
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2)
    code = split.code
    assert "# stage 0 on cpu" in code and "# stage 1 on cpu" in code
    assert "self.stage0(" in code and "self.stage1(" in code
    assert "def forward(self, idx" in code


def test_step_prediction_is_broken_into_terms_and_a_recosted_plan_shows_both(tmp_path):
    model, inputs = _gpt()
    plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2, data_parallel=2)
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


def test_steady_allocator_sets_glibcs_thresholds():
    assert autosplit.timers.steady_allocator() is True  # Linux, glibc: both mallopt calls accepted


def test_measured_runtime_overhead_is_cached(tmp_path, monkeypatch):
    first = autosplit.calibration.measure_runtime(cache_dir=str(tmp_path))
    assert first.link.bandwidth > 0 and first.microbatch_overhead >= 0 and len(first.samples) == 2
    monkeypatch.setattr(autosplit.calibration.overhead, "run_pair", lambda *_, **__: (_ for _ in ()).throw(AssertionError("cached")))
    assert autosplit.calibration.measure_runtime(cache_dir=str(tmp_path)) == first
    spec = first.apply(autosplit.devices.resolve_devices(["cpu"])[0])
    assert spec.microbatch_overhead == first.microbatch_overhead and spec.link_latency == first.link.latency


def test_the_report_says_when_predictions_are_uncalibrated_and_when_a_split_was_made_by_hand():
    model, inputs = _gpt()
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2)
    report = plan_report(planner.plan())
    assert "costs analytic (uncalibrated for cpu)" in report and "before trusting them" in report
    assert "uncalibrated" not in plan_report(autosplit.plan(model, ["A100-80GB"] * 2, example_inputs=inputs, time_limit=2))
    from autosplit.compiler.manual import manual_plan

    by_hand = plan_report(manual_plan(planner, [["wte", "wpe", "blocks.0"], ["blocks.1", "ln_f", "head"]]))
    assert "split by hand (manual), no solver ran" in by_hand
    assert "bound" not in by_hand and "found no split" not in by_hand
