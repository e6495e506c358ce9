"""Selective recomputation (``selective=True``): a recomputed block keeps its matmuls' and attention's
outputs and recomputes the ops between them. The stages train exactly as the unsplit model (float64,
a GPT and a transformers Llama with SDPA attention); the memory model predicts what a stage keeps,
measured as the storages alive after its forward (and so for whole blocks, none, and blocks kept by
some micro-batches); it sits between keeping everything and recomputing whole blocks, in memory and
in time; engines that keep other tensors are refused. Under tensor parallelism:
``tests/runtime/test_tensor_parallel.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

import autosplit
from autosplit.compiler.costs import cost_table
from autosplit.compiler.search import configurations
from autosplit.errors import ConstraintError, ExportError
from autosplit.microbatch import split_batch
from autosplit.passes.chain import generate_chain
from autosplit.passes.recompute_regions import micro_batch
from autosplit.passes.selective import keeps_output
from autosplit.plans import PartialRecompute
from autosplit.report.text import plan_report
from autosplit.solver.build import build_problem
from tests import held as measure
from tests.helpers import GPT, NO_SEARCH, assert_trains_like, says, seeded_gpt
from tests.layouts import llama_case


def _planner(model, inputs, **options):
    return autosplit.Planner(model, ["cpu"] * 2, example_inputs=inputs, **NO_SEARCH, **options)


def test_selective_gpt_stages_train_like_the_unsplit_model():
    model, inputs = seeded_gpt(3)
    model = model.double()
    plan = _planner(model, inputs, checkpointing="full", selective=True).plan()
    assert plan.recompute == ("blocks.0", "blocks.1", "blocks.2") and plan.recompute_selective
    split = assert_trains_like(model, ["cpu"] * 2, inputs, plan=plan, steps=3)
    assert all("recompute_selectively(" in stage.code for stage in split.stages)


def test_selective_llama_with_sdpa_trains_like_the_unsplit_model():
    model, args, _, _, _ = llama_case()
    model.config._attn_implementation = "sdpa"  # the fused attention kernel, whose output the policy keeps
    model = model.double()
    plan = _planner(model, args, checkpointing="full", selective=True).plan()
    assert plan.recompute == ("model.layers.0", "model.layers.1") and plan.recompute_selective
    assert_trains_like(model, ["cpu"] * 2, args, plan=plan, steps=3)


def test_the_memory_model_predicts_what_stages_keep_recomputing_nothing_whole_blocks_or_selectively():
    """Each stage's predicted activations (and outputs held for the backward) against the storages its
    forward leaves alive, on one split: within 2 % (adjacent whole blocks keep each other's boundary)."""
    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=64, n_layers=3, n_heads=4, max_len=32).double()
    inputs = (torch.randint(0, 64, (8, 32)),)
    planner = _planner(model, inputs, checkpointing="full")
    made = planner.plan()
    blocks, kept = made.recompute, dataclasses.replace(made, recompute=())
    measured, predicted = {}, {}
    for mode, given in (("none", kept), ("full", dataclasses.replace(kept, recompute=blocks)),
                        ("selective", dataclasses.replace(kept, recompute=blocks, recompute_selective=True))):
        plan = planner.plan(given)  # the same split, re-costed as it recomputes
        micro = split_batch(planner.traced.inputs, None, 1)[0][0]
        chain = generate_chain(planner.traced.captured, plan.stage_of, 2, micro, recompute=plan.recompute,
                               selective=plan.recompute_selective)
        named = dict(zip(chain.input_names, micro))
        first, out = measure.held(chain.stages[0], (), named)
        received = tuple(o.detach().requires_grad_() for o in (out if isinstance(out, tuple) else (out,)))
        measured[mode] = (first, measure.held(chain.stages[1], received, named)[0])
        predicted[mode] = tuple(st.memory_activations + st.memory_sent for st in plan.stages)
    for s in range(2):
        assert measured["full"][s] < measured["selective"][s] < measured["none"][s], (s, measured)
        for mode in measured:
            assert predicted[mode][s] == pytest.approx(measured[mode][s], rel=0.02), (mode, s, predicted, measured)


