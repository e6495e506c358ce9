"""Hybrid data + model parallelism: DDP over a split module on 2 gloo processes."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import autosplit
from autosplit.examples import GPT
from tests.helpers import NO_SEARCH

BATCH, SEQ, VOCAB = 4, 8, 40


def _ddp_case(*, rank: int, world: int) -> int:
    torch.manual_seed(0)  # same model and data on every rank
    model = GPT(vocab=VOCAB, d_model=16, n_layers=2, n_heads=2, max_len=SEQ).double()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.randint(0, VOCAB, (BATCH, SEQ))
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)

    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(tokens[shard],), **NO_SEARCH, seed=0)
    ddp = DistributedDataParallel(split, device_ids=None)
    loss_fn = torch.nn.CrossEntropyLoss()
    loss_fn(ddp(tokens[shard]).flatten(0, 1), targets[shard].flatten()).backward()

    # The unsplit model on the full batch: DDP's averaged gradients must equal its gradients.
    loss_fn(reference(tokens).flatten(0, 1), targets.flatten()).backward()
    for (name, p), q in zip(split.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=f"rank {rank}, {name}")

    plans = [None] * world
    dist.all_gather_object(plans, split.plan.assignment)
    assert all(p == plans[0] for p in plans), "ranks planned independently and must agree"
    return len(split.plan.assignment)


def test_ddp_over_split_module_matches_full_batch_gradients(gloo):
    (sizes,) = gloo(2).run(_ddp_case, [()])
    assert sizes[0] == sizes[1]
