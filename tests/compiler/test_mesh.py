"""The mesh's data-parallel degrees chosen with the split: the sharded memory and the collectives
of one layer by hand, the degree search on planted problems, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.compiler.costs import cost_table
from autosplit.compiler.mesh import degrees_to_try
from autosplit.costtable import OPTIMIZER_STATE_BYTES
from autosplit.devices import PRESETS
from autosplit.errors import ConstraintError, InfeasiblePlanError
from autosplit.options import PlanOptions
from autosplit.passes.sharding import data_parallel_time, group_time, laid_out
from tests.helpers import NO_SEARCH, says

H100 = PRESETS["H100-80GB"]
WIDTH = 512


def _mlp(layers: int = 4, width: int = WIDTH) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])


def _table(precision: str, dp_shard: int, micro_batches: int = 2):
    planner = autosplit.Planner(_mlp(2), [H100], example_inputs=(torch.randn(8, WIDTH),), precision=precision)
    options = planner.options.replace(data_parallel=dp_shard, replicate="fully_shard")
    return cost_table(planner.traced, (H100,), options, micro_batches=micro_batches)[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_one_layer_sharded_memory_by_hand(precision):
    """A Linear of P bytes of fp32 weights under Adam: whole, P + P + 2P (+ a bf16 copy of the weight
    under bf16-mixed, once per step); sharded over 4 as one unit gathered for the step (two
    micro-batches), (4P)/4 plus its unsharded parameters and gradients (P each, fp32 master weights)
    and the same copy, and a quarter of the optimizer step; FSDP alone in one pass (one micro-batch),
    a unit of its own: (4P)/4 and the copy, with its whole parameters, gradients and the next
    unit's parameters as its transient."""
    whole, sharded, alone = _table(precision, 1), _table(precision, 4), _table(precision, 4, micro_batches=1)
    n = max(i for i, b in enumerate(whole.param_bytes) if b)  # the second layer: its input needs a gradient, so its weight is saved
    P = (WIDTH * WIDTH + WIDTH) * 4
    copy = WIDTH * WIDTH * 2 if precision == "bf16-mixed" else 0  # autocast casts the weight, not the bias
    assert whole.param_bytes[n] == P
    assert whole.state_bytes[n] == 2 * P + OPTIMIZER_STATE_BYTES["adam"] * P // 4 + copy
    assert sharded.state_bytes[n] == 4 * P // 4 + 2 * P + copy
    assert sharded.unit_params[n] and alone.state_bytes[n] == 4 * P // 4 + copy and alone.transient_bytes[n] >= 3 * P
    assert sharded.optimizer_time[n][0] == pytest.approx(whole.optimizer_time[n][0] / 4)


def test_collectives_by_hand():
    """A ring inside a node: (D−1)/D · bytes/bw + (D−1)·latency for an all-gather or a reduce-scatter,
    twice that for an all-reduce; beyond the node's 8 devices, inside the node then across nodes."""
    bw, lat = H100.link_bandwidth, H100.link_latency
    gib = float(2**30)
    assert group_time(gib, 8, H100, allreduce=False) == pytest.approx(7 / 8 * gib / bw + 7 * lat)
    assert group_time(gib, 8, H100, allreduce=True) == pytest.approx(2 * (7 / 8 * gib / bw + 7 * lat))
    node = dataclasses.replace(H100, island_size=8, network_bandwidth=50e9, network_latency=5e-6)
    inside = 7 / 8 * gib / bw + 7 * lat
    across = 1 / 2 * gib / 8 / 50e9 + 1 * 5e-6
    assert group_time(gib, 16, node, allreduce=False) == pytest.approx(inside + across)
    # Sharded over 8: the first stage's all-gather and reduce-scatter are exposed; the second's hide behind its
    # wait for the first input and the drain, each shorter than they are.
    step = data_parallel_time([gib, gib], [H100, H100], replicas=1, shards=8, waits=[0.0, 1e-3], drains=[0.0, 2e-3])
    assert step == pytest.approx(2 * group_time(gib, 8, H100, allreduce=False))
    # Whole copies: the all-reduce hides behind the stage's last backward where it can.
    assert data_parallel_time([gib], [H100], replicas=4, shards=1, waits=[0.0], drains=[1.0]) == 0.0


