"""The cost table a plan is made on: measured profiles and their cache, the device and the batch
they need, overrides, saved tables, and a split planned on measured costs that trains like the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.costtable import CostTable
from autosplit.devices import resolve_devices
from autosplit.errors import CostModelError
from autosplit.passes import profile as profile_module
from tests.helpers import FAST_PROFILE, ProfiledNet, assert_trains_like


def _plan(model, x, tmp_path, **options):
    costs = autosplit.options.ProfileOptions(cache_dir=str(tmp_path), **FAST_PROFILE)
    return autosplit.plan(model, ["cpu"] * 2, example_inputs=(x,), costs=costs, micro_batches=2, **options)


def test_measured_plan_profiles_once_then_reads_the_cache(tmp_path, monkeypatch):
    model, x = ProfiledNet(), torch.randn(64, 256)
    plan = _plan(model, x, tmp_path)
    assert plan.costs == "measured on cpu"
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
    # A restart must not profile again: make measuring impossible and plan once more.
    monkeypatch.setattr(profile_module._Profiler, "_measure", lambda *a: pytest.fail("profiled twice"))
    again = _plan(model, x, tmp_path)
    assert again.costs == "measured on cpu (cache: 1 of 1)"
    assert again.assignment == plan.assignment
    # Another input shape is another key.
    monkeypatch.undo()
    _plan(model, torch.randn(32, 256), tmp_path)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2


def test_split_planned_on_measured_costs_trains_like_the_model(tmp_path):
    costs = autosplit.options.ProfileOptions(cache_dir=str(tmp_path), **FAST_PROFILE)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    assert_trains_like(model, ["cpu"] * 3, (torch.randn(8, 16),), costs=costs, micro_batches=4)


def test_measured_costs_need_a_device_present():
    with pytest.raises(CostModelError, match="plan-only presets"):
        autosplit.plan(ProfiledNet(), ["A100-80GB"] * 2, example_inputs=(torch.randn(8, 256),), costs="measured")


def test_micro_batches_must_divide_the_profiled_batch(tmp_path):
    with pytest.raises(autosplit.errors.ConstraintError, match="micro_batches=4 does not divide the batch of 6 rows"):
        autosplit.plan(ProfiledNet(), ["cpu"] * 2, example_inputs=(torch.randn(6, 256),), micro_batches=4,
                       costs=autosplit.options.ProfileOptions(cache_dir=str(tmp_path), **FAST_PROFILE))


def test_overrides_set_a_node_and_spread_a_module_total():
    model, x = ProfiledNet(), torch.randn(8, 256)
    base = autosplit.plan(model, ["cpu"] * 2, example_inputs=(x,))
    heavy = autosplit.plan(model, ["cpu"] * 2, example_inputs=(x,), cost_overrides={"small": {"fwd": 5.0, "bwd": 5.0}})
    assert heavy.costs == "analytic (uncalibrated for cpu) + 1 override"
    # 10 s of work in the last layer: it gets a stage of its own, and the prediction says so.
    assert heavy.stage_of["small"] == 1 and all(s == 0 for n, s in heavy.stage_of.items() if n != "small")
    assert heavy.stages[1].compute == pytest.approx(10.0, abs=1e-3)  # + the optimizer step of its parameters
    assert base.stages[1].compute < 1.0


def test_a_saved_cost_table_plans_like_the_original_and_a_foreign_one_is_refused(tmp_path):
    from autosplit.passes.annotate import annotate
    from autosplit.passes.capture import capture, flat_inputs
    from autosplit.passes.costs import estimate, with_overrides

    model, x = ProfiledNet(), torch.randn(8, 256)
    captured = capture(model, (x,))
    annotate(captured, flat_inputs(captured, (x,), {}))
    table = with_overrides(estimate(captured.gm, resolve_devices(["cpu"] * 2)), {"small": {"fwd": 5.0}})
    table.save(tmp_path / "costs.json")
    assert CostTable.load(tmp_path / "costs.json") == table
    plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=(x,), costs=tmp_path / "costs.json")
    assert plan.costs.startswith("given table") and plan.stage_of["small"] == 1
    with pytest.raises(CostModelError, match="belongs to another model"):
        autosplit.plan(nn.Linear(256, 4), ["cpu"] * 2, example_inputs=(x,), costs=table)
