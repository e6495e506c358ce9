"""The API surface: options written once and checked up front, the Planner tier, and plans for
hardware that is absent or too small."""

from __future__ import annotations

import copy

import pytest
import torch

import autosplit
from tests.helpers import small_gpt


@pytest.mark.parametrize(
    ("field", "value", "legal"),
    [
        ("time_limit", -1, "> 0"),
        ("micro_batches", 0, "≥ 1"),
        ("schedule", "zigzag", "gpipe"),
        ("optimizer", "lamb", "adam"),
        ("capture", "jit", "symbolic_trace"),
        ("costs", "guessed", "analytic"),
    ],
)
def test_bad_options_fail_before_any_work_naming_the_option(field, value, legal):
    with pytest.raises(autosplit.errors.ConstraintError, match=f"option {field}=") as err:
        autosplit.PlanOptions(**{field: value})
    assert legal in str(err.value)
    model, inputs = small_gpt(4)
    with pytest.raises(autosplit.errors.ConstraintError, match=f"option {field}="):
        autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, **{field: value})


def test_unknown_option_names_the_legal_ones():
    model, inputs = small_gpt(4)
    with pytest.raises(autosplit.errors.ConstraintError, match=r"unknown option.*'shedule'.*schedule"):
        autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, shedule="1f1b")


def test_planner_captures_once_and_answers_what_if():
    model, inputs = small_gpt(4)
    reference = copy.deepcopy(model)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2)
    first = planner.plan()
    traced = planner.traced
    wider = planner.what_if(devices=["cpu"] * 3, schedule="1f1b")
    assert planner.traced is traced, "what_if reuses the captured, annotated graph"
    assert len(wider.stages) == 3 and wider.schedule == "1f1b" and wider.micro_batches == 4, "the most ≤ 4 × 3 dividing 4 rows"
    assert first.schedule == "gpipe" and len(first.stages) == 2
    split = planner.build(first)
    assert split.plan.assignment == first.assignment
    torch.testing.assert_close(split(*inputs), reference(*inputs))


def test_a_copys_share_is_captured_alone_and_is_the_graph_the_whole_batchs_share_is():
    """What a rank that runs a plan it did not make captures: its data-parallel copy's rows only (the planner of the whole
    batch captures nothing), the same graph, fingerprint and per-copy costs as the whole batch's trace at that share."""
    model, inputs = small_gpt(4)
    whole = autosplit.Planner(model, ["cpu"] * 2, example_inputs=inputs, example_target=torch.zeros(4, 8, dtype=torch.long),
                              loss_fn=lambda out, target: torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten()))
    alone = whole.share(2)
    assert not whole._traces and alone.traced.batch == 2 and alone.traced.loss.target.shape == (2, 8)
    shared = whole.traced.at_batch(2)  # the whole batch captured, then its share
    assert alone.traced.fingerprint == shared.fingerprint and alone.traced.node_names == shared.node_names
    planned, at_share = alone.plan(), whole.share(2).plan()
    assert planned.assignment == at_share.assignment and planned.step_time == pytest.approx(at_share.step_time)


def test_default_micro_batches_divide_the_batch_and_an_explicit_count_must():
    model, (tokens,) = small_gpt(4)
    six = torch.randint(0, 30, (6, 8))
    assert autosplit.plan(model, ["cpu"] * 2, example_inputs=(six,), time_limit=1).micro_batches == 6  # ≤ 8, divides 6
    assert autosplit.plan(model, ["cpu"] * 3, example_inputs=(tokens,), time_limit=1).micro_batches == 4
    with pytest.raises(autosplit.errors.ConstraintError, match=r"micro_batches=4 does not divide the batch of 6 rows.*\[1, 2, 3, 6\]"):
        autosplit.Planner(model, ["cpu"] * 2, example_inputs=(six,), micro_batches=4)


def test_plan_for_absent_hardware_and_memory_infeasibility():
    model, inputs = small_gpt()
    plan = autosplit.plan(model, ["H100-80GB"] * 2, example_inputs=inputs, time_limit=2)
    assert [d.name for d in plan.devices] == ["H100-80GB"] * 2
    with pytest.raises(autosplit.errors.DeviceError, match="presets describe hardware to plan for"):
        autosplit.autosplit(model, ["H100-80GB"] * 2, example_inputs=inputs)
    with pytest.raises(autosplit.errors.InfeasiblePlanError, match="least memory any plan needs") as err:
        autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, memory={"cpu": "40KiB"}, time_limit=2)
    assert "cap 40.00 KiB" in str(err.value)
