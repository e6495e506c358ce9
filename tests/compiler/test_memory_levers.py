"""Precision and activation checkpointing as decisions of the plan: what each changes in the cost
model, the plans they give, and the errors that refuse what would train differently."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autosplit
from autosplit.compiler.trace import trace
from autosplit.devices import resolve_devices
from autosplit.errors import ConstraintError, CostModelError, PlanFileError
from autosplit.examples import gpt
from autosplit.passes.annotations import node_info
from autosplit.passes.costs import estimate
from tests.helpers import says


@pytest.fixture(scope="module")
def example():
    ex = gpt(batch=8)
    return ex["model"], ex["example_inputs"]


def _infos(gm):
    return {n.name: node_info(n) for n in gm.graph.nodes if n.op not in ("placeholder", "output")}


def test_precision_changes_dtypes_state_and_time(example):
    model, x = example
    traced = trace(model, x, {}, method="auto")
    fp32 = _infos(traced.captured.gm)
    gpu, cpu = _infos(traced.annotated("bf16-mixed", "cuda")), _infos(traced.annotated("bf16-mixed", "cpu"))
    bf16 = _infos(traced.annotated("bf16", "cuda"))
    qkv = "blocks_0_attn_qkv"
    assert gpu[qkv].half and not fp32[qkv].half
    assert gpu[qkv].output_bytes == fp32[qkv].output_bytes // 2  # a Linear under autocast outputs bf16
    # CUDA's autocast runs softmax in fp32; CPU's leaves it in bf16.
    assert gpu["softmax"].output_bytes == fp32["softmax"].output_bytes == 2 * cpu["softmax"].output_bytes
    # Master weights stay fp32 under mixed precision; a bf16 model holds half the bytes.
    assert sum(i.param_bytes for i in gpu.values()) == sum(i.param_bytes for i in fp32.values())
    assert 2 * sum(i.param_bytes for i in bf16.values()) == sum(i.param_bytes for i in fp32.values())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # planning never casts the user's model

    # Master weights stay fp32 under mixed precision, and the compute copy autocast makes is held once per step.
    plans = {p: autosplit.plan(model, ["H100-80GB"] * 2, example_inputs=x, precision=p, micro_batches=1, time_limit=2)
             for p in ("fp32", "bf16-mixed", "bf16")}
    assert all(plan.precision == p for p, plan in plans.items())
    state = {p: sum(s.memory_state for s in plan.stages) for p, plan in plans.items()}
    acts = {p: sum(s.memory_activations for s in plan.stages) for p, plan in plans.items()}
    copies = sum(i.weight_copy_bytes for i in gpu.values())
    assert copies > 0 and state["bf16-mixed"] == pytest.approx(state["fp32"] + copies, abs=4096)
    assert state["bf16"] * 2 == pytest.approx(state["fp32"], rel=0.01)
    assert acts["bf16"] < acts["bf16-mixed"] < acts["fp32"]
    compute = {p: sum(s.compute for s in plan.stages) for p, plan in plans.items()}
    assert compute["bf16-mixed"] < compute["fp32"]
    assert "bf16-mixed" in str(autosplit.report.text.plan_report(plans["bf16-mixed"]))


def test_autocast_weight_copy_is_held_once_per_step_whatever_the_micro_batches(example):
    """torch.autocast casts a weight again in every region it is entered for, and the matmul saves
    that copy: a stage entering it per micro-batch would hold M copies. Inside one outer region held
    open for the step (autocast disabled there), its cache gives every micro-batch the same copy; the
    cost table charges that one copy with the model state, whatever the micro-batches."""
    lin = nn.Linear(64, 64)

    def copies_saved(outer: bool) -> int:
        copies: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.bfloat16 and t.numel() == lin.weight.numel():
                copies.add(t.untyped_storage().data_ptr())
            return t

        held = []
        step = torch.autocast("cpu", dtype=torch.bfloat16, enabled=False) if outer else contextlib.nullcontext()
        with step, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    held.append(lin(torch.randn(8, 64, requires_grad=True)))  # a stage's input: its gradient is needed
        return len(copies)

    assert (copies_saved(outer=False), copies_saved(outer=True)) == (4, 1)

    model, x = example
    gm = trace(model, x, {}, method="auto").annotated("bf16-mixed", "cuda")
    infos = _infos(gm)
    qkv = infos["blocks_0_attn_qkv"]
    assert qkv.weight_copy_bytes == 2 * model.blocks[0].attn.qkv.weight.numel()  # the bf16 copy of its weight (the bias is not saved)
    assert _infos(trace(model, x, {}, method="auto").captured.gm)["blocks_0_attn_qkv"].weight_copy_bytes == 0  # fp32: none
    tables = {M: estimate(gm, resolve_devices(["H100-80GB"]), micro_batches=M) for M in (1, 4)}
    n = tables[1].nodes.index("blocks_0_attn_qkv")
    assert tables[4].saved_bytes[n] == tables[1].saved_bytes[n] == qkv.saved_bytes - qkv.weight_copy_bytes
    assert tables[4].state_bytes[n] == tables[1].state_bytes[n] and tables[1].weight_copy_bytes[n] == qkv.weight_copy_bytes


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 256, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_attention_saves_the_log_sum_exp_not_the_probabilities():
    """On the meta device torch runs attention's math path, which keeps (B, H, L, L) probabilities;
    the fused kernels training runs keep the log-sum-exp: the meta model is costed like the real one."""
    saved = {}
    for device in ("cpu", "meta"):
        with torch.device(device):
            model, x = Attention(), torch.randn(2, 256, 32)
        info = _infos(trace(model, (x,), {}, method="auto").captured.gm)["scaled_dot_product_attention"]
        saved[device] = info.saved_bytes
    assert saved["meta"] == saved["cpu"] < 2 * 4 * 256 * 256 * 4  # less than one fp32 probability matrix


def test_auto_checkpointing_fits_where_keeping_does_not(example):
    model, x = example
    common = dict(example_inputs=x, schedule="1f1b", memory={0: "5MiB", 1: "5MiB"}, time_limit=5)
    with pytest.raises(autosplit.errors.InfeasiblePlanError):
        autosplit.plan(model, ["cpu"] * 2, checkpointing="none", **common)
    auto = autosplit.plan(model, ["cpu"] * 2, checkpointing="auto", gap=0.0, **common)  # proven, not only certified within 1%
    full = autosplit.plan(model, ["cpu"] * 2, checkpointing="full", **common)
    assert 0 < len(auto.recompute) < len(full.recompute) == 8
    assert auto.solver.status == "OPTIMAL"
    assert auto.step_time < full.step_time
    assert all(s.memory <= s.capacity for s in auto.stages)
    assert sum(len(s.recompute) for s in auto.stages) == len(auto.recompute)
    assert all(s.recompute_saves > 0 for s in full.stages)
    # A recomputing stage's backward includes its blocks' forward again (not the embeddings' or the head's).
    kept = autosplit.plan(model, ["cpu"] * 2, example_inputs=x, schedule="1f1b", time_limit=5)
    backward, forward = sum(s.backward for s in kept.stages), sum(s.forward for s in kept.stages)
    assert backward + 0.9 * forward < sum(s.backward for s in full.stages) < backward + forward
    report = autosplit.report.text.plan_report(auto)
    assert "recomputes" in report and "of activations not held" in report


def test_recompute_pins_and_saved_plans(example, tmp_path):
    model, x = example
    plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=x, schedule="1f1b", checkpointing="auto",
                          recompute={"blocks.0": True, "blocks.7": False}, memory={0: "5MiB", 1: "5MiB"}, time_limit=5)
    assert "blocks.0" in plan.recompute and "blocks.7" not in plan.recompute
    plan.save(tmp_path / "plan.json")
    again = autosplit.Planner(model, None, example_inputs=x).plan(tmp_path / "plan.json")
    assert again.recompute == plan.recompute
    assert [s.memory for s in again.stages] == [s.memory for s in plan.stages]
    assert again.step_time == pytest.approx(plan.step_time)


def test_a_block_keeps_the_micro_batches_memory_holds(example, tmp_path):
    """GPipe holds all 4 micro-batches on each stage: under a cap that keeps no block whole, some keep a
    share of their micro-batches, faster than recomputing them whole; the plan says which, and keeps it."""
    model, x = example
    common = dict(example_inputs=x, schedule="gpipe", micro_batches=4, memory={0: "7MiB", 1: "7MiB"}, time_limit=5)
    auto = autosplit.plan(model, ["cpu"] * 2, checkpointing="auto", **common)
    full = autosplit.plan(model, ["cpu"] * 2, checkpointing="full", **common)
    assert auto.recompute_partial and all(p.block in auto.recompute and p.window == 4 and 0 < p.keep < 4 for p in auto.recompute_partial)
    assert auto.step_time < full.step_time and all(s.memory <= s.capacity for s in auto.stages)
    stage = {p.block: s for s, st in enumerate(auto.stages) for p in auto.recompute_partial if p.block in st.recompute}
    for p in auto.recompute_partial:  # a stage whose blocks keep some micro-batches saves less than recomputing them all
        assert auto.stages[stage[p.block]].recompute_saves < full.stages[stage[p.block]].recompute_saves
    report = autosplit.report.text.plan_report(auto)
    first = auto.recompute_partial[0]
    assert f"{first.block} keeps micro-batch i's activations where i mod 4 < {first.keep}" in report
    auto.save(tmp_path / "plan.json")
    again = autosplit.Planner(model, None, example_inputs=x, schedule="gpipe", micro_batches=4).plan(tmp_path / "plan.json")
    assert again.recompute_partial == auto.recompute_partial and again.step_time == pytest.approx(auto.step_time)
    built = autosplit.Planner(model, None, example_inputs=x, schedule="gpipe", micro_batches=4).build(again)
    assert any(f"keep = {first.keep}, window = 4" in stage.code for stage in built.stages)
    data = json.loads((tmp_path / "plan.json").read_text())
    data["recompute_partial"][0]["keep"] = 4  # keeping every micro-batch is not recomputing: an edited file
    with pytest.raises(PlanFileError, match="recompute_partial"):
        autosplit.Plan.from_dict(data)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, x):
        return x + self.bn(self.lin(x))


class BatchNormStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(Residual() for _ in range(4)))

    def forward(self, x):
        return self.blocks(x).sum()


def test_refusals(example):
    model, x = example
    with pytest.raises(ConstraintError) as e:
        autosplit.plan(model, ["cpu"] * 2, example_inputs=x, recompute={"blocks.9": True})
    says(e, "blocks.9")
    with pytest.raises(ConstraintError) as e:
        autosplit.plan(model, ["cpu"] * 2, example_inputs=x, recompute={"blocks.0.attn": True})
    says(e, "blocks.0.attn", "blocks.0")
    with pytest.raises(ConstraintError) as e:
        autosplit.plan(model, ["cpu"] * 2, example_inputs=x, schedule="zbvzerobubble", checkpointing="auto")
    says(e, "checkpointing", "zbvzerobubble")
    with pytest.raises(CostModelError) as e:
        autosplit.plan(model, ["cpu"] * 2, example_inputs=x, precision="bf16", costs="measured")
    says(e, "measured", "'bf16'", "bf16-mixed")
    net = BatchNormStack()
    with pytest.raises(ConstraintError) as e:
        autosplit.plan(net, ["cpu"] * 2, example_inputs=(torch.randn(8, 16),), recompute={"blocks.1": True})
    says(e, "blocks.1", "running statistics")
    full = autosplit.plan(net, ["cpu"] * 2, example_inputs=(torch.randn(8, 16),), checkpointing="full")
    assert full.recompute == ()  # BatchNorm's blocks are kept: recomputing would move its statistics twice
