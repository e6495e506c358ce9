"""Manual splits as plans: torchtitan's even split, DeepSpeed's partition methods, checked and costed."""

from __future__ import annotations

import pytest
import torch

import autosplit
from autosplit.compiler.manual import deepspeed_fqns, partition, plan_from_fqns, torchtitan_fqns
from autosplit.examples import GPT


def test_partition_minimises_the_largest_stage():
    assert partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert partition([1, 2, 3, 4, 5], 3) == [(0, 3), (3, 4), (4, 5)]
    with pytest.raises(autosplit.errors.ConstraintError, match="cannot cut 2 layers into 3"):
        partition([1, 1], 3)


def _planner(stages=2):
    model = GPT(vocab=64, d_model=16, n_layers=6, n_heads=2, max_len=8)
    planner = autosplit.Planner(model, ["cpu"] * stages, example_inputs=(torch.randint(0, 64, (4, 8)),), time_limit=2)
    return model, planner, list(planner.traced.captured.module_paths.values())


def test_manual_splits_in_the_forms_users_write():
    model, planner, order = _planner()
    assert torchtitan_fqns(model, 2, repeated="blocks", order=order) == [
        ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "blocks.4", "blocks.5", "ln_f", "head"]
    ]
    uniform = deepspeed_fqns(model, 2, "uniform", order)
    assert [len(s) for s in uniform] == [5, 5]
    by_params = deepspeed_fqns(model, 3, "parameters", order)
    assert sum(by_params, []) == sum(uniform, [])


def test_a_manual_split_is_a_checked_costed_plan_that_autosplit_beats_or_ties():
    model, planner, order = _planner()
    manual = plan_from_fqns(planner, torchtitan_fqns(model, 2, repeated="blocks", order=order))
    auto = planner.plan()
    assert manual.solver.name == "manual" and manual.terms is not None
    assert {manual.stage_of[n] for n in manual.assignment} == {0, 1}
    assert manual.stage_of["blocks_3_ln1"] == 1 and manual.stage_of["wte_weight"] == 0
    assert auto.step_time <= manual.step_time * (1 + 1e-9), "same cost model: the solver's plan is no worse"
    split = planner.build(manual)  # and it runs
    assert split(torch.randint(0, 64, (4, 8))).shape == (4, 8, 64)


def test_a_split_against_the_data_flow_is_explained():
    model, planner, _ = _planner()
    with pytest.raises(autosplit.errors.ConstraintError, match="before its input"):
        plan_from_fqns(planner, [["blocks.3", "blocks.4", "blocks.5", "ln_f", "head"], ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2"]])
