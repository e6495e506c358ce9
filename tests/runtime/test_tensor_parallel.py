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

from tests.tp_cases import fixed_plan, planned, sequence_parallel, train_case


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