@pytest.mark.parametrize("selective", [False, True])
def test_blocks_that_keep_some_micro_batches_are_predicted_as_the_storages_they_keep(selective):
    """Every block of a GPT kept by one micro-batch of two and recomputed (wholly or selectively) by the
    other: each stage's prediction for its two micro-batches in flight against the storages alive after
    the kept one's forward and the recomputed one's, within 2 % (the model once shrank each block's share
    by the next one's, and predicted under half of what stage 0 holds)."""
    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=64, n_layers=3, n_heads=4, max_len=32).double()
    inputs = (torch.randint(0, 64, (8, 32)),)
    planner = _planner(model, inputs, checkpointing="full", schedule="gpipe", micro_batches=2)
    made = planner.plan()
    some = tuple(PartialRecompute(b, 1, 2) for b in made.recompute)  # micro-batch 0 keeps every block, 1 recomputes it
    plan = planner.plan(dataclasses.replace(made, recompute_partial=some, recompute_selective=selective))
    micros = [m[0] for m in split_batch(planner.traced.inputs, None, 2)]
    chain = generate_chain(planner.traced.captured, plan.stage_of, 2, micros[0], recompute=plan.recompute, partial=some,
                           selective=selective)
    measured = [0, 0]
    for i, micro in enumerate(micros):
        named = dict(zip(chain.input_names, micro))
        with micro_batch(i):
            first, out = measure.held(chain.stages[0], (), named)
            received = tuple(o.detach().requires_grad_() for o in (out if isinstance(out, tuple) else (out,)))
            measured[0] += first
            measured[1] += measure.held(chain.stages[1], received, named)[0]
    predicted = [st.memory_activations + st.memory_sent for st in plan.stages]
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)


def test_selective_blocks_save_less_and_recompute_less_than_whole_ones():
    model, inputs = seeded_gpt(3)
    costs = {}
    for selective in (False, True):
        planner = _planner(model, inputs, checkpointing="auto", selective=selective)
        table, _ = cost_table(planner.traced, planner.specs(), planner.options, micro_batches=1)
        problem = build_problem(table, recompute=dict.fromkeys(table.blocks))
        costs[selective] = [(r.compute[0], saves) for r, saves in zip(problem.recompute, table.block_saves)]
    gm = planner.traced.annotated("fp32", "cpu")
    keeps = {n.name: keeps_output(gm, n) for n in gm.graph.nodes}
    assert keeps["blocks_0_attn_qkv"] and keeps["matmul"] and keeps["blocks_0_fc"], "linear layers and matmuls keep their output"
    assert not (keeps["blocks_0_ln1"] or keeps["softmax"] or keeps["add"]), "norms, softmax and adds recompute"
    for b, ((whole_time, whole_saves), (time, saves)) in enumerate(zip(costs[False], costs[True])):
        assert 0 < time < whole_time, f"block {b}: recomputing selectively takes {time} ns, whole {whole_time} ns"
        assert 0 < saves < whole_saves, f"block {b}: recomputing selectively saves {saves} bytes, whole {whole_saves}"


def test_selective_without_recomputation_is_refused_and_engines_refuse_a_selective_plan():
    with pytest.raises(ConstraintError) as e:
        autosplit.PlanOptions(selective=True)
    says(e, "selective", "checkpointing='none'", "checkpointing='full'")
    with pytest.raises(ConstraintError):
        autosplit.PlanOptions(checkpointing="full", selective=1)
    model, args, _, _, _ = llama_case()
    planner = _planner(model, args, checkpointing="full", selective=True, expressible_in="megatron", schedule="1f1b")
    for engine in ("torchtitan", "megatron"):
        with pytest.raises(ExportError) as e:
            planner.export(engine)
        says(e, "selectively", engine if engine == "torchtitan" else "Megatron", "selective=False")


@pytest.mark.parametrize("selective", [False, True])
def test_the_solvers_memory_of_recomputing_every_block_bounds_the_exact_one_closely(selective):
    """What the solver charges a split that recomputes every block (its blocks' savings, their shared
    inputs' room, the reserve for a block's backward) is no less than the exact re-costing of that
    split, and not 5 % more: a Llama whose layers share their rotary tables and mask."""
    from autosplit.solver.evaluation import evaluate

    model, args, _, _, _ = llama_case()
    planner = _planner(model, args, checkpointing="full", selective=selective)
    plan = planner.plan()
    table, _ = cost_table(planner.traced, planner.specs(), planner.options, micro_batches=plan.micro_batches)
    problem = build_problem(table, micro_batches=plan.micro_batches, schedule=plan.schedule, recompute=dict.fromkeys(table.blocks))
    solver = evaluate(problem.fixed(range(len(problem.recompute))), [plan.stage_of[n] for n in problem.nodes]).memory
    exact = [st.memory for st in plan.stages]
    for s, (charged, held) in enumerate(zip(solver, exact)):
        assert held <= charged * 1024 <= held * 1.05, (s, charged * 1024, held)


