"""Manual splits as plans, in every form users write: torchtitan's even split, DeepSpeed's partition
methods, Megatron's and a balance's layer counts, ``torch.distributed.pipelining``'s split points;
checked, costed, and explained when they cannot be."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint

import autosplit
from autosplit.compiler.manual import balance_fqns, deepspeed_fqns, megatron_fqns, partition, plan_from_fqns, torchtitan_fqns
from autosplit.examples import GPT
from tests.helpers import seeded_gpt


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
    model, _, order = _planner()
    assert torchtitan_fqns(model, 2, repeated="blocks", order=order) == [
        ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "blocks.4", "blocks.5", "ln_f", "head"]
    ]
    eight = GPT(vocab=64, d_model=16, n_layers=8, n_heads=2, max_len=8)  # 10 layer weights over 4 stages: 3, 3, 2, 2
    assert torchtitan_fqns(eight, 4, repeated="blocks") == [
        ["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "blocks.4"], ["blocks.5", "blocks.6"],
        ["blocks.7", "ln_f", "head"],
    ], "torchtitan gives the early stages the layers that do not divide"
    uniform = deepspeed_fqns(model, 2, "uniform", order)
    assert [len(s) for s in uniform] == [5, 5]
    by_params = deepspeed_fqns(model, 3, "parameters", order)
    assert list(itertools.chain.from_iterable(by_params)) == list(itertools.chain.from_iterable(uniform))


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
    _, planner, _ = _planner()
    with pytest.raises(autosplit.errors.ConstraintError, match="before its input"):
        plan_from_fqns(planner, [["blocks.3", "blocks.4", "blocks.5", "ln_f", "head"], ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2"]])


def _seeded_planner(devices=2, layers=4, **options):
    model, inputs = seeded_gpt(layers)
    return model, inputs, autosplit.Planner(model, ["cpu"] * devices, example_inputs=inputs, time_limit=2, **options)


def test_split_points_cut_where_pipelining_cuts():
    _, _, planner = _seeded_planner()
    begin = planner.manual({"blocks.2": SplitPoint.BEGINNING})
    end = planner.manual({"blocks.1": SplitPoint.END})
    names = planner.manual(["blocks.2"])
    fqns = planner.manual([["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "head"]])
    assert begin.stage_of["blocks_1_out"] == 0 and begin.stage_of["blocks_2_ln1"] == 1
    assert begin.assignment == names.assignment
    # END of blocks.1 and BEGINNING of blocks.2 differ only in nodes between the two modules (none here)
    assert end.assignment == begin.assignment
    assert fqns.stage_of["blocks_2_ln1"] == 1 and fqns.step_time == pytest.approx(begin.step_time, rel=0.05)


def test_deepspeed_type_balance_and_megatron_forms():
    model, _, planner = _seeded_planner(devices=2)
    by_type = planner.manual("type:GPTBlock")
    assert by_type.solver.name == "deepspeed type:GPTBlock" and by_type.stage_of["blocks_1_out"] == 0
    assert by_type.stage_of["blocks_2_ln1"] == 1
    with pytest.raises(autosplit.errors.ConstraintError, match="matches no layer"):
        planner.manual("type:Conv")
    assert megatron_fqns(model, 3, repeated="blocks", first=1, last=1) == [
        ["wte", "wpe", "blocks.0"], ["blocks.1", "blocks.2"], ["blocks.3", "ln_f", "head"]
    ]
    with pytest.raises(autosplit.errors.ConstraintError, match="divide by the stages between"):
        megatron_fqns(model, 4, repeated="blocks", first=1, last=2)
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert balance_fqns(seq, [3, 2]) == [["0", "1", "2"], ["3", "4"]]
    with pytest.raises(autosplit.errors.ConstraintError, match="sums to 4 layers, but the model has 5"):
        balance_fqns(seq, [2, 2])
    seq_planner = autosplit.Planner(seq, ["cpu"] * 2, example_inputs=(torch.randn(4, 8),))
    balanced = seq_planner.manual([3, 2])
    assert sorted(balanced.stage_of.values()) == [0, 0, 0, 1, 1]


def test_a_split_inside_a_module_the_capture_keeps_whole_says_so():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.enc(x))

    planner = autosplit.Planner(Net(), ["cpu"] * 2, example_inputs=(torch.randn(2, 5, 16),))
    with pytest.raises(autosplit.errors.ConstraintError, match=r"'enc.self_attn' is inside 'enc', which the capture keeps as one node"):
        planner.manual({"enc.self_attn": SplitPoint.END})
    with pytest.raises(autosplit.errors.ConstraintError, match=r"names no module .* such as \['head'"):
        planner.manual([["enc"], ["haed"]])
    with pytest.raises(autosplit.errors.ConstraintError, match="at the start of the graph"):
        planner.manual({"enc": SplitPoint.BEGINNING})


def test_a_manual_split_recomputes_what_the_options_decide():
    """``checkpointing="full"`` (torchtitan's mode, a recipe's usual setting) recomputes every block of a
    hand-made split too — costed, so it holds fewer activations and computes more; ``recompute=``
    keeps the blocks it names; ``"none"`` recomputes nothing."""
    model, inputs = seeded_gpt()
    split = [["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "head"]]
    plans = {c: autosplit.Planner(model, ["cpu"] * 2, example_inputs=inputs, checkpointing=c).manual(split) for c in ("none", "full")}
    assert plans["none"].recompute == () and plans["full"].recompute == tuple(f"blocks.{i}" for i in range(4))
    for kept, full in zip(plans["none"].stages, plans["full"].stages):
        assert full.memory_activations < kept.memory_activations and full.compute > kept.compute
    some = autosplit.Planner(model, ["cpu"] * 2, example_inputs=inputs, checkpointing="full", recompute={"blocks.0": False}).manual(split)
    assert some.recompute == ("blocks.1", "blocks.2", "blocks.3")