def test_fsdp_alone_is_chosen_where_it_is_fastest():
    """A batch whose compute outweighs the weights' collectives, a fast link and a cap the whole model
    state does not fit: whole copies do not fit, a pipeline idles in its bubble (at its best micro-batch
    count, searched with the degrees), and one stage sharded over every device wins."""
    state = 4 * 16 * (WIDTH * WIDTH + WIDTH)  # four layers: parameters, gradients and Adam state
    cap = dataclasses.replace(H100, memory=int(state * 0.95))
    plan = autosplit.plan(_mlp(), [cap] * 4, example_inputs=(torch.randn(1024, WIDTH),), data_parallel="auto",
                          replicate="auto", **NO_SEARCH)
    assert plan.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}
    fits = [a for a in plan.alternatives if a.fits]
    assert plan.step_time == min(a.step_time for a in fits)
    assert not any(a.data_parallel == 4 and a.dp_shard == 1 and a.fits for a in plan.alternatives)  # whole copies: no room
    assert len(plan.alternatives) == 5  # pp 4; pp 2 × (replicate | shard) 2; pp 1 × (replicate | shard) 4
    assert "dp_shard 4" in autosplit.report.text.plan_report(plan)


def test_a_pipeline_is_chosen_where_the_weights_are_too_heavy_to_move():
    """Huge weights, a small batch and a slow link: moving activations between stages costs far less than
    all-gathering and reducing the weights, so the plan is a pipeline without data parallelism."""
    slow = dataclasses.replace(H100, link_bandwidth=1e9, network_bandwidth=1e9)
    plan = autosplit.plan(_mlp(4, 2048), [slow] * 4, example_inputs=(torch.randn(4, 2048),), data_parallel="auto",
                          replicate="auto", **NO_SEARCH)
    assert plan.mesh == {"pp": 4, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert plan.step_time == min(a.step_time for a in plan.alternatives if a.fits)


def test_degrees_to_try_and_refusals():
    options = PlanOptions(data_parallel="auto", replicate="auto")
    assert [(d.pp, d.data_parallel, d.replicate) for d in degrees_to_try(4, 8, options)] == [
        (4, 1, "replicate"), (2, 2, "replicate"), (2, 2, "fully_shard"), (1, 4, "replicate"), (1, 4, "fully_shard")]
    assert sorted({d.data_parallel for d in degrees_to_try(8, 6, options)}) == [1, 2]  # 4 and 8 do not divide the batch
    pinned = PlanOptions(data_parallel=2, replicate="fully_shard")
    assert [(d.pp, d.data_parallel, d.replicate) for d in degrees_to_try(8, 8, pinned)] == [(4, 2, "fully_shard")]
    with pytest.raises(ConstraintError) as e:
        degrees_to_try(8, 8, PlanOptions(data_parallel=3, replicate="auto"))
    says(e, "data_parallel=3", "8 devices", "pp × dp_replicate × dp_shard × tp")
    with pytest.raises(ConstraintError) as e:
        degrees_to_try(8, 6, PlanOptions(data_parallel=4, replicate="auto"))
    says(e, "data_parallel=4", "global batch of 6")
    with pytest.raises(ConstraintError) as e:
        PlanOptions(replicate="zero3")
    says(e, "replicate")


def test_one_rows_activations_refuse_a_configuration_before_it_is_captured():
    """Without recomputation every stage holds at least one row's saved activations: the global batch's
    over its rows bounds what the planner's own memory model gives the configuration (planned alone,
    caps lifted), and a cap below that bound, though above the sharded state, refuses FSDP alone unplanned."""
    model, x = _mlp(2, 64), torch.randn(4, 1024, 64)  # rows of 1024 positions: activations outweigh the state
    alone = autosplit.plan(model, [H100] * 4, example_inputs=(x,), data_parallel=4, replicate="fully_shard", **NO_SEARCH)
    planner = autosplit.Planner(model, [H100], example_inputs=(x,))
    whole = cost_table(planner.traced, (H100,), planner.options, micro_batches=1)[0]
    state = sum(laid_out(whole, dp_shard=4, alone=True).state_bytes)
    bound = state + sum(whole.saved_bytes) / 4
    assert state < bound <= alone.stages[0].memory
    cap = dataclasses.replace(H100, memory=int((state + bound) / 2))
    try:
        notes = " ".join(a.note for a in autosplit.plan(
            model, [cap] * 4, example_inputs=(x,), data_parallel="auto", replicate="fully_shard", **NO_SEARCH).alternatives)
    except InfeasiblePlanError as e:  # no configuration fits: the error lists each one's reason
        notes = str(e)
    assert "pp 1 × dp_shard 4: the model state and one row's saved activations need" in notes


def _wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)])


