"""Memory per rank: a model built on the meta device and loaded stage by stage, against the same
model built real on every rank.

For each GPT-style size and process count, gloo processes (one thread each) run
``autosplit.distribute`` and one Adam step, in two ways:

- ``meta``: the model is built under ``torch.device("meta")`` and each rank loads only its
  stage's weights from a ``torch.save`` checkpoint (memory-mapped, read by name);
- ``real``: every rank builds the whole model (the behaviour before meta-device support), as a
  user without it would; the stage uses the model's own tensors and the rest stays allocated.

Each rank reports its resident set before building anything (an idle process that imported torch
and autosplit, and the torch modules every pipelined run loads: ``torch.distributed.pipelining``
and ``torch.export``, about 70 MB that ``import autosplit`` leaves for first use; the figure
without them is kept in the JSON), its peak resident set after (``VmHWM``, reset once idle), and its stage's
predicted memory from the plan (state + activations + received + sent + transient). Targets
(issue 23): peak ≤ idle + predicted × 1.1; predicted within 15% of the measured increase.

Prints a table and writes ``benchmarks/results/memory_per_rank.json``.

Usage::

    python benchmarks/memory_per_rank.py                               # the sizes below
    python benchmarks/memory_per_rank.py --sizes 0.1 --procs 2 --modes meta   # a quick look
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.plan_time import machine

# name → (d_model, layers, heads); vocabulary 50257, sequence 128, tied embeddings
SIZES = {"0.1": (768, 12, 12), "0.35": (1024, 24, 16), "0.7": (1280, 36, 20)}
VOCAB, SEQ, BATCH = 50257, 128, 4


def _rss() -> tuple[int, int]:
    """(current, peak) resident set of this process, bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _model(size: str) -> torch.nn.Module:
    from autosplit.examples import GPT

    d, layers, heads = SIZES[size]
    return GPT(vocab=VOCAB, d_model=d, n_layers=layers, n_heads=heads, max_len=SEQ)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _worker(rank: int, world: int, size: str, mode: str, checkpoint: str, init: str, out: str) -> None:
    import torch.distributed as dist

    import autosplit

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    bare, _ = _rss()
    for module in ("torch.distributed.pipelining", "torch.export"):  # torch's own modules any pipelined run loads
        importlib.import_module(module)  # (about 70 MB, mostly sympy), which ``import autosplit`` leaves for first use
    idle, _ = _rss()
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    if mode == "meta":
        with torch.device("meta"):
            model = _model(size)
        pipe = autosplit.distribute(model, ["cpu"] * world, example_inputs=(tokens,), loss_fn=_loss, weights=checkpoint,
                                    micro_batches=world, time_limit=5)
    else:
        model = _model(size)
        pipe = autosplit.distribute(model, ["cpu"] * world, example_inputs=(tokens,), loss_fn=_loss, micro_batches=world, time_limit=5)
    built, _ = _rss()
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-4)
    pipe.step(tokens, target=torch.roll(tokens, -1, dims=1))
    opt.step()
    opt.zero_grad(set_to_none=False)
    _, peak = _rss()
    stage = pipe.plan.stages[pipe.stage_index]
    row = {"rank": rank, "idle_rss": idle, "idle_rss_before_torch_pipelining": bare, "built_rss": built, "peak_rss": peak,
           "predicted": stage.memory,
           "predicted_parts": {"state": stage.memory_state, "activations": stage.memory_activations, "received": stage.memory_received,
                               "sent": stage.memory_sent, "transient": stage.memory_transient},
           "stage_params": stage.params}
    Path(out, f"{mode}-{size}-{world}-{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--procs", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--modes", nargs="+", default=["meta", "real"], choices=["meta", "real"])
    parser.add_argument("--real-limit-gb", type=float, default=16.0,
                        help="skip the real mode where every rank's whole model plus the stages' training state would exceed this")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory_per_rank.json"))
    args = parser.parse_args(argv)
    rows = []
    print(f"{'size':>5s} {'params':>7s} {'procs':>5s} {'mode':>4s} {'rank':>4s} {'idle GB':>8s} {'peak GB':>8s} "
          f"{'predicted GB':>12s} {'increase GB':>11s} {'pred/incr':>9s} {'peak ≤ idle+1.1·pred':>20s} {'fp32 model GB':>13s}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            torch.manual_seed(0)
            real = _model(size)
            params = sum(p.numel() for p in real.parameters())
            checkpoint = str(Path(tmp, f"gpt-{size}.pt"))
            torch.save(real.state_dict(), checkpoint)
            del real
            for world in args.procs:
                for mode in args.modes:
                    if mode == "real" and (world * params * 4 + params * 16) / 1e9 > args.real_limit_gb:
                        print(f"{size:>5s} {params / 1e9:6.2f}B {world:5d} real: skipped, about "
                              f"{(world * params * 4 + params * 16) / 1e9:.0f} GB for the whole run > --real-limit-gb")
                        continue
                    init = str(Path(tmp, f"init-{size}-{world}-{mode}"))
                    mp.spawn(_worker, args=(world, size, mode, checkpoint, init, tmp), nprocs=world, join=True)
                    for rank in range(world):
                        r = json.loads(Path(tmp, f"{mode}-{size}-{world}-{rank}.json").read_text())
                        increase = r["peak_rss"] - r["idle_rss"]
                        row = {"size": size, "params": params, "procs": world, "mode": mode, **r, "increase": increase,
                               "model_fp32_bytes": params * 4, "ratio_predicted_to_increase": r["predicted"] / increase,
                               "within_target": r["peak_rss"] <= r["idle_rss"] + 1.1 * r["predicted"]}
                        rows.append(row)
                        print(f"{size:>5s} {params / 1e9:6.2f}B {world:5d} {mode:>4s} {rank:4d} {r['idle_rss'] / 1e9:8.2f} "
                              f"{r['peak_rss'] / 1e9:8.2f} {r['predicted'] / 1e9:12.2f} {increase / 1e9:11.2f} "
                              f"{row['ratio_predicted_to_increase']:9.2f} {row['within_target']!s:>20s} {params * 4 / 1e9:13.2f}")
    Path(args.out).write_text(json.dumps({"machine": machine(), "seq": SEQ, "batch": BATCH, "vocab": VOCAB, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
