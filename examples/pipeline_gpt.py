"""Train a GPT pipelined over processes with autosplit (CPU, gloo).

    .venv/bin/torchrun --nproc-per-node 2 examples/pipeline_gpt.py            # 2 stages
    .venv/bin/torchrun --nproc-per-node 4 examples/pipeline_gpt.py --dp 2     # 2 stages × 2 replicas

Every rank builds the same model (same seed) and calls ``autosplit.distribute``: rank 0 plans,
the plan is broadcast, each rank runs its stage. The loss is printed by the last stage's ranks.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autosplit
from autosplit.examples import GPT
from autosplit.report import plan_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (stages = world size / dp)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same weights on every rank
    model = GPT(vocab=512, d_model=64, n_layers=4, n_heads=4, max_len=64)
    rows = 8  # per data-parallel replica
    tokens = torch.randint(0, 512, (rows * args.dp, 64))  # the global batch
    targets = torch.roll(tokens, -1, dims=1)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    pipe = autosplit.distribute(
        model, ["cpu"] * world, example_inputs=(tokens,), loss_fn=loss_fn,  # the devices: the whole mesh
        data_parallel=args.dp, schedule=args.schedule, micro_batches=4, time_limit=5,
    )
    if rank == 0:
        print(plan_report(pipe.plan))
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    mine = slice(pipe.layout.replica * rows, (pipe.layout.replica + 1) * rows)  # this replica's rows of the global batch
    for step in range(args.steps):
        loss = pipe.step(tokens[mine], target=targets[mine])
        opt.step()
        opt.zero_grad()
        if loss is not None:
            print(f"rank {rank} (stage {pipe.stage_index}, replica {pipe.layout.replica}) step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
