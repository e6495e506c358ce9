"""Analytic costs and what annotation records: the FLOPs of the fused LSTM kernel, in-place writes
seen from version counters, and overrides applied to a cost table."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autosplit.costtable import CostTable
from autosplit.devices import resolve_devices
from autosplit.errors import CostModelError
from autosplit.passes.capture import capture, flat_inputs
from tests.helpers import assert_trains_like


def test_module_override_total_is_kept_and_bad_overrides_are_named():
    from autosplit.passes.costs import with_overrides

    table = CostTable(
        devices=resolve_devices(["cpu"]), nodes=("a", "b", "c"), module_paths=("m.x", "m.y", "n"),
        fwd_time=((1.0,), (3.0,), (1.0,)), bwd_time=((0.0,), (0.0,), (1.0,)), state_bytes=(0, 0, 0),
        saved_bytes=(10, 30, 5), output_bytes=(1, 1, 1), edges=((0, 1), (1, 2)), order_edges=(), colocate=(),
        param_counts=(0, 0, 0),
    )
    out = with_overrides(table, {"m": {"fwd": 8.0, "saved_bytes": 4}, "c": {"bwd": 0.5}})
    assert out.fwd_time == ((2.0,), (6.0,), (1.0,))  # 8 s shared 1 : 3
    assert out.saved_bytes == (1, 3, 5) and out.bwd_time[2] == (0.5,)
    with pytest.raises(CostModelError, match=r"'blocks.9', which is neither a node nor a module"):
        with_overrides(table, {"blocks.9": {"fwd": 1.0}})
    with pytest.raises(CostModelError, match="unknown fields \\['flops'\\]"):
        with_overrides(table, {"a": {"flops": 1.0}})


class _InPlaceBlock(nn.Module):
    """torchvision's pattern: BN then ReLU(inplace=True), twice with one shape; `out += x`."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.b1(self.c1(x)))
        out = self.b2(self.c2(out))
        out += x
        return self.relu(out)


def test_in_place_writes_are_seen_from_version_counters():
    from autosplit.passes.annotate import annotate
    from autosplit.passes.annotations import node_info

    model = nn.Sequential(_InPlaceBlock(), _InPlaceBlock())
    x = torch.randn(2, 4, 8, 8)
    captured = capture(model, (x,))
    gm = annotate(captured, flat_inputs(captured, (x,), {}))  # the second block's nodes repeat the first's
    mutates = {n.name: node_info(n).mutates for n in gm.graph.nodes if n.op != "output"}
    written = {name: by for name, by in mutates.items() if by}
    assert written["_0_relu"] == ("_0_b1",) and written["_1_relu"] == ("_1_b1",), written  # a repeated node too
    assert all(len(by) == 1 for by in written.values())
    assert_trains_like(model, ["cpu"] * 3, (x,))


def test_analytic_costs_count_the_fused_lstm_kernel():
    from autosplit.passes.annotate import annotate
    from autosplit.passes.annotations import node_info

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(64, 128, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0]

    model, x = Recurrent(), torch.randn(4, 10, 64)
    captured = capture(model, (x,))
    gm = annotate(captured, flat_inputs(captured, (x,), {}))
    info = node_info(next(n for n in gm.graph.nodes if n.name == "lstm"))
    gates = 2 * 4 * 10 * (4 * 128 * 64 + 4 * 128 * 128)  # tokens × (|W_ih| + |W_hh|), multiply-adds
    assert info.fwd_flops == gates and info.bwd_flops == 2 * gates


