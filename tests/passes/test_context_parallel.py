"""Context parallelism in the plan: its terms by hand, the degree chosen where memory asks for it, refusals, engines.

A small transformers Llama with scaled-dot-product attention (the kernel context parallelism splits)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

import autosplit
from autosplit.compiler.costs import check_sequence, cost_table
from autosplit.compiler.mesh import Degrees, stage_ranks
from autosplit.devices import PRESETS
from autosplit.errors import ConstraintError, ExportError, InfeasiblePlanError
from autosplit.passes.cp_costs import a2a_time, attention_nodes, cp_laid_out, exposed_ring, ring_time
from tests.helpers import engine_round_trip

pytest.importorskip("transformers")


def _llama(seq: int = 8, rows: int = 8, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=max(16, seq), attn_implementation="sdpa")
    return LlamaForCausalLM(LlamaConfig(**shape)), (torch.randint(0, 128, (rows, seq)),)


def _device(island: int | None = 8):
    return dataclasses.replace(PRESETS["H100-80GB"], island_size=island, link_bandwidth=100e9, link_latency=5e-6,
                               network_bandwidth=25e9, network_latency=10e-6)


def test_the_ring_by_hand_inside_a_node_and_across():
    d = _device()
    assert ring_time(1e9, 1, 1, d, 4) == 0.0
    assert ring_time(1e9, 4, 2, d, 3) == pytest.approx(3 / 4 * 1e9 / 100e9 + 3 * 5e-6 * 3)  # cp 4 × tp 2 = 8: NVLink
    assert ring_time(1e9, 4, 4, d, 1) == pytest.approx(3 / 4 * 1e9 / 25e9 + 3 * 10e-6)  # 16 devices: over the network
    # the all-to-all form: a rank sends (cp − 1)/cp of what it holds, a latency per call (not per hop)
    assert a2a_time(1e9, 4, 2, d, 3) == pytest.approx(3 / 4 * 1e9 / 100e9 + 3 * 5e-6) and a2a_time(1e9, 1, 8, d, 3) == 0.0
    assert a2a_time(1e9, 4, 4, d, 2) == pytest.approx(3 / 4 * 1e9 / 25e9 + 2 * 10e-6)
    # as a mesh's stage rank sees it (the device a plan is costed on): the same island, the same ring
    for cp, tp in ((4, 2), (4, 4), (8, 1)):
        (rank,) = stage_ranks([d] * 16, Degrees(1, 16 // (cp * tp), "fully_shard", tp=tp, cp=cp))[:1]
        assert rank.group_island == max(1, 8 // (cp * tp))
        assert ring_time(1e9, cp, tp, rank, 3) == ring_time(1e9, cp, tp, d, 3)


def test_one_attention_layer_split_over_cp_by_hand():
    """Every node's work and activations ÷ cp; the attention node's ring, K and V forward and again with fp32 gradients
    backward, exposed only beyond the attention work it overlaps."""
    model, args = _llama(seq=64)
    planner = autosplit.Planner(model, [_device()], example_inputs=args, micro_batches=2, schedule="gpipe")
    gm = planner.traced.annotated("fp32", "cuda")
    table, _ = cost_table(planner.traced, (_device(),), planner.options, micro_batches=2, laid=False)
    attention = attention_nodes(gm)
    assert len(attention) == 2 and all(a.sequence == 64 for a in attention.values())
    (name, (_, kv, itemsize, *_)), *_ = attention.items()
    heads = next(n for n in gm.graph.nodes if n.name == name).args[1].meta["autosplit"].output_shapes[0][1]
    assert heads in (2, 4)  # the 2 KV heads, or repeated to the 4 query heads where transformers' sdpa repeats them
    assert kv == 2 * 8 * heads * 64 * 16 * 4 and itemsize == 4  # K and V as the graph runs them: rows × heads × sequence × head dim, fp32
    split = cp_laid_out(table, gm, cp=2, tp=1, micro_batches=2)
    i, launch = table.nodes.index(name), table.devices[0].launch_overhead

    def halved(t: float) -> float:  # the work over cp 2, the kernel's launch on every rank
        return (t - min(t, launch)) / 2 + min(t, launch)

    forward, backward = ring_time(kv, 2, 1, table.devices[0], 2), ring_time(kv * (1 + 4 / 4), 2, 1, table.devices[0], 2)
    assert split.fwd_time[i][0] == pytest.approx(halved(table.fwd_time[i][0]) + max(0.0, forward - halved(table.fwd_time[i][0])))
    assert split.bwd_time[i][0] == pytest.approx(halved(table.bwd_time[i][0]) + max(0.0, backward - halved(table.bwd_time[i][0])))
    other = next(k for k, n in enumerate(table.nodes) if n not in attention and table.fwd_time[k][0] > 0)
    assert split.fwd_time[other][0] == pytest.approx(halved(table.fwd_time[other][0]))
    assert split.saved_bytes == tuple(-(-b // 2) for b in table.saved_bytes) and split.state_bytes == table.state_bytes
    exposed = max(0.0, forward - halved(table.fwd_time[i][0])) + max(0.0, backward - halved(table.bwd_time[i][0]))
    assert exposed_ring(table, gm, cp=2, tp=1, micro_batches=2) >= exposed  # this node's share of what the plan says
    # the all-to-all form: q, k, v and the output, a rank's half of each, two calls a micro-batch each way, none hidden
    shape = attention[name]
    assert shape.qo_bytes == 2 * 8 * 4 * 64 * 16 * 4 and (shape.heads, shape.kv_heads) == (4, heads)
    a2a = cp_laid_out(table, gm, cp=2, tp=1, micro_batches=2, comm="a2a")
    exchange = a2a_time((kv + shape.qo_bytes) / 2, 2, 1, table.devices[0], 4)
    assert a2a.fwd_time[i][0] == pytest.approx(halved(table.fwd_time[i][0]) + exchange)
    assert a2a.bwd_time[i][0] == pytest.approx(halved(table.bwd_time[i][0]) + exchange)
    assert exposed_ring(table, gm, cp=2, tp=1, micro_batches=2, comm="a2a") == pytest.approx(2 * exchange * len(attention))


def test_cp_is_chosen_where_the_sequence_does_not_fit_and_not_where_it_is_short():
    """On four devices capped at half of what one device holds without splitting: the search splits the sequence (cp > 1); a short
    sequence on links of slow hops: cp 1."""
    model, args = _llama(seq=256, rows=4, layers=2)
    common = dict(example_inputs=args, data_parallel="auto", replicate="auto", context_parallel="auto", tensor_parallel=1,
                  micro_batches=1, schedule="gpipe", checkpointing="none")
    whole = autosplit.plan(model, ["cpu"] * 4, **{**common, "context_parallel": 1, "data_parallel": 1})
    capped = autosplit.plan(model, [dataclasses.replace(PRESETS["cpu"], memory=whole.stages[0].memory // 2)] * 4, **common)
    assert capped.context_parallel > 1 and max(s.memory for s in capped.stages) <= whole.stages[0].memory // 2
    # a short sequence's attention hides no ring of 100 µs hops: the devices' work is split over data parallelism instead
    short_model, short = _llama(seq=8, rows=4)
    slow = dataclasses.replace(PRESETS["cpu"], link_latency=1e-4)
    plan = autosplit.plan(short_model, [slow] * 4, **{**common, "example_inputs": short})
    assert plan.context_parallel == 1 and any(a.context_parallel > 1 and a.fits for a in plan.alternatives)


def test_refusals_name_the_sequence_the_kernel_and_the_runtime():
    with pytest.raises(ConstraintError, match=r"sequence of 12 tokens does not divide 2 · cp 4 · tp 1 = 8.*one of \[1, 2, 3, 6\]"):
        check_sequence(12, 4, 1)
    with pytest.raises(ConstraintError, match="runs no scaled-dot-product attention"):
        check_sequence(None, 2, 1)
    model, args = _llama()
    with pytest.raises(ConstraintError, match=r"context_parallel=3 does not divide the devices left by tp \[1\].*one of \[1, 2, 4\]"):
        autosplit.plan(model, ["cpu"] * 4, example_inputs=args, context_parallel=3)
    # a pinned cp beside tp "auto": tried with each tp that leaves it room (1 and 2 of 4 devices), never refused for tp 4
    beside = autosplit.plan(model, ["cpu"] * 4, example_inputs=args, context_parallel=2, tensor_parallel="auto", micro_batches=1,
                            schedule="gpipe")
    assert {(a.context_parallel, a.tensor_parallel) for a in beside.alternatives} == {(2, 1), (2, 2)}
    plan = autosplit.plan(model, ["cpu"] * 4, example_inputs=args, data_parallel=2, replicate="fully_shard", context_parallel=2,
                          micro_batches=1, schedule="gpipe")
    assert plan.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1} and "split over cp 2" in plan.costs
    assert "K/V ring exposed" in plan.costs  # a sequence of 8: its attention hides no ring, and the plan says so
    # before any work, with what torch lacks on a CPU, asked of torch itself (compat.cpu_context_parallel_gaps)
    with pytest.raises(ConstraintError, match=r"does not run it: on CPU ranks torch runs neither of its forms \(DTensor has no "
                       r"sharding strategy for aten\._scaled_dot_product_flash_attention_for_cpu.*FlexAttention.*backward on CPU"):
        autosplit.distribute(model, None, example_inputs=args, loss_fn=lambda out, _: out.logits.sum(), plan=plan)


def test_what_torch_lacks_to_run_context_parallelism_on_a_cpu_is_what_the_refusal_says():
    """Both of torch's forms, tried: the ring's SDPA on DTensor (no strategy for the CPU flash kernel) and FlexAttention
    (no backward on a CPU). When a torch release runs either, this fails, and the runtime's refusal is to be revisited."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.placement_types import Shard
    from torch.nn.attention.flex_attention import flex_attention

    from autosplit.compat import cpu_context_parallel_gaps

    assert len(cpu_context_parallel_gaps()) == 2
    q = torch.randn(1, 2, 128, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a group of this process alone
    try:
        sharded = distribute_tensor(q.detach(), dist.device_mesh.init_device_mesh("cpu", (1,)), [Shard(2)])
        assert isinstance(sharded, DTensor)
        with pytest.raises(NotImplementedError, match=r"_scaled_dot_product_flash_attention_for_cpu\.default does not have a sharding"):
            torch.nn.functional.scaled_dot_product_attention(sharded, sharded, sharded, is_causal=True)
    finally:
        dist.destroy_process_group()


def test_cp_goes_to_both_engines_and_reads_back_as_the_same_plan(tmp_path):
    model, args = _llama()
    planner = autosplit.Planner(model, ["cpu"] * 8, example_inputs=args)
    plan = planner.manual(autosplit.Recipe([["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]],
                                           data_parallel=2, replicate="fully_shard", context_parallel=2,
                                           options=dict(micro_batches=2, schedule="1f1b")))
    assert plan.context_parallel == 2
    flags, toml = engine_round_trip(planner, plan, tmp_path)
    assert "--context-parallel-size 2" in flags and "--cp-comm-type p2p" in flags
    # Megatron's all-to-all form: read as cp_comm='a2a', costed so, and written back; torchtitan has no such form
    a2a = planner.manual("megatron:" + flags.replace("--cp-comm-type p2p", "--cp-comm-type a2a"))
    assert a2a.cp_comm == "a2a" and a2a.mesh == plan.mesh and "all-to-alls of Q, K, V and the output" in a2a.costs
    assert a2a.step_time != pytest.approx(plan.step_time) and "--cp-comm-type a2a" in a2a.export("megatron")
    assert autosplit.Plan.from_dict(a2a.to_dict()).cp_comm == "a2a"
    with pytest.raises(ExportError, match="torchtitan's context parallelism passes keys and values round a ring"):
        a2a.export("torchtitan")
    with pytest.raises(ConstraintError, match=r"by --cp-comm-type a2a\+p2p"):  # the hierarchical form: not costed
        planner.manual("megatron:" + flags.replace("--cp-comm-type p2p", "--cp-comm-type a2a+p2p"))
    with pytest.raises(InfeasiblePlanError, match=r"cp_comm='a2a' over cp 4: attention .* 2 query and \d key/value heads per tp rank"):
        autosplit.plan(_llama(seq=64)[0], ["cpu"] * 8, example_inputs=_llama(seq=64)[1], context_parallel=4, tensor_parallel=2,
                       cp_comm="a2a", micro_batches=1, schedule="gpipe")
    assert "context_parallel_degree = 2" in toml
