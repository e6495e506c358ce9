"""Tensor parallelism in the costs: one layer's terms by hand (``autosplit.passes.tp_costs``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.compiler.costs import cost_table
from autosplit.devices import PRESETS
from autosplit.engine_profiles import profiled
from autosplit.passes.tp_costs import tp_collective_time

H100 = dataclasses.replace(PRESETS["H100-80GB"], island_size=8)
W, ROWS, SEQ = 64, 4, 32


def _tables(tp: int, precision: str = "fp32"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(W), nn.Linear(W, 4 * W), nn.GELU(), nn.Linear(4 * W, W))
    planner = autosplit.Planner(model, [H100], example_inputs=(torch.randn(ROWS, SEQ, W),), precision=precision)
    whole = cost_table(planner.traced, (H100,), planner.options, micro_batches=1)[0]
    split = cost_table(planner.traced, (H100,), planner.options.replace(tensor_parallel=tp, sequence_parallel=False), micro_batches=1)[0]
    return planner.traced.tp_rules(), whole, split


def test_one_mlps_tensor_parallel_terms_by_hand():
    """LayerNorm → Linear(W, 4W) → GELU → Linear(4W, W) over tp 2: the first linear column-parallel
    (weight and bias split), the second row-parallel (its weight split, its bias whole): the pair and the
    GELU between compute and save half, the norm all of it on every rank, as the reduced output. Adam's
    16 bytes per element are held for half the split elements; the row-parallel output's forward all-reduce
    and the norm output's backward all-reduce (the column group's input) are a ring of 2 over the node's link."""
    rules, whole, split = _tables(2)
    assert rules.shards == {"1.weight": 0, "1.bias": 0, "3.weight": 1} and not rules.whole_linears
    index = {n: i for i, n in enumerate(whole.nodes)}
    norm, col, act, row = (index[n] for n in ("_0", "_1", "_2", "_3"))
    assert whole.state_bytes[col] == 16 * (W * 4 * W + 4 * W) and split.state_bytes[col] == 16 * (W * 4 * W + 4 * W) // 2
    assert split.state_bytes[row] == 16 * (4 * W * W // 2 + W)  # the row-parallel bias stays whole
    assert split.state_bytes[norm] == whole.state_bytes[norm]  # norms are never split
    activation = ROWS * SEQ * W * 4  # fp32 bytes of the hidden state
    bandwidth, latency = H100.allreduce_link(H100)
    ring = activation / bandwidth + 2 * latency  # 2·(tp−1)/tp of the bytes, 2·(tp−1) latencies
    assert tp_collective_time(activation, 2, H100, 1) == pytest.approx(ring)
    assert split.fwd_time[row][0] == pytest.approx(whole.fwd_time[row][0] / 2 + ring)
    assert split.bwd_time[norm][0] == pytest.approx(whole.bwd_time[norm][0] + ring)
    assert split.fwd_time[act][0] == pytest.approx(whole.fwd_time[act][0] / 2)
    assert split.fwd_time[norm][0] == whole.fwd_time[norm][0] and split.saved_bytes[norm] == whole.saved_bytes[norm]
    for i in (col, act):
        assert split.saved_bytes[i] == round(whole.saved_bytes[i] / 2)
    assert split.saved_bytes[row] == whole.saved_bytes[row] == activation  # the model's output, all-reduced: whole on each rank
    assert split.optimizer_time[col][0] == pytest.approx(whole.optimizer_time[col][0] / 2)


def test_a_mixed_precision_weight_copy_is_split_with_its_linear():
    """Under bf16-mixed each linear's compute copy (its weight in bf16, made once per step) is split with
    the weight: half on each of 2 ranks; the norm runs in fp32 and holds no copy."""
    _, whole, split = _tables(2, "bf16-mixed")
    index = {n: i for i, n in enumerate(whole.nodes)}
    for name, elements in (("_1", W * 4 * W), ("_3", 4 * W * W)):
        assert whole.weight_copy_bytes[index[name]] == 2 * elements and split.weight_copy_bytes[index[name]] == elements
    assert split.state_bytes[index["_1"]] == 16 * (W * 4 * W + 4 * W) // 2 + W * 4 * W


def test_fsdp2s_policy_holds_each_weights_bf16_copy_as_the_weight_is_split():
    """Under bf16-fsdp the compute copy is what FSDP2 gathers of the parameters a node owns, in bf16, biases
    and norms too: split as they are held (the row-parallel bias whole)."""
    _, whole, split = _tables(2, "bf16-fsdp")
    index = {n: i for i, n in enumerate(whole.nodes)}
    for name, whole_elements, held_elements in (("_0", 2 * W, 2 * W), ("_1", W * 4 * W + 4 * W, (W * 4 * W + 4 * W) // 2),
                                                ("_3", 4 * W * W + W, 4 * W * W // 2 + W)):
        assert whole.weight_copy_bytes[index[name]] == 2 * whole_elements, name
        assert split.weight_copy_bytes[index[name]] == 2 * held_elements, name


def test_sequence_parallelism_splits_every_nodes_activations_and_needs_every_linear_split():
    """``sequence_parallel=True`` (and ``"auto"``, where every linear is split): the norm between the split layers computes and
    saves half on each of 2 ranks too, its all-reduces as before; refused where a linear stays whole
    (the GPT's fused qkv)."""
    _, whole, split = _tables(2)
    planner = autosplit.Planner(nn.Sequential(nn.LayerNorm(W), nn.Linear(W, 4 * W), nn.GELU(), nn.Linear(4 * W, W)), [H100],
                                example_inputs=(torch.randn(ROWS, SEQ, W),))
    sp = cost_table(planner.traced, (H100,), planner.options.replace(tensor_parallel=2, sequence_parallel=True), micro_batches=1)[0]
    index = {n: i for i, n in enumerate(whole.nodes)}
    norm, row = index["_0"], index["_3"]
    assert sp.fwd_time[norm][0] == pytest.approx(whole.fwd_time[norm][0] / 2) and sp.saved_bytes[norm] == round(whole.saved_bytes[norm] / 2)
    assert sp.fwd_time[row][0] == pytest.approx(split.fwd_time[row][0]) and sp.state_bytes == split.state_bytes
    assert cost_table(planner.traced, (H100,), planner.options.replace(tensor_parallel=2), micro_batches=1)[0] == sp  # "auto"
    from tests.helpers import seeded_gpt

    gpt, inputs = seeded_gpt()
    with pytest.raises(autosplit.AutosplitError, match=r"sequence_parallel=True, and the .* rules leave .*blocks\.0\.attn\.qkv"):
        autosplit.plan(gpt, ["A100-80GB"] * 2, example_inputs=inputs, tensor_parallel=2, sequence_parallel=True)


def test_async_tp_hides_the_engines_share_of_each_collective_behind_its_gemm():
    """With ``async_tp``, the row-parallel output's all-reduce overlaps the row-parallel GEMM: of the shorter
    of the two, the device's ``tp_overlap`` share is hidden (here the GEMM is the shorter: the collective
    moves the whole output while the GEMM computes half of a 4W × W product)."""
    device = dataclasses.replace(H100, tp_overlap=0.75)
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(W), nn.Linear(W, 4 * W), nn.GELU(), nn.Linear(4 * W, W))
    planner = autosplit.Planner(model, [device], example_inputs=(torch.randn(ROWS, SEQ, W),))
    options = planner.options.replace(tensor_parallel=2, sequence_parallel=False)
    whole = cost_table(planner.traced, (device,), planner.options, micro_batches=1)[0]
    plain = cost_table(planner.traced, (device,), options, micro_batches=1)[0]
    overlapped = cost_table(planner.traced, (device,), options.replace(async_tp=True), micro_batches=1)[0]
    row = whole.nodes.index("_3")
    gemm, ring = whole.fwd_time[row][0] / 2, tp_collective_time(ROWS * SEQ * W * 4, 2, device, 1)
    assert plain.fwd_time[row][0] == pytest.approx(gemm + ring)
    assert overlapped.fwd_time[row][0] == pytest.approx(gemm + ring - 0.75 * min(gemm, ring))
    # without the engine's share (torchtitan eager: async TP needs compile), nothing is hidden
    assert cost_table(planner.traced, (H100,), options.replace(async_tp=True), micro_batches=1)[0].fwd_time[row][0] == pytest.approx(
        cost_table(planner.traced, (H100,), options, micro_batches=1)[0].fwd_time[row][0])


class _Block(nn.Module):
    """A residual MLP, pre-norm (``x + mlp(norm(x))``: its row-parallel reduction is its last op but the
    add) or post-norm (``norm(x + mlp(x))``: the norm after it saves its input)."""

    def __init__(self, post: bool):
        super().__init__()
        self.post = post
        self.norm, self.fc, self.act, self.out = nn.LayerNorm(W), nn.Linear(W, 4 * W), nn.GELU(), nn.Linear(4 * W, W)

    def forward(self, x):
        if self.post:
            return self.norm(x + self.out(self.act(self.fc(x))))
        return x + self.out(self.act(self.fc(self.norm(x))))


@pytest.mark.parametrize("post", [False, True])
def test_recomputing_blocks_under_tp_keep_partial_sums_and_run_collectives_again_by_hand(post):
    """Two residual MLPs, every block recomputed, over tp 2. Selectively, the policy keeps each matmul's
    output and each reduction's: the row-parallel linear holds its whole partial sum beside its reduced
    output (2× its output, where the split charges ½), runs nothing again (its all-reduce kept), and under
    sequence parallelism the all-gather before the column-parallel linear again (½ the node's ring time).
    Whole blocks run the all-reduce again unless it ends the block (pre-norm: torch's checkpoint stops at
    the last tensor the backward needs); post-norm, the norm after it saves its input, so it runs again."""
    model = nn.Sequential(_Block(post), _Block(post))
    planner = autosplit.Planner(model, [H100], example_inputs=(torch.randn(ROWS, SEQ, W),))
    blocks = ("0", "1")

    def table(tp: int, selective: bool, sequence: bool = False, recompute=blocks):
        options = planner.options.replace(tensor_parallel=tp, sequence_parallel=sequence, checkpointing="full", selective=selective)
        return cost_table(planner.traced, (H100,), options, micro_batches=1, recompute=recompute)[0]

    whole = table(1, True)
    row = whole.nodes.index("_0_out")
    activation = ROWS * SEQ * W * 4
    assert whole.saved_bytes[row] == activation and row in whole.recompute_keeps  # the selective cache: its output
    bandwidth, latency = H100.allreduce_link(H100)
    ring = activation / bandwidth + 2 * latency
    kept, sequence, full = table(2, True), table(2, True, sequence=True), table(2, False)
    none, none_sequence = table(2, True, recompute=()), table(2, True, sequence=True, recompute=())
    none_whole = table(1, False, recompute=())
    assert kept.saved_bytes[row] == 2 * activation
    assert sequence.saved_bytes[row] == activation + activation // 2  # the partial sum whole, the reduce-scatter's half
    # run again in the backward: selectively, no all-reduce (an all-gather under sequence parallelism); whole, the
    # all-reduce but where it ends the block
    assert kept.rerun_time[row][0] == 0 and kept.bwd_time[row][0] == pytest.approx(none.bwd_time[row][0])
    assert sequence.rerun_time[row][0] == pytest.approx(ring / 2)
    assert sequence.bwd_time[row][0] == pytest.approx(none_sequence.bwd_time[row][0] + ring / 2)
    again = table(1, False).bwd_time[row][0] - none_whole.bwd_time[row][0]  # its forward's compute
    assert full.bwd_time[row][0] == pytest.approx(none.bwd_time[row][0] + again / 2 + (ring if post else 0))
    assert full.rerun_time[row][0] == pytest.approx(full.fwd_time[row][0] - (0 if post else ring))



def _float8_tables(recipe: str, *, sequence_parallel: bool, device=H100):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(W), nn.Linear(W, 4 * W), nn.GELU(), nn.Linear(4 * W, W))
    planner = autosplit.Planner(model, [device], example_inputs=(torch.randn(ROWS, SEQ, W),), precision="bf16-mixed",
                                float8=recipe, float8_exclude=())
    whole = cost_table(planner.traced, (device,), planner.options, micro_batches=1)[0]
    options = planner.options.replace(tensor_parallel=2, sequence_parallel=sequence_parallel)
    return planner.traced.tp_rules(), whole, cost_table(planner.traced, (device,), options, micro_batches=1)[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchaos_fp8_under_tp_casts_each_whole_operand_on_every_rank_by_hand(recipe):
    """torchao's linears gather their activations in bf16, so each of 2 ranks casts a whole operand: the
    column-parallel linear its whole input (2.5 bytes a byte forward, 1 for the weight gradient's transposed
    copy), the row-parallel one its whole output gradient (2.5): that cast once, the rest of the node halved."""
    rules, whole, split = _float8_tables(recipe, sequence_parallel=False)
    assert split.float8_linears == ("1", "3")
    col, row = whole.nodes.index("_1"), whole.nodes.index("_3")
    hidden = ROWS * SEQ * W * 2  # bf16 bytes of the column-parallel input and of the row-parallel output

    def cast(traffic: float) -> float:
        return traffic / (H100.memory_bandwidth * (H100.memory_efficiency or H100.efficiency))

    ring = tp_collective_time(rules.forward_collectives["_3"], 2, H100, 1)
    assert split.fwd_time[col][0] == pytest.approx(whole.fwd_time[col][0] / 2 + cast(2.5 * hidden) / 2)
    assert split.bwd_time[col][0] == pytest.approx(whole.bwd_time[col][0] / 2 + cast(1.0 * hidden) / 2)
    assert split.fwd_time[row][0] == pytest.approx(whole.fwd_time[row][0] / 2 + ring)
    assert split.bwd_time[row][0] == pytest.approx(whole.bwd_time[row][0] / 2 + cast(2.5 * hidden) / 2)


def test_transformer_engine_under_sequence_parallelism_gathers_fp8_by_hand():
    """Transformer Engine casts a layer's input to FP8 in the norm before it gathers it: no cast is repeated, and
    each sequence-parallel collective beside an FP8 linear (the row-parallel output's, forward; the column group's
    input's, backward) is a bf16 reduce-scatter and an FP8 all-gather: ¾ of the bf16 ring. Without sequence
    parallelism nothing is gathered, and the all-reduce stays bf16."""
    te = profiled(H100, "megatron-te")
    rules, whole, split = _float8_tables("tensorwise", sequence_parallel=True, device=te)
    norm, col, row = (whole.nodes.index(n) for n in ("_0", "_1", "_3"))
    forward, backward = (tp_collective_time(c[name], 2, te, 1) for c, name in
                         ((rules.forward_collectives, "_3"), (rules.backward_collectives, "_0")))
    assert split.fwd_time[row][0] == pytest.approx(whole.fwd_time[row][0] / 2 + 0.75 * forward)
    assert split.bwd_time[norm][0] == pytest.approx(whole.bwd_time[norm][0] / 2 + 0.75 * backward)
    assert split.fwd_time[col][0] == pytest.approx(whole.fwd_time[col][0] / 2)
    _, whole, plain = _float8_tables("tensorwise", sequence_parallel=False, device=te)
    assert plain.fwd_time[row][0] == pytest.approx(whole.fwd_time[row][0] / 2 + forward)
    assert plain.fwd_time[col][0] == pytest.approx(whole.fwd_time[col][0] / 2)