@pytest.mark.parametrize("capture_with", ["symbolic_trace", "export"])
def test_analytic_costs_count_attention_whatever_device_the_plan_is_for(capture_with):
    """Annotation runs on CPU fake tensors, where ``scaled_dot_product_attention`` is the CPU flash kernel,
    which FlopCounterMode has no formula for: its forward and backward are counted as torch counts the GPU
    flash kernel, 4·b·h·s²·d and 10·b·h·s²·d (grouped-query: the query's heads), whatever the plan's devices —
    of the score blocks the kernel runs: under ``is_causal`` the query i sees keys 0..i, s(s+1)/2 of the s² pairs
    (the flash kernels skip the masked blocks); with a mask tensor, every block."""
    from autosplit.passes.annotate import annotate
    from autosplit.passes.annotations import node_info

    class Attention(nn.Module):
        def forward(self, q, k, v, mask=None):
            if mask is not None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    b, h, kv, s, d = 2, 8, 2, 64, 16
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, kv, s, d), torch.randn(b, kv, s, d)
    for t in (q, k, v):
        t.requires_grad_(True)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for args, pairs in (((q, k, v), s * (s + 1) // 2), ((q, k, v, mask), s * s)):
        captured = capture(Attention(), args, method=capture_with)
        gm = annotate(captured, flat_inputs(captured, args, {}))
        flops = [node_info(n) for n in gm.graph.nodes if n.op == "call_function"]
        assert sum(i.fwd_flops for i in flops) == 4 * b * h * pairs * d
        assert sum(i.bwd_flops for i in flops) == 10 * b * h * pairs * d
    from autosplit.passes.flop_formulas import causal_share

    assert causal_share(4, 4) == 10 / 16 and causal_share(2, 4) == 3 / 8 and causal_share(4, 2) == 7 / 8  # top-left aligned


def test_an_engines_attention_kernels_reach_their_own_share_of_its_gemm_efficiency():
    """An engine profile's ``attention_share``: its flash kernels run at that share of the efficiency its GEMMs reach
    (torch's SDPA is FlashAttention-2, Transformer Engine's cuDNN's own); a linear beside it is unchanged."""
    import dataclasses

    from autosplit.devices import PRESETS
    from autosplit.engine_profiles import profiled
    from autosplit.passes.annotate import annotate
    from autosplit.passes.annotations import node_info
    from autosplit.passes.time_model import node_roofline

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

        def forward(self, q, k, v):
            return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    args = tuple(torch.randn(2, 8, 1024, 64) for _ in range(3))
    captured = capture(Attention(), args, method="export")
    gm = annotate(captured, flat_inputs(captured, args, {}))
    device = profiled(PRESETS["H100-80GB"], "torch-compile")
    half = dataclasses.replace(device, attention_share=0.5)
    attention = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    linear = next(n for n in gm.graph.nodes if "linear" in str(n.target))
    flops = node_info(attention).fwd_flops
    assert node_roofline(attention, node_info(attention), device)[0] == pytest.approx(
        flops / (device.peak_flops * device.efficiency * device.attention_share) + device.launch_overhead)  # compute-bound
    assert node_roofline(attention, node_info(attention), half)[0] == pytest.approx(
        flops / (device.peak_flops * device.efficiency * 0.5) + device.launch_overhead)
    assert node_roofline(linear, node_info(linear), half) == node_roofline(linear, node_info(linear), device)


def test_analytic_costs_count_the_experts_grouped_matmul_of_transformers():
    """transformers' mixture-of-experts layers run their experts as one grouped matmul, a custom op on a CPU
    (``torch.ops.transformers.grouped_mm_fallback``) that FlopCounterMode has no formula for: each of the S
    routed rows meets one expert's (K, N) weight, 2·S·K·N forward, twice that backward, however they are routed."""
    import transformers.integrations.moe  # noqa: F401 -- registers the op

    from autosplit.passes.annotate import annotate
    from autosplit.passes.annotations import node_info

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 16, 32))

        def forward(self, rows, offs):
            return torch.ops.transformers.grouped_mm_fallback(rows, self.weight, offs)

    rows, offs = torch.randn(24, 16, requires_grad=True), torch.tensor([5, 5, 17, 24])
    captured = capture(Experts(), (rows, offs), method="export")
    gm = annotate(captured, flat_inputs(captured, (rows, offs), {}))
    (info,) = [node_info(n) for n in gm.graph.nodes if "grouped_mm" in str(n.target)]
    assert info.fwd_flops == 2 * 24 * 16 * 32 and info.bwd_flops == 2 * info.fwd_flops


@pytest.mark.parametrize("capture_with", ["symbolic_trace", "export"])
def test_an_embedding_table_read_only_by_lookups_records_the_rows_its_gradient_holds(capture_with):
    """Untied, the token table's gradient is the rows the batch looked up (with a 64-bit index each);
    tied to the output layer, whose matmul reads every row, it is dense and records none."""
    from autosplit.examples import GPT
    from autosplit.passes.annotate import annotate

    tokens = torch.randint(0, 64, (4, 8))
    for tied in (False, True):
        torch.manual_seed(0)
        model = GPT(vocab=64, d_model=16, n_layers=1, n_heads=2, max_len=8, tied=tied)
        captured = capture(model, (tokens,), method=capture_with)
        gm = annotate(captured, flat_inputs(captured, (tokens,), {}))
        rows = {n.name: n.meta["autosplit"].row_grad_bytes for n in gm.graph.nodes if n.meta["autosplit"].row_grad_bytes}
        if tied:
            assert len(rows) == 1, rows  # the position table alone: 8 positions looked up
            assert next(iter(rows.values())) == 8 * (16 * 4 + 8)
        else:
            assert sorted(rows.values()) == [8 * (16 * 4 + 8), 32 * (16 * 4 + 8)], rows  # 8 positions, 4 × 8 tokens