def test_the_solvers_memory_of_blocks_kept_by_some_micro_batches_bounds_the_exact_one_closely():
    """As above, with every layer of the Llama kept by one of the two micro-batches each stage holds
    (GPipe): the solver's charge (each block's saving, :meth:`~autosplit.solver.problem.Recompute.partly`)
    against the exact re-costing of the plan that keeps them so."""
    from autosplit.solver.evaluation import evaluate

    model, args, _, _, _ = llama_case()
    planner = _planner(model, args, checkpointing="full", schedule="gpipe", micro_batches=2)
    made = planner.plan()
    some = tuple(PartialRecompute(b, 1, 2) for b in made.recompute)
    plan = planner.plan(dataclasses.replace(made, recompute_partial=some))
    table, _ = cost_table(planner.traced, planner.specs(), planner.options, micro_batches=plan.micro_batches)
    problem = build_problem(table, micro_batches=plan.micro_batches, schedule=plan.schedule, recompute=dict.fromkeys(table.blocks))
    stage_of = [plan.stage_of[n] for n in problem.nodes]
    kept = {u: (stage_of[block.members[0]], 1) for u, block in enumerate(problem.recompute)}
    solver = evaluate(problem.fixed(range(len(problem.recompute)), kept), stage_of).memory
    for s, (charged, held) in enumerate(zip(solver, (st.memory for st in plan.stages))):
        assert held <= charged * 1024 <= held * 1.05, (s, charged * 1024, held)


def test_selective_auto_plans_both_ways_and_keeps_the_faster():
    """``selective="auto"``: the search costs every configuration with whole and with selective blocks
    and plans the faster (every block recomputed, no cap: selective, which runs less again), with
    tensor parallelism too."""
    model, inputs = seeded_gpt(4)
    options = dict(checkpointing="full", schedule="1f1b", micro_batches=4, time_limit=2)
    both = {s: _planner(model, inputs, selective=s, **options).plan() for s in (False, True)}
    auto = _planner(model, inputs, selective="auto", **options).plan()
    assert {a.selective for a in auto.alternatives} == {False, True}, auto.alternatives
    assert both[True].step_time < both[False].step_time
    assert auto.recompute_selective and auto.step_time == pytest.approx(both[True].step_time, rel=1e-6)
    assert "micro-batches, recomputing selectively:" in plan_report(auto)
    # the default micro-batch count stands where selectivity is all the search decides (a manual split's)
    assert autosplit.PlanOptions(checkpointing="full", selective="auto", schedule="1f1b").micro_batches_for(2, 8) == 8
    split = autosplit.PlanOptions(checkpointing="auto", selective="auto", tensor_parallel=2, micro_batches="auto")
    assert {c.selective for c in configurations(split, 2, 8)} == {False, True}
    with pytest.raises(ConstraintError):
        autosplit.PlanOptions(checkpointing="auto", selective="sometimes")


class _DropoutAttention(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        return x + F.scaled_dot_product_attention(q, k, v, dropout_p=0.5).squeeze(1)


class _AttentionDropout(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_DropoutAttention(width) for _ in range(4))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_attention_that_draws_dropout_is_never_kept():
    """An attention kernel that draws dropout is recomputed by the policy (cached, the rerun's later
    draws would shift), and selective planning or codegen of a block holding one is refused."""
    from autosplit.passes.selective import _policy

    q = torch.randn(1, 1, 4, 8)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert _policy(None, flash, q, q, q) is CheckpointPolicy.MUST_SAVE
    assert _policy(None, flash, q, q, q, 0.5) is CheckpointPolicy.PREFER_RECOMPUTE
    assert _policy(None, torch.ops.aten.mm.default, q[0, 0], q[0, 0].T) is CheckpointPolicy.MUST_SAVE
    model, inputs = _AttentionDropout(), (torch.randn(4, 8, 16),)
    with pytest.raises(ConstraintError) as e:
        _planner(model, inputs, checkpointing="full", selective=True).plan()
    says(e, "dropout_p=0.5", "selective=False")
    planner = _planner(model, inputs, checkpointing="full")
    plan = planner.plan()
    assert plan.recompute and not plan.recompute_selective
    with pytest.raises(ConstraintError):
        generate_chain(planner.traced.captured, plan.stage_of, 2, list(inputs), recompute=plan.recompute, selective=True)
