"""A mixture-of-experts causal LM (``transformers``' Mixtral, router outputs on) trained through
``autosplit.distribute`` on 2 gloo processes equals unsplit training.

GPipe, 2 stages, float64, seeded. The loss reads the router outputs (cross-entropy plus the
load-balancing ``aux_loss``, as Mixtral's own loss does), so they cross the stage boundary. The
aux loss is a statistic of the tokens of one forward call — like BatchNorm, a pipeline computes it
per micro-batch — so the reference is the unsplit model run micro-batch by micro-batch, the losses
averaged (``tests.helpers.reference_step``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import NO_SEARCH, full_tensor, reference_step, where

MICRO = 2
STEPS = 3
VOCAB = 64


def _loss(out, target):
    return F.cross_entropy(out["logits"].flatten(0, 1), target.flatten()) + 0.02 * out["aux_loss"]


def _run_case(rank: int, world: int) -> None:
    import transformers

    import autosplit

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=True,
    )
    config._experts_implementation = "batched_mm"  # the default grouped_mm kernel is float32-only on CPU
    model = transformers.MixtralForCausalLM(config).double()
    reference = copy.deepcopy(model)
    ids, target = torch.randint(0, VOCAB, (4, 8)), torch.randint(0, VOCAB, (4, 8))
    pipe = autosplit.distribute(
        model, ["cpu"] * world, example_inputs=(ids,), loss_fn=_loss, schedule="gpipe", micro_batches=MICRO, **NO_SEARCH,
    )
    assert pipe.plan.capture == "export" and len(set(pipe.plan.assignment.values())) == world
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    for step in range(STEPS):
        loss = pipe.step(ids, target=target)
        expected = reference_step(reference, (ids,), {"use_cache": False}, target, _loss, chunks=MICRO)
        assert (loss is None) == (not pipe.is_last)
        if pipe.is_last:
            torch.testing.assert_close(loss, expected, msg=where(f"step {step} loss"))
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(full_tensor(p.grad), ref_params[name].grad, msg=where(f"rank {rank} step {step} grad {name}"))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p), ref_params[name], msg=where(f"{name} after {STEPS} steps"))


def test_mixtral_pipelined_over_two_processes_trains_like_the_unsplit_model(gloo):
    pytest.importorskip("transformers")
    gloo(2).run(_run_case, [()])
