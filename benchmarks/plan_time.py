"""Time of each compiler pass for a 24-layer GPT-style model onto 4 and 8 devices.

Prints a table and writes ``benchmarks/results/plan_time.json``. The model is GPT-2
medium-sized (d_model 768, 24 layers, vocab 50257, sequence 1024, batch 8); the split is
built on logical CPU devices, so codegen is timed too. A tiny warm-up plan runs first so
one-off lazy imports inside torch are not charged to the first pass.

Usage::

    python benchmarks/plan_time.py                     # the real size, ~1-2 minutes
    python benchmarks/plan_time.py --layers 4 --width 64 --vocab 512 --seq 64   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autosplit
from autosplit.examples import GPT

PASSES = ("capture", "annotate", "estimate", "build", "solve", "validate", "codegen")


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver limit (the library default)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_time.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    warm = GPT(vocab=64, d_model=16, n_layers=1, n_heads=2, max_len=8)
    autosplit.plan(warm, ["cpu"] * 2, example_inputs=(torch.randint(0, 64, (2, 8)),), time_limit=1)

    model = GPT(vocab=args.vocab, d_model=args.width, n_layers=args.layers, n_heads=args.heads, max_len=args.seq)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    rows = []
    for n in args.devices:
        start = time.perf_counter()
        split = autosplit.autosplit(model, ["cpu"] * n, example_inputs=(tokens,), time_limit=args.time_limit, seed=0)
        total = time.perf_counter() - start
        plan = split.plan
        rows.append({
            "devices": n,
            "nodes": len(plan.assignment),
            "passes_s": {k: plan.timings[k] for k in PASSES},
            "total_s": total,
            "solver_status": plan.solver.status,
            "gap": plan.solver.gap,
            "predicted_step_ms": plan.step_time * 1e3,
            "bottleneck_stage_ms": plan.stages[plan.bottleneck].time * 1e3,
        })
        for p in model.parameters():  # back to one device for the next configuration
            p.data = p.data.to("cpu")

    header = f"{'devices':>7} {'nodes':>6} " + " ".join(f"{p:>9}" for p in PASSES) + f" {'total':>8} {'status':>9} {'gap':>7}"
    print(f"GPT {args.layers} layers, d_model {args.width}, vocab {args.vocab}, seq {args.seq}, batch {args.batch} "
          f"(seconds per pass; time limit {args.time_limit:g}s)")
    print(header)
    for r in rows:
        cells = " ".join(f"{r['passes_s'][p]:9.3f}" for p in PASSES)
        print(f"{r['devices']:>7} {r['nodes']:>6} {cells} {r['total_s']:8.2f} {r['solver_status']:>9} {r['gap']:7.2%}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "plan_time", "model": vars(args), "machine": machine(), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
