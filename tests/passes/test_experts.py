"""Mixture-of-experts layers found as expert groups, and expert parallelism in the costs and the mesh search.

The four families of ``tests/moe_cases.py`` (Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS) are captured faithfully —
split over two devices they train like the unsplit model in float64 — and each MoE layer's experts are one group:
the stacked module, not the router beside it, with its top k, its tokens and their width. The expert-parallel terms
are checked by hand on a planted table, the all-to-all on two sizes and two domains."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import autosplit
from autosplit.costtable import CostTable
from autosplit.devices import PRESETS
from autosplit.engine_profiles import FITTED, profiled
from autosplit.errors import ConstraintError, ExportError
from autosplit.passes.ep_costs import alltoall_time, ep_laid_out
from autosplit.passes.experts import ExpertGroup
from autosplit.passes.sharding import laid_out
from tests.helpers import NO_SEARCH, engine_round_trip, where
from tests.moe_cases import EXPERTS, FAMILIES, MOE_LAYERS, TOP_K, ids, moe_model

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_moe_layer_is_one_expert_group_and_the_split_trains_like_the_model(family):
    model = moe_model(family).double()
    reference = copy.deepcopy(model)
    x = ids()
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(x,), example_kwargs={"labels": x}, **NO_SEARCH)
    groups = planner.traced.expert_groups()
    assert len(groups) == MOE_LAYERS[family]
    for g in groups:
        assert g.module.endswith("mlp.experts") and (g.experts, g.top_k) == (EXPERTS, TOP_K)
        assert (g.tokens, g.hidden, g.itemsize) == (x.numel(), 32, 8)  # every token of the batch, float64 rows
        assert {p.rpartition(".")[2] for p in g.params} >= {"gate_up_proj", "down_proj"}
        assert not any("gate.weight" in p or "router" in p for p in g.params), "the router is not an expert"
        assert any("mm" in name for name in g.nodes), f"{g.module}: the experts' matmul is in the group"
    split = planner.build()
    assert len(set(split.plan.assignment.values())) == 2
    opt, ref_opt = torch.optim.AdamW(split.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        x = ids(seed=step)
        out, expected = split(x, labels=x), reference(x, labels=x, use_cache=False)
        torch.testing.assert_close(out.loss, expected.loss, msg=where(f"{family} step {step} loss"))
        out.loss.backward()
        expected.loss.backward()
        for (name, p), q in zip(split.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=where(f"{family} step {step} gradient of {name}"))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()


def _device(island: int | None = 8):
    return dataclasses.replace(PRESETS["H100-80GB"], island_size=island, link_bandwidth=400e9, link_latency=4e-6,
                               network_bandwidth=50e9, network_latency=10e-6)


def test_the_all_to_all_by_hand_inside_an_island_and_across_islands():
    d, n = _device(), 64e6
    assert alltoall_time(n, 1, d) == 0.0
    assert alltoall_time(n, 8, d, calls=2) == pytest.approx(7 / 8 * n / 400e9 + 2 * 4e-6)  # NVLink only
    assert alltoall_time(n, 4, d) == pytest.approx(3 / 4 * n / 400e9 + 4e-6)
    # 32 ranks over 4 islands: 7/32 of the rows over NVLink while 24/32 cross the network, at once
    assert alltoall_time(n, 32, d) == pytest.approx(max(7 / 32 * n / 400e9, 24 / 32 * n / 50e9) + 10e-6)


def _table(device) -> CostTable:
    """Three nodes: a router (dense), the experts (stacked parameters), a residual add."""
    return CostTable(
        devices=(device,), nodes=("router", "experts", "add"), module_paths=("mlp.gate", "mlp.experts", ""),
        fwd_time=((1e-3,), (8e-3,), (1e-4,)), bwd_time=((2e-3,), (16e-3,), (1e-4,)),
        state_bytes=(400, 16_000, 0), saved_bytes=(100, 1000, 10), output_bytes=(100, 1000, 10), edges=((0, 1), (1, 2)),
        order_edges=(), colocate=(), param_counts=(25, 1000, 0), param_bytes=(100, 4000, 0),
        optimizer_time=((1e-4,), (4e-3,), (0.0,)), step_bytes=(200, 8000, 0),
    )


def test_expert_parallel_costs_by_hand():
    """ep 4 on dp_shard 4: the experts' node holds E/4 experts whole (what FSDP gathers) and its sharded state whole
    here (laid_out divides it by dp_shard after); per micro-batch a dispatch and a combine each way, of T·k·h bytes."""
    d = _device()
    group = ExpertGroup("mlp.experts", experts=8, top_k=2, params=("mlp.experts.w",), nodes=("experts",), tokens=1024,
                        hidden=512, itemsize=2)
    numel = {"mlp.gate.weight": 25, "mlp.experts.w": 1000}
    owners = {"router": ("mlp.gate.weight",), "experts": ("mlp.experts.w",)}
    table = ep_laid_out(_table(d), [group], ep=4, tp=1, micro_batches=2, numel=numel, owners=owners)
    exchange = 3 / 4 * 1024 * 2 * 512 * 2 / 400e9 + 2 * 4e-6  # the whole batch's bytes over two micro-batches' calls
    assert table.fwd_time[1][0] == pytest.approx(8e-3 + 2 * exchange)  # dispatch and combine
    assert table.bwd_time[1][0] == pytest.approx(16e-3 + 2 * exchange)
    assert table.fwd_time[0] == (1e-3,) and table.state_bytes[0] == 400  # the router stays dense
    assert table.param_bytes == (100, 1000, 0) and table.param_counts == (25, 250, 0)  # 2 of the 8 experts
    assert table.state_bytes[1] == 16_000 and table.optimizer_time[1][0] == pytest.approx(4e-3)  # sharded by laid_out
    # under tp 2 (no sequence parallelism), the tokens of a tp group are split before they are dispatched
    tp2 = ep_laid_out(_table(d), [group], ep=4, tp=2, micro_batches=2, numel=numel, owners=owners)
    assert tp2.fwd_time[1][0] == pytest.approx(4e-3 + 2 * (exchange - 2 * 4e-6) / 2 + 2 * 2 * 4e-6)
    assert tp2.state_bytes[1] == 8000 and tp2.saved_bytes[1] == 500
    # under cp 2 a rank holds half of each sequence (cp_laid_out has cut its compute): it dispatches half the rows
    cp2 = ep_laid_out(_table(d), [group], ep=4, tp=1, micro_batches=2, numel=numel, owners=owners, cp=2)
    assert cp2.fwd_time[1][0] == pytest.approx(8e-3 + 2 * ((exchange - 2 * 4e-6) / 2 + 2 * 4e-6))
    # the optimizer steps the experts' state as a rank holds it: over tp here, over dp_shard by laid_out
    assert table.step_bytes == (200, 8000, 0) and tp2.step_bytes == (200, 4000, 0)
    sharded = laid_out(table, dp_shard=4, precision="bf16-fsdp")
    assert sharded.step_bytes == (50, 2000, 0) and sharded.peaks == (50, 2000, 0)
    assert ep_laid_out(_table(d), [group], ep=1, tp=1, micro_batches=2, numel=numel, owners=owners) == _table(d)


def test_an_explicit_ep_is_honoured_or_refused_in_the_users_terms():
    model, x = moe_model("qwen3_moe"), ids(rows=4)
    planner = autosplit.Planner(model, ["cpu"] * 4, example_inputs=(x,), micro_batches=1, schedule="gpipe", data_parallel=4,
                                replicate="fully_shard")  # one capture for every plan below
    plan = planner.what_if(expert_parallel=2)
    assert plan.expert_parallel == 2 and "experts over ep 2" in plan.costs
    whole = planner.plan()
    assert plan.stages[0].memory < whole.stages[0].memory, "each rank gathers 2 of the 4 experts, not all"
    with pytest.raises(ConstraintError, match=r"4 experts do not divide over ep 3.*one of \[1, 2, 4\]"):
        planner.what_if(expert_parallel=3)
    with pytest.raises(ConstraintError, match=r"expert_parallel=2 divides no configuration's dp_shard × tp over 4 devices"):
        planner.what_if(replicate="replicate", expert_parallel=2)
    from tests.layouts import gpt_case

    gpt, gpt_args, *_ = gpt_case()
    with pytest.raises(ConstraintError, match="no mixture-of-experts layer"):
        autosplit.plan(gpt, ["cpu"] * 2, example_inputs=gpt_args, data_parallel=2, replicate="fully_shard", expert_parallel=2)
    assert autosplit.Plan.from_dict(plan.to_dict()).expert_parallel == 2
    # a plan the runtime does not run is refused before any work (ep 2 of dp_shard 4 runs: tests/runtime/test_expert_parallel.py)
    recomputing = planner.what_if(devices=["cpu"] * 2, data_parallel=2, expert_parallel=2, checkpointing="full")
    with pytest.raises(ConstraintError, match=r"2 block\(s\) recomputed.*checkpointing='none'"):  # the experts in a module of its own
        autosplit.distribute(model, None, example_inputs=(x,), loss_fn=lambda out, _: out.logits.sum(), plan=recomputing)


def test_auto_chooses_ep_with_the_other_degrees_and_lists_what_it_tried():
    model, x = moe_model("mixtral"), ids(rows=4)
    plan = autosplit.plan(model, ["cpu"] * 4, example_inputs=(x,), data_parallel=4, replicate="fully_shard",
                          expert_parallel="auto", micro_batches=1, schedule="gpipe")
    assert {a.expert_parallel for a in plan.alternatives} == {1, 2, 4}
    assert plan.expert_parallel == min(plan.alternatives, key=lambda a: a.step_time).expert_parallel


def test_the_all_to_alls_sit_beside_the_experts_work_and_an_engine_hides_its_share_behind_another_micro_batch():
    """An exported graph takes the stacked parameters first: the exchanges go beside the experts' work, not there.
    Under ``overlap`` (Megatron's batch-level overlap), the device's share of the shorter of the layer's four exchanges
    and its compute (forward and backward of every node up to the experts') is hidden."""
    d = dataclasses.replace(_device(), ep_overlap=0.5)
    base = _table(d)
    table = dataclasses.replace(base, nodes=("w", *base.nodes), module_paths=("mlp.experts", *base.module_paths),
                                fwd_time=((0.0,), *base.fwd_time), bwd_time=((0.0,), *base.bwd_time),
                                state_bytes=(0, *base.state_bytes), saved_bytes=(0, *base.saved_bytes),
                                output_bytes=(0, *base.output_bytes), edges=((0, 2), (1, 2), (2, 3)),
                                param_counts=(0, *base.param_counts), param_bytes=(0, *base.param_bytes),
                                optimizer_time=((0.0,), *base.optimizer_time), step_bytes=(0, *base.step_bytes))
    group = ExpertGroup("mlp.experts", experts=8, top_k=2, params=("mlp.experts.w",), nodes=("w", "experts"), tokens=1024,
                        hidden=512, itemsize=2)
    numel = {"mlp.gate.weight": 25, "mlp.experts.w": 1000}
    owners = {"router": ("mlp.gate.weight",), "experts": ("mlp.experts.w",)}
    exchange = 3 / 4 * 1024 * 2 * 512 * 2 / 400e9 + 2 * 4e-6
    plain = ep_laid_out(table, [group], ep=4, tp=1, micro_batches=2, numel=numel, owners=owners)
    assert plain.fwd_time[0] == (0.0,) and plain.fwd_time[2][0] == pytest.approx(8e-3 + 2 * exchange)
    overlapped = ep_laid_out(table, [group], ep=4, tp=1, micro_batches=2, numel=numel, owners=owners, overlap=True)
    compute = 1e-3 + 2e-3 + 8e-3 + 16e-3  # the router's and the experts' forward and backward
    assert 4 * exchange < compute  # the exchanges are the shorter: half of them hidden
    assert overlapped.fwd_time[2][0] == pytest.approx(8e-3 + exchange) and overlapped.bwd_time[2][0] == pytest.approx(16e-3 + exchange)
    slow = dataclasses.replace(d, link_bandwidth=1e8)  # exchanges longer than the layer: half the compute's worth hidden
    over = ep_laid_out(dataclasses.replace(table, devices=(slow,)), [group], ep=4, tp=1, micro_batches=2, numel=numel, owners=owners,
                       overlap=True)
    exchanged = 4 * (3 / 4 * 1024 * 2 * 512 * 2 / 1e8 + 2 * 4e-6)
    assert exchanged > compute
    assert sum(over.fwd_time[i][0] + over.bwd_time[i][0] for i in range(4)) == pytest.approx(compute + 1e-4 * 2 + exchanged - compute / 2)
    assert profiled(PRESETS["H100-80GB"], "megatron-te").ep_overlap == FITTED["megatron-te.ep_overlap"].value
    assert profiled(PRESETS["H100-80GB"], "torch-compile").ep_overlap == 0.0  # torchtitan dispatches each micro-batch in turn


def test_ep_goes_to_both_engines_and_reads_back_as_the_same_plan(tmp_path):
    model, x = moe_model("qwen3_moe"), ids(rows=8)
    planner = autosplit.Planner(model, ["cpu"] * 8, example_inputs=(x,))
    plan = planner.manual(autosplit.Recipe([["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]],
                                           data_parallel=4, replicate="fully_shard", expert_parallel=4,
                                           options=dict(micro_batches=2, schedule="1f1b")))
    flags, toml = engine_round_trip(planner, plan, tmp_path)
    assert "--expert-model-parallel-size 4" in flags and "--expert-tensor-parallel-size 1" in flags
    assert "expert_parallel_degree = 4" in toml
    assert "config.parallelism.expert_parallel_degree = 4" in plan.export("torchtitan", form="python")
    with pytest.raises(ConstraintError, match="splits each expert over 2 ranks"):
        planner.manual("megatron:" + flags.replace("--expert-tensor-parallel-size 1", "--expert-tensor-parallel-size 2"))
    # Megatron's batch-level overlap of the all-to-alls: read, costed, written back; torchtitan has no such form
    overlapped = planner.manual("megatron:" + flags + " --overlap-moe-expert-parallel-comm --delay-wgrad-compute")
    assert overlapped.ep_overlap and not plan.ep_overlap and autosplit.Plan.from_dict(overlapped.to_dict()).ep_overlap
    assert {"--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"} <= set(overlapped.export("megatron").split())
    with pytest.raises(ExportError, match="torchtitan dispatches each micro-batch's tokens in turn"):
        overlapped.export("torchtitan")


def test_the_grouped_matmul_of_the_experts_counts_its_flops_on_the_meta_device():
    """On the meta device transformers runs its experts with torch's ``_grouped_mm``, which torch's flop counter has no
    formula for: each of the S = T·k routed rows meets one expert, 2·S·K·N forward, twice that backward (the weight
    gradients' grouped matmul of two 2-D operands counted once per row, not once per expert)."""
    with torch.device("meta"):
        model = moe_model("qwen3_moe")
    model.config._experts_implementation = "grouped_mm"
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(autosplit.Spec((2, 8), torch.long),), **NO_SEARCH)
    from autosplit.passes.annotations import node_info

    gm = planner.traced.annotated("fp32", "cpu")
    grouped = [node_info(n) for n in gm.graph.nodes if "grouped_mm" in str(n.target)]
    rows = 2 * 8 * TOP_K
    assert len(grouped) == 2 * MOE_LAYERS["qwen3_moe"]
    for i, info in enumerate(grouped):
        (out,) = info.output_shapes
        inner = 32 if i % 2 == 0 else 16  # each layer's gate_up (h 32 → 2·I 32), then its down (I 16 → h 32)
        assert out == (rows, 32) and info.fwd_flops == 2 * rows * inner * 32 and info.bwd_flops == 2 * info.fwd_flops


def test_a_rank_of_an_ep_group_reads_its_own_experts_weights_and_fp8_where_its_engine_runs_them():
    """A grouped matmul reads each expert's weight it holds once per call, whatever its rows: at ep 4 a quarter of the
    stacked weight and all of its routed rows (half of them under tp 2: a tp group's tokens are split); a recomputing
    block's backward runs that forward again. Transformer Engine runs it in FP8 under an FP8 recipe; torchao's linears
    (autosplit's runtime) leave it bf16. By hand, then on a captured graph, whose node times the terms reproduce."""
    d = _device()
    group = ExpertGroup("mlp.experts", experts=8, top_k=2, params=("mlp.experts.w",), nodes=("experts",), tokens=1024,
                        hidden=512, itemsize=2)
    numel, owners = {"mlp.experts.w": 1000}, {"experts": ("mlp.experts.w",)}
    terms = (2e-3, 1e-3, 8e-3, 0.0, 0.0, 1e-5, 4e-3, 2e-3, 16e-3, 0.0, 0.0, 1e-5)  # compute, rows, weight, casts ×2, launches
    table = dataclasses.replace(_table(d), expert_gemms=((1, 0.5, (terms,)),))
    exchange = 3 / 4 * 1024 * 2 * 512 * 2 / 400e9 + 2 * 4e-6
    ep4 = ep_laid_out(table, [group], ep=4, tp=1, micro_batches=2, numel=numel, owners=owners)
    forward = max(2e-3, 1e-3 + 8e-3 / 4) + 1e-5  # bound by the bytes: the rows', a quarter of the weights'
    assert ep4.fwd_time[1][0] == pytest.approx(forward + 2 * exchange)
    assert ep4.bwd_time[1][0] == pytest.approx(max(4e-3, 2e-3 + 16e-3 / 4) + 1e-5 + 0.5 * forward + 2 * exchange)
    tp2 = ep_laid_out(table, [group], ep=4, tp=2, micro_batches=2, numel=numel, owners=owners)
    assert tp2.fwd_time[1][0] == pytest.approx(max(1e-3, 0.5e-3 + 2e-3) + 1e-5 + 2 * (exchange - 2 * 4e-6) / 2 + 2 * 2 * 4e-6)
    assert tp2.fwd_time[0] == _table(d).fwd_time[0]  # the router as before

    from autosplit.passes.annotations import node_info
    from autosplit.passes.costs import estimate
    from autosplit.passes.ep_costs import gemm_time
    from autosplit.passes.fusion import Fusion
    from autosplit.passes.time_model import node_roofline

    with torch.device("meta"):
        model = moe_model("qwen3_moe")
    model.config._experts_implementation = "grouped_mm"
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(autosplit.Spec((2, 64), torch.long),), **NO_SEARCH)
    gm = planner.traced.annotated("bf16-mixed", "cuda")
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    h100 = PRESETS["H100-80GB"]
    for engine_fp8 in (True, False):
        costed = estimate(gm, (h100,), float8="tensorwise", fusion=Fusion(fp8_experts=engine_fp8))
        assert len(costed.expert_gemms) == 2 * MOE_LAYERS["qwen3_moe"]
        for i, _, (row,) in costed.expert_gemms:
            info = node_info(nodes[i])
            assert gemm_time(row, 1, 1) == pytest.approx((costed.fwd_time[i][0], costed.bwd_time[i][0]))
            if engine_fp8:
                assert row[0] == pytest.approx(info.fwd_flops / (h100.peak_flops_fp8 * h100.efficiency))
            else:
                assert (costed.fwd_time[i][0], costed.bwd_time[i][0]) == node_roofline(nodes[i], info, h100)
    # Transformer Engine's FP8 grouped GEMMs keep FP8 copies of their inputs: a byte a value, not bf16's two
    copies = estimate(gm, (h100,), float8="tensorwise", fusion=Fusion(fp8_experts=True, fp8_inputs=True))
    assert sum(copies.saved_bytes) < sum(estimate(gm, (h100,), float8="tensorwise", fusion=Fusion(fp8_inputs=True)).saved_bytes)