class _SparseTables(nn.Module):
    """A module table of 20 rows and a functional one of 200,000, both looked up with sparse=True, and a dense layer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16, sparse=True)
        self.out_w = nn.Parameter(torch.randn(200_000, 16) * 0.1)
        self.mix = nn.Linear(16, 16)

    def forward(self, tokens, candidates):
        h = self.mix(self.emb(tokens))                                    # (batch, seq, 16)
        w = torch.nn.functional.embedding(candidates, self.out_w, sparse=True)  # (1, samples, 16)
        return h @ w[0].t()


@pytest.mark.parametrize("capture_with", ["symbolic_trace", "export"])
def test_sparse_lookups_are_costed_on_their_rows(capture_with):
    """sparse=True tables: their gradient is one row and index per lookup (repeats kept, more rows
    than the table's 20 for its 32 lookups; the all-gather's estimate stays capped at the table),
    Adagrad's and SGD's steps read those rows instead of the table, and Adam, which refuses sparse
    gradients, is refused at plan time."""
    from autosplit.passes.annotate import annotate
    from autosplit.passes.costs import estimate
    from autosplit.passes.time_model import optimizer_step_time

    model = _SparseTables()
    tokens, candidates = torch.randint(0, 20, (4, 8)), torch.randint(0, 200_000, (1, 64))
    captured = capture(model, (tokens, candidates), method=capture_with)
    gm = annotate(captured, flat_inputs(captured, (tokens, candidates), {}))
    row = 16 * 4 + 8
    infos = {n.name: n.meta["autosplit"] for n in gm.graph.nodes if n.meta["autosplit"].sparse_table_bytes}
    assert sorted((i.sparse_table_bytes, i.sparse_grad_bytes, i.row_grad_bytes) for i in infos.values()) == [
        (20 * 16 * 4, 32 * row, 20 * row), (200_000 * 16 * 4, 64 * row, 64 * row)]

    devices = resolve_devices(["V100-32GB"])
    for opt in ("adagrad", "sgd"):
        table = estimate(gm, devices, optimizer=opt)
        for name, info in infos.items():  # parameters whole, gradients as rows, Adagrad's state_sum whole
            at = table.nodes.index(name)
            assert table.state_bytes[at] == info.sparse_table_bytes * (2 if opt == "adagrad" else 1) + info.sparse_grad_bytes
        big = table.nodes.index(next(name for name, info in infos.items() if info.sparse_table_bytes == 200_000 * 16 * 4))
        dense = optimizer_step_time(200_000 * 16 * 4, 1, opt, devices[0])  # the step over the whole table
        assert table.optimizer_time[big][0] < 0.3 * dense, (opt, table.optimizer_time[big][0], dense)
    with pytest.raises(CostModelError, match=r"sparse=True .* optimizer='adam'.*refuses sparse gradients.*optimizer='adagrad'"):
        estimate(gm, devices, optimizer="adam")


@pytest.mark.parametrize("case", ["gpt", "llama"])
def test_a_blocks_saving_is_what_the_graphs_saved_bytes_lose_when_it_alone_is_recomputed(case):
    """``block_saves`` comes from one pass over the graph (``_SavedTotals``), not one walk of the whole
    graph per block: on a GPT (traced, a tied head) and a transformers Llama (exported), every block's
    figure, with what it holds of the inputs it shares (``block_shared``), equals the sum :func:`saved_bytes`
    gives with that block alone recomputed, less the sum without; and the blocks' figures add up to what
    recomputing them all saves, each block a region of its own (the one after keeps the output of the one before)."""
    import autosplit
    from autosplit.compiler.costs import cost_table
    from autosplit.passes.annotations import node_info
    from autosplit.passes.memory_model import activation_bytes, saved_bytes
    from tests.layouts import gpt_case, llama_case

    torch.manual_seed(0)
    model, args, kwargs, *_ = (gpt_case if case == "gpt" else llama_case)()
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, checkpointing="auto")
    table, _ = cost_table(planner.traced, tuple(resolve_devices(["cpu"] * 2)), planner.options, micro_batches=2)
    gm = planner.traced.captured.gm
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    infos = [node_info(n) for n in nodes]
    own, *_ = activation_bytes(nodes, infos, [None, None], 2, "adam")
    whole = sum(saved_bytes(gm, nodes, infos, own)[0])
    assert len(table.blocks) >= 2
    for label, members, saves, shared in zip(table.blocks, table.block_members, table.block_saves, table.block_shared):
        assert saves - shared == whole - sum(saved_bytes(gm, nodes, infos, own, dict.fromkeys(members, 0))[0]) > 0, label
    every = {i: b for b, members in enumerate(table.block_members) for i in members}
    assert sum(table.block_saves) == pytest.approx(whole - sum(saved_bytes(gm, nodes, infos, own, every)[0]), abs=len(table.blocks))
    one_region = sum(saved_bytes(gm, nodes, infos, own, dict.fromkeys(every, 0))[0])
    assert one_region < sum(saved_bytes(gm, nodes, infos, own, every)[0]), "adjacent regions keep each other's boundary"
    if case == "llama":  # the rotary tables every layer reads: each charged 1/k, so a layer alone holds more
        assert all(shared > 0 for shared in table.block_shared), table.block_shared
