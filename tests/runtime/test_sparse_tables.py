"""Tables looked up with sparse=True, trained split and replicated: FSDP2 reduces dense gradients
only, so the stages leave these tables out of it and average their sparse gradients themselves.
Float64, 3 Adagrad steps (Adam refuses sparse gradients), 2 stages × 2 replicas on 4 gloo
processes against the unsplit model on the whole batch."""

from __future__ import annotations

import copy
from typing import Literal

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import NO_SEARCH, full_tensor, reference_step, says, where

VOCAB, BATCH, SEQ, STEPS = 300, 8, 6, 3


class _Tagger(nn.Module):
    """A sparse token table, a layer, and a sparse output table looked up functionally at the
    candidates shared by the batch (a sampled softmax's shape)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16, sparse=True)
        self.mix = nn.Linear(16, 16)
        self.out = nn.Parameter(torch.randn(VOCAB, 16) * 0.1)

    def forward(self, tokens, candidates):
        w = F.embedding(candidates, self.out, sparse=True)[0]  # (samples, 16)
        return torch.tanh(self.mix(self.emb(tokens))) @ w.t()


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _run_case(replicate: Literal["replicate", "fully_shard"], rank: int, world: int) -> None:
    import autosplit

    torch.manual_seed(0)
    model = _Tagger().double()
    reference = copy.deepcopy(model)
    tokens, candidates = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (1, 40))
    target = torch.randint(0, 40, (BATCH, SEQ))
    dp = 2
    mine = slice(rank % dp * BATCH // dp, (rank % dp + 1) * BATCH // dp)
    pipe = autosplit.distribute(
        model, ["cpu"] * world, example_inputs=(tokens, candidates), loss_fn=_loss, data_parallel=dp,
        replicate=replicate, schedule="1f1b", micro_batches=2, **NO_SEARCH, optimizer="adagrad",
    )
    assert len(set(pipe.plan.assignment.values())) == world // dp
    opt = torch.optim.Adagrad(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    ref_params = dict(reference.named_parameters())
    sparse = {"emb.weight", "out"}
    for step in range(STEPS):
        pipe.step(tokens[mine], candidates, target=target[mine])
        reference_step(reference, (tokens, candidates), {}, target, _loss, chunks=1)
        for name, p in pipe.named_parameters():
            grad, expected = p.grad, ref_params[name].grad
            assert grad is not None and expected is not None, name
            assert grad.is_sparse == (name in sparse), name  # the tables' gradients stay sparse, rows only
            got = grad.to_dense() if grad.is_sparse else full_tensor(grad)
            torch.testing.assert_close(got, expected.to_dense(), msg=where(f"rank {rank} step {step} grad {name}"))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p), ref_params[name], msg=where(f"{name} after {STEPS} steps"))


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_sparse_tables_train_like_the_unsplit_model_across_replicas(gloo):
    gloo(4).run(_run_case, [("replicate",), ("fully_shard",)])


def _policy_case(rank: int, world: int) -> None:
    import autosplit
    from autosplit.errors import DistributedError

    tokens, candidates = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (1, 40))
    with pytest.raises(DistributedError) as e:
        autosplit.distribute(_Tagger(), ["cpu"] * world, example_inputs=(tokens, candidates), loss_fn=_loss,
                             schedule="1f1b", micro_batches=2, precision="bf16-fsdp", optimizer="adagrad", **NO_SEARCH)
    says(e, "precision='bf16-fsdp' with 1 table(s) looked up with sparse=True", "its policy would not cast them", "sparse=False")


def test_fsdp2s_policy_is_refused_beside_tables_it_would_not_cast(gloo):
    gloo(2).run(_policy_case, [()])