@pytest.mark.parametrize("rows", [1, 64])
def test_the_tensor_parallel_degree_is_chosen_with_the_split(rows):
    """4096 tokens on a node of 4. As one row, data parallelism has no rows to share and a pipeline of one
    micro-batch idles, so each layer split 4 ways wins. As 64 rows,
    each copy takes 16 and hides its gradients' collectives behind its backward, where tensor parallelism
    exposes an all-reduce per layer: data parallelism wins."""
    node = dataclasses.replace(H100, island_size=4)
    plan = autosplit.plan(_wide_mlp(), [node] * 4, example_inputs=(torch.randn(rows, 4096 // rows, 256),), tensor_parallel="auto",
                          data_parallel="auto", replicate="auto", **NO_SEARCH)
    planned = {(a.data_parallel, a.tensor_parallel) for a in plan.alternatives if a.fits}
    passed_over = {(a.data_parallel, a.tensor_parallel): a.bound for a in plan.alternatives if a.note.startswith("not planned: none")}
    assert planned | passed_over.keys() >= {(1, 1), (1, 2), (1, 4)} and plan.step_time == min(a.step_time for a in plan.alternatives)
    # a configuration passed over by its floor cannot win: the floor is no less than the step chosen (within the gap)
    assert all(bound >= plan.step_time * (1 - PlanOptions().gap) for bound in passed_over.values())
    if rows == 1:
        assert plan.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 4}
        split = {f"{i}.{j}.{w}" for i in range(4) for j, w in ((1, "weight"), (1, "bias"), (3, "weight"))}
        assert set(plan.tp_shards) == split and not plan.tp_whole.keys() - {f"{i}.0" for i in range(4)}  # the norms
        assert "tensor parallel over tp 4" in autosplit.report.text.plan_report(plan)
    else:
        assert plan.mesh["tp"] == 1 and plan.data_parallel == 4


def test_tensor_parallel_refusals_say_what_in_the_users_terms():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attn_implementation="eager")
    llama, tokens = LlamaForCausalLM(config), torch.randint(0, 128, (2, 8))
    with pytest.raises(ConstraintError) as e:  # pinned wider than a node
        degrees_to_try(16, 16, PlanOptions(tensor_parallel=16), island=8, kind="H100-80GB")
    says(e, "tp 16 exceeds the 8 H100-80GB devices of a node", "[1, 2, 4, 8]")
    with pytest.raises(InfeasiblePlanError) as refused:  # the only configuration left: 4 kv heads' worth of ranks
        autosplit.plan(llama, autosplit.Cluster.dgx_h100(), example_inputs=(tokens,), tensor_parallel=4, data_parallel=2)
    says(refused, "num_key_value_heads 2 is not divisible by tp 4")
    with pytest.raises(ConstraintError) as e:
        PlanOptions(tensor_parallel="two")
    says(e, "tensor_parallel")


