"""Tensor parallelism on the mesh's ``tp`` dimension trains like the unsplit model.

Each rank builds its part of a fixed plan (the split DP's, :data:`~tests.helpers.NO_SEARCH`), given
``tensor_parallel=2`` and ``tp_shards`` by hand: for the GPT the MLP pair of each block (``fc`` weight
and bias along 0, ``out``'s weight along 1); for a small transformers Llama (captured by
``torch.export``) the attention's q/k/v along 0 and o along 1, the MLP's gate/up along 0 and down along
1, the embedding and the head along 0 (vocabulary-parallel). Beside it, in the same process, the
unsplit model trains on the whole global batch. In float64 the losses of every step, every gradient
(whole, ``full_tensor``; the last step's clipped by the whole model's norm, ``pipe.clip_grad_norm_``)
and the parameters after 3 AdamW steps agree to rounding, and so does ``eval_step`` after them:

- tp 2 alone (2 processes), the planner's own plans (``tensor_parallel=2``: ``tp_shards`` from the graph's
  rules, the GPT's tied embedding and head vocabulary-parallel, a traced graph's ``nn.Embedding`` leaf);
  both models also under ``checkpointing="full"`` (compiled, ``compile=True``: ``tests/runtime/test_tensor_parallel_compiled.py``);
- tp 2 × pp 2 (4); with two stages per rank too (interleaved 1F1B, the zero-bubble V).

With data parallelism beside tp, bf16, checkpoints between layouts and the refusals:
``tests/runtime/test_tensor_parallel_meshes.py``; the cases both run: :mod:`tests.tp_cases`.
"""

from __future__ import annotations

import pytest

from tests.tp_cases import RECOMPUTING, fixed_plan, forward_held, planned, recomputing, sequence_parallel, train_case


def test_tp2_alone_trains_like_the_unsplit_model(gloo, tmp_path):
    pytest.importorskip("transformers")
    # the planner's own plans (tp_shards from the graph: the GPT's MLPs and its tied table and head, the Llama's
    # attention, MLP, embedding and head); then activation checkpointing around the DTensor ops, by hand
    plans = [(name, planned(name, str(tmp_path))) for name in ("gpt", "llama")]
    plans += [(name, fixed_plan(name, 1, 1, 2, str(tmp_path), checkpointing="full")) for name in ("gpt", "llama")]
    gloo(2).run(train_case, plans)


def test_sequence_parallel_trains_like_the_unsplit_model(gloo, tmp_path):
    """The norms and residuals between the split layers on half the tokens each (reduce-scatter after each
    row-parallel product and the lookup, all-gather before each column-parallel group): tp 2 alone and
    tp 2 × pp 2, the Llama (grouped-query attention), against the unsplit model in float64."""
    pytest.importorskip("transformers")
    gloo(2).run(train_case, [("llama", sequence_parallel(str(tmp_path), 1))])
    gloo(4).run(train_case, [("llama", sequence_parallel(str(tmp_path), 2))])


SELECTIVE = (("gpt", False), ("llama", False), ("llama", True))
"""The selective cases: the GPT and the Llama, the Llama under sequence parallelism too."""


def test_selective_recomputation_under_tp2_trains_like_the_unsplit_model(gloo, tmp_path):
    """The planner's own plans recomputing every block selectively around the DTensor ops (the policy keeps
    the matmuls' outputs, a row-parallel one a partial sum, and the reductions') train as the unsplit model."""
    pytest.importorskip("transformers")
    gloo(2).run(train_case, [(name, recomputing(name, str(tmp_path), "selective", sp)) for name, sp in SELECTIVE])


def test_what_recomputing_blocks_keep_and_run_again_under_tp2_is_what_the_plan_costs(gloo, tmp_path):
    """One micro-batch's forward of each rank's stage, measured as the storages it leaves alive and the
    collectives it and its backward run, for no, whole and selective blocks:

    - what selective blocks keep beyond whole ones (each matmul's output, a row-parallel one a whole
      partial sum, and each reduction's) is predicted to 2 %, their whole within 10 %; the Llama's stage in
      every mode within 3 % (a partial sum left unreduced had made its next layer compute whole, and a
      reduced output is whole on every rank);
    - in the backward, selective blocks run no reduction again (whole ones do, but one that ends a block),
      and under sequence parallelism the all-gathers before the column-parallel linears again, as whole ones do."""
    pytest.importorskip("transformers")
    for name, sp in SELECTIVE:
        cases = [(name, recomputing(name, str(tmp_path), mode, sp)) for mode in RECOMPUTING]
        runs = dict(zip(RECOMPUTING, gloo(2).run(forward_held, cases)))
        for rank in range(2):
            (p_full, m_full, _, full), (p_sel, m_sel, _, sel) = runs["full"][rank], runs["selective"][rank]
            what = f"{name}{' sp' if sp else ''} rank {rank}: predicted {p_sel} and {p_full}, measured {m_sel} and {m_full}"
            assert p_sel - p_full == pytest.approx(m_sel - m_full, rel=0.02), what
            assert p_sel == pytest.approx(m_sel, rel=0.1), what
            if name == "llama" and not sp:  # every mode, each reduced output whole on every rank
                for mode, (predicted, measured, _, _) in ((mode, runs[mode][rank]) for mode in RECOMPUTING):
                    assert predicted == pytest.approx(measured, rel=0.03), (mode, rank, predicted, measured)
            none = runs["none"][rank][3]
            for reduction in ("all_reduce", "reduce_scatter_tensor"):
                assert sel.get(reduction, 0) == none.get(reduction, 0), (what, none, full, sel)
            assert sel.get("all_gather_into_tensor", 0) == full.get("all_gather_into_tensor", 0), (what, full, sel)
            # torch's checkpoint stops at the last tensor the backward needs: the GPT's one reduction ends its block
            assert (sum(full.values()) > sum(none.values())) == (name == "llama"), (what, none, full)


def test_tp2_by_pp2_trains_like_the_unsplit_model(gloo, tmp_path):
    pytest.importorskip("transformers")
    plans = [("gpt", fixed_plan("gpt", 2, 1, 2, str(tmp_path))), ("llama", fixed_plan("llama", 2, 1, 2, str(tmp_path)))]
    gloo(4).run(train_case, plans)


def test_tp2_by_pp2_with_two_stages_per_rank_trains_like_the_unsplit_model(gloo, tmp_path):
    """torch's multi-stage classes: interleaved 1F1B on the Llama; the zero-bubble V on the GPT with its tied
    embedding and head vocabulary-parallel (both arms of the V on one rank, a copy each, gradients summed per
    tp place; the backward split into input and weight passes)."""
    pytest.importorskip("transformers")
    multi = {"stages_per_rank": 2, "micro_batches": 4}
    plans = [("llama", fixed_plan("llama", 2, 1, 2, str(tmp_path), schedule="interleaved1f1b", **multi)),
             ("gpt-vocab", fixed_plan("gpt-vocab", 2, 1, 2, str(tmp_path), schedule="zbvzerobubble", **multi))]
    gloo(4).run(train_case, plans)
