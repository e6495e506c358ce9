"""Hybrid data + model parallelism: DDP over a split module on 2 gloo processes."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from tests.helpers import ROOT

BATCH, SEQ, VOCAB = 4, 8, 40


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    sys.path.insert(0, str(ROOT))
    import autosplit
    from autosplit.examples import GPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same model and data on every rank
        model = GPT(vocab=VOCAB, d_model=16, n_layers=2, n_heads=2, max_len=SEQ).double()
        reference = copy.deepcopy(model)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
        targets = torch.randint(0, VOCAB, (BATCH, SEQ))
        shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)

        split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(tokens[shard],), time_limit=2, seed=0)
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
        Path(out_dir, f"rank{rank}.ok").write_text(str(len(split.plan.assignment)))
    finally:
        dist.destroy_process_group()
    # Checked and recorded: leave at once. In two of four full-suite runs a native thread still
    # running at interpreter exit aborted a rank that had passed ("terminate called without an
    # active exception", SIGABRT) after its checks; a failing check still raises above.
    os._exit(0)


def test_ddp_over_split_module_matches_full_batch_gradients(tmp_path):
    world = 2
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    assert {"rank0.ok", "rank1.ok"} <= set(os.listdir(tmp_path))
    assert (tmp_path / "rank0.ok").read_text() == (tmp_path / "rank1.ok").read_text()