@pytest.mark.parametrize("schedule", ["1f1b", "auto"])
def test_every_configurations_floor_is_below_its_plan(schedule):
    """The floor the mesh search passes configurations over by bounds each one's own plan (as the
    search plans it): for a transformer with its tensor-parallel rules, every tp and
    data-parallel degree and layout of 4 devices, 1F1B's fill and drain counted where it is pinned."""
    from autosplit.compiler import mesh
    from autosplit.compiler.prediction import fill_and_drain
    from autosplit.examples import GPT

    torch.manual_seed(0)
    model, x = GPT(vocab=256, d_model=64, n_layers=4, max_len=64), torch.randint(0, 256, (8, 64))
    options = dict(schedule=schedule, time_limit=2, checkpointing="auto")
    planner = autosplit.Planner(model, [H100] * 4, example_inputs=(x,), tensor_parallel="auto", data_parallel="auto",
                                replicate="auto", **options)
    specs, plain = planner.specs(), planner.options.replace(data_parallel=1, replicate="replicate", tensor_parallel=1,
                                                            checkpointing="none")
    whole = cost_table(planner.traced, specs[:1], plain, micro_batches=1)[0]
    checked, memo = 0, {}  # the search's shared layouts: each floor from the table its degrees share
    for degrees in degrees_to_try(4, 8, planner.options, island=None):
        floor = mesh._proven(planner.traced, specs, planner.options, degrees, whole, memo)
        made = mesh._attempt(planner.traced, specs, planner.options, degrees)
        if isinstance(made, autosplit.AutosplitError):
            continue
        assert 0 < floor <= made.step_time, degrees
        checked += 1
    assert checked >= 6
    assert fill_and_drain(1.0, 1, 8) == 1.0 and fill_and_drain(1.0, 4, 1) == 1.0  # one stage, or one micro-batch: all of it
    assert fill_and_drain(1.0, 4, 4) == pytest.approx(1 / (4 * (1 - 0.75**4)))    # between W/4 and 1F1B's balanced (1 + 3/4)/4


@pytest.mark.parametrize("precision", ["fp32", "bf16-fsdp"])
def test_memory_proven_before_capture_refuses_only_configurations_with_no_plan(precision):
    """The memory proof the mesh search runs before capturing a share (on the global batch's table over
    dp, its model state as one unsharded device holds it: laid out once, for the configuration) refuses
    a configuration only where planning it finds none: a transformer under caps that leave some of the
    9 configurations of 4 devices room and others none, every schedule open; in fp32 and under FSDP2's
    policy (whose layout applies at every degree, so a table laid out twice held its parameters twice)."""
    from autosplit.compiler import mesh
    from autosplit.compiler.mesh_bounds import memory_proven
    from autosplit.examples import GPT

    torch.manual_seed(0)
    model, x = GPT(vocab=256, d_model=64, n_layers=4, max_len=64), torch.randint(0, 256, (8, 64))
    planner = autosplit.Planner(model, [H100] * 4, example_inputs=(x,), tensor_parallel="auto", data_parallel="auto",
                                replicate="auto", schedule="auto", time_limit=2, checkpointing="auto",
                                memory={d: "2MiB" for d in range(4)}, precision=precision)
    specs = planner.specs()
    plain = planner.options.replace(data_parallel=1, replicate="replicate", tensor_parallel=1)
    whole = cost_table(planner.traced, specs[:1], plain, micro_batches=1, laid=False)[0]
    refused, planned = 0, 0
    for degrees in degrees_to_try(4, 8, planner.options, island=None):
        made = mesh._attempt(planner.traced, specs, planner.options, degrees)
        planned += isinstance(made, autosplit.Plan)
        if isinstance(made, autosplit.Plan):  # caps just at what its plan holds: the proof must leave it
            peak = max(made.rank_memory or [st.memory for st in made.stages])
            tight = [dataclasses.replace(spec, memory=peak) for spec in mesh.stage_ranks(specs, degrees)]
            memory_proven(whole, planner.traced, degrees, mesh._chosen(planner.options, degrees), tight)
        try:
            memory_proven(whole, planner.traced, degrees, mesh._chosen(planner.options, degrees), mesh.stage_ranks(specs, degrees))
        except InfeasiblePlanError as e:
            refused += 1
            assert not isinstance(made, autosplit.Plan), (degrees, made.step_time)
            assert str(degrees) in str(e) and "proven before capturing its share" in str(e)
    assert refused >= 4 and planned >= 2
