"""A complete training loop on an autosplit pipeline: LR warm-up, gradient accumulation, clipping by
the whole model's norm, evaluation every N steps in eval mode, a checkpoint and a resume.

    .venv/bin/torchrun --nproc-per-node 2 examples/train_loop.py                        # 2 stages
    .venv/bin/torchrun --nproc-per-node 2 examples/train_loop.py --stop-after 4         # ... interrupted,
    .venv/bin/torchrun --nproc-per-node 2 examples/train_loop.py --resume               # ... and resumed
    .venv/bin/python examples/train_loop.py --unsplit                                   # the same loop, unsplit

Every line that touches the model is the unsplit loop's, with the pipeline's verb beside it:
``pipe.step`` for ``loss.backward()``, ``pipe.clip_grad_norm_`` for ``torch.nn.utils.clip_grad_norm_``,
``pipe.eval_step`` for a validation loss under ``no_grad``. ``tests/runtime/test_train_loop_example.py``
runs both and checks that they train alike in float64.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autosplit
from autosplit.examples import GPT
from autosplit.runtime.checkpoint import load_checkpoint, save_checkpoint

VOCAB, SEQ, BATCH = 64, 16, 8


def batch(seed: int, step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-step ``k`` of step ``step``'s tokens and next-token targets: the same on every rank and run."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + k)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def save_loop_state(folder: Path, state: dict) -> None:
    """The loop's own state (the step, the LR scheduler's state) beside the model's checkpoint,
    written whole or not at all (a temporary file renamed over the old one)."""
    fresh = folder / "loop.json.tmp"
    fresh.write_text(json.dumps(state))
    os.replace(fresh, folder / "loop.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps in all")
    parser.add_argument("--accumulate", type=int, default=2, help="batches whose gradients make one optimizer step")
    parser.add_argument("--warmup", type=int, default=3, help="steps of linear LR warm-up")
    parser.add_argument("--max-norm", type=float, default=0.5, help="clip the gradients' total norm to this")
    parser.add_argument("--eval-every", type=int, default=2, help="a validation loss every this many steps")
    parser.add_argument("--checkpoint", default="checkpoints/train_loop", help="checkpoint folder (saved every --eval-every steps)")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (as if interrupted)")
    parser.add_argument("--resume", action="store_true", help="resume from --checkpoint")
    parser.add_argument("--unsplit", action="store_true", help="run the same loop on the unsplit model, one process")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--out", default=None, help="write log.json (each step's loss, norm, LR, validation loss) and weights.pt here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.set_default_dtype(getattr(torch, args.dtype))
    if not args.unsplit:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(args.seed)  # the same weights on every rank
    model = GPT(vocab=VOCAB, d_model=32, n_layers=4, n_heads=4, max_len=SEQ)
    val_tokens, val_targets = batch(args.seed + 1, 0, 0)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Each batch's share of the accumulated step's mean loss (torchtitan rescales its loss so).
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / args.accumulate

    if args.unsplit:
        pipe = None
        params = list(model.parameters())
    else:
        tokens, targets = batch(args.seed, 0, 0)
        pipe = autosplit.distribute(model, ["cpu"] * dist.get_world_size(), example_inputs=(tokens,), loss_fn=loss_fn,
                                    schedule=args.schedule, micro_batches=4, time_limit=5)
        params = list(pipe.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / args.warmup))

    folder, start, log = Path(args.checkpoint), 0, []
    if args.resume:
        if pipe is None:
            load_checkpoint(folder / "model", model, opt)
        else:
            pipe.load(folder / "model", optimizer=opt)
        state = json.loads((folder / "loop.json").read_text())
        scheduler.load_state_dict(state["scheduler"])
        start, log = state["step"], state["log"]

    for step in range(start, args.steps):
        losses: list[float | None] = []
        for k in range(args.accumulate):  # gradients add up over the batches, as backward() adds them
            tokens, targets = batch(args.seed, step, k)
            loss: torch.Tensor | None
            if pipe is None:
                loss = loss_fn(model(tokens), targets)
                loss.backward()
            else:
                loss = pipe.step(tokens, target=targets)  # None off the last stage
            losses.append(None if loss is None else loss.item() * args.accumulate)
        if pipe is None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        else:
            norm = pipe.clip_grad_norm_(args.max_norm)  # the whole model's norm, the same on every rank
        known = [x for x in losses if x is not None]  # the loss is known on the last stage's ranks
        entry = {"step": step, "lr": scheduler.get_last_lr()[0], "norm": norm.item(),
                 "loss": sum(known) / len(known) if len(known) == len(losses) else None}
        opt.step()
        scheduler.step()
        opt.zero_grad()
        if (step + 1) % args.eval_every == 0:
            val: torch.Tensor | None
            if pipe is None:
                model.eval()
                with torch.no_grad():
                    val = loss_fn(model(val_tokens), val_targets)
                model.train()
            else:
                pipe.eval()
                val = pipe.eval_step(val_tokens, target=val_targets)  # forward only; no gradient touched
                pipe.train()
            entry["val_loss"] = None if val is None else val.item() * args.accumulate
            if pipe is None:
                save_checkpoint(folder / "model", model, opt)
            else:
                pipe.save(folder / "model", optimizer=opt)  # every rank: one layout-free checkpoint
        log.append(entry)
        if pipe is None or pipe.is_last:
            print(json.dumps(entry), flush=True)
        if (step + 1) % args.eval_every == 0 and (pipe is None or (pipe.is_last and pipe.layout.replica == 0)):
            save_loop_state(folder, {"step": step + 1, "scheduler": scheduler.state_dict(), "log": log})
        if args.stop_after is not None and step + 1 >= args.stop_after:
            break

    weights = model.state_dict() if pipe is None else pipe.full_state_dict()  # collective on a pipeline
    if args.out and (pipe is None or (pipe.is_last and pipe.layout.replica == 0)):
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "log.json").write_text(json.dumps(log))
        torch.save(weights, Path(args.out, "weights.pt"))
    if pipe is not None:
        pipe.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
