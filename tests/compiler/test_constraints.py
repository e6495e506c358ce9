"""Constraints on a plan: pin, avoid and together honoured (in a split that still trains like the
model), their conflicts and typos named; solver limits reach the solver through the options."""

from __future__ import annotations

import pytest
import torch

import autosplit
from autosplit.examples import GPT
from autosplit.options import SolverLimits
from autosplit.passes.capture import capture
from tests.helpers import assert_trains_like


def _gpt_small():
    return GPT(vocab=64, d_model=32, n_layers=4, n_heads=2, max_len=16), (torch.randint(0, 64, (2, 16)),)


def test_pin_avoid_and_together_are_honoured():
    model, inputs = _gpt_small()
    plan = autosplit.plan(
        model, ["cpu"] * 3, example_inputs=inputs, time_limit=2,
        pin={"blocks.3": 1}, avoid={"blocks.0": [0]}, together=[("blocks.1", "blocks.2")],
    )
    by_module = {}
    for name, device in plan.assignment.items():
        by_module.setdefault(name, device)
    captured = capture(model, inputs)
    paths = captured.module_paths

    def devices_of(prefix):
        return {plan.assignment[n] for n, p in paths.items() if n in plan.assignment and (p == prefix or p.startswith(prefix + "."))}

    assert devices_of("blocks.3") == {1}
    assert 0 not in devices_of("blocks.0")
    assert len(devices_of("blocks.1") | devices_of("blocks.2")) == 1


def test_pins_choose_the_device_order():
    model, inputs = _gpt_small()
    plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2, pin={"blocks.0": 1, "blocks.3": 0})
    assert plan.stage_devices == (1, 0), "blocks.0 runs first, so its device takes stage 0"


def test_conflicting_constraints_are_named():
    model, inputs = _gpt_small()
    with pytest.raises(autosplit.errors.InfeasiblePlanError) as err:
        autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2,
                       pin={"blocks.0": 0, "blocks.3": 1}, together=[("blocks.0", "blocks.3")])
    message = str(err.value)
    assert "keep ['blocks.0', 'blocks.3'] together" in message
    assert "pin 'blocks.0' to device 0" in message or "pin 'blocks.3' to device 1" in message


def test_conflicting_pin_and_avoid_are_named_together():
    model, inputs = _gpt_small()
    with pytest.raises(autosplit.errors.InfeasiblePlanError) as err:
        autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2,
                       pin={"blocks.1": 0}, avoid={"blocks.1": 0})
    message = str(err.value)
    assert "pin 'blocks.1' to device 0" in message and "keep 'blocks.1' off devices [0]" in message


def test_unknown_module_in_a_constraint_suggests_names():
    model, inputs = _gpt_small()
    with pytest.raises(autosplit.errors.ConstraintError, match="did you mean"):
        autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, pin={"block.1": 0})
    with pytest.raises(autosplit.errors.ConstraintError, match="matches 2 of the 2 devices"):
        autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, pin={"blocks.1": "cpu"})


def test_solver_limits_reach_the_solver_through_the_options():
    # PlanOptions.limits reaches both solvers: by default the small model is planned node by node;
    # dp_work=1 coarsens it for the pipeline objective, makespan_units=8 for the makespan one.
    model, inputs = _gpt_small()
    exact = autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2)
    assert exact.solver.units == len(exact.assignment)
    coarse = autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2, limits=SolverLimits(dp_work=1))
    assert coarse.solver.units < len(coarse.assignment)
    blocks = autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2, objective="makespan",
                            limits=SolverLimits(makespan_units=8))
    assert blocks.solver.units < len(blocks.assignment)


def test_pinned_split_still_trains_like_the_original():
    model, inputs = _gpt_small()
    split = assert_trains_like(model, ["cpu"] * 3, inputs, steps=1, pin={"blocks.0": 1})
    assert split.plan.assignment["blocks_0_attn_qkv"] == 1
