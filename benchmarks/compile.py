"""Eager against ``torch.compile``d stages: the step time of one split model, side by side on this CPU.

The GPT of issue #8 (``pipeline_runtime.py``'s workload: 8 layers, d_model 256, vocab 8000, seq 128,
batch 8) planned onto 2 stages, built twice from the same weights in one process
(:class:`~autosplit.runtime.local.SplitModule`): ``autosplit(..., compile=False)`` and
``compile=True`` (inductor; each stage's flat GraphModule compiled in place). A step is forward,
loss, backward and an Adam step (the optimizer eager in both). Per ``--threads`` setting (pinned to
cores 0..n-1), the unsplit model (eager) and the two splits are timed in alternating rounds —
``--block`` consecutive steps of one (the first untimed: it brings its weights back into cache), then
the next one's — after one untimed warm-up round; the figure is the median over ``--steps`` steps
(min and max beside it). With ``--threads 1,2`` that puts the unsplit model on 1 and on 2 threads
beside the splits (DESIGN §6), each timed in the same rounds as the splits it is compared with (this
machine is shared and noisy).

Compilation is reported apart: the wall time of the compiled split's first step, and that step less
the eager median (what compiling added). Inductor's on-disk caches are sent to a fresh directory
per run (``TORCHINDUCTOR_CACHE_DIR``), so the figure is a cold compile; ``--warm-cache`` keeps the
user's cache. The first step's losses of the two splits are compared as a sanity check.

Prints a table and writes ``benchmarks/results/compile.json`` with the machine.

Usage::

    .venv/bin/python benchmarks/compile.py                    # 1 and 2 threads, about 6 min
    .venv/bin/python benchmarks/compile.py --threads 1 --steps 8
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autosplit  # noqa: E402
from autosplit.options import ProfileOptions  # noqa: E402
from autosplit.timers import pinned, steady_allocator  # noqa: E402
from benchmarks.pipeline_runtime import workload  # noqa: E402
from benchmarks.plan_time import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "compile.json"


def _stats(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


class _Run:
    """One model (split or not) and its Adam, stepping on the workload's batch."""

    def __init__(self, split: Any, inputs: tuple, target: torch.Tensor, loss_fn: Any) -> None:
        self.split, self.inputs, self.target, self.loss_fn = split, inputs, target, loss_fn
        self.opt = torch.optim.Adam(split.parameters(), lr=1e-4)
        self.times: list[float] = []

    def step(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = self.loss_fn(self.split(*self.inputs), self.target)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - t0, loss.item()


def split_side_by_side(plan: Any, threads: int, args: argparse.Namespace) -> dict:
    """Eager and compiled splits of ``plan`` on ``threads`` pinned threads, timed in alternating rounds."""
    model, inputs, target, loss_fn = workload("gpt")
    with pinned(threads, tuple(range(threads))):
        unsplit = _Run(copy.deepcopy(model), inputs, target, loss_fn)
        eager = _Run(autosplit.autosplit(copy.deepcopy(model), None, example_inputs=inputs, plan=plan), inputs, target, loss_fn)
        t0 = time.perf_counter()
        compiled_split = autosplit.autosplit(copy.deepcopy(model), None, example_inputs=inputs, plan=plan, compile=True)
        build = time.perf_counter() - t0
        compiled = _Run(compiled_split, inputs, target, loss_fn)
        first_eager, loss_eager = eager.step()
        first_compiled, loss_compiled = compiled.step()  # compiles every stage, forward and backward
        for r in range(1 + -(-args.steps // args.block)):
            for run in (unsplit, eager, compiled):
                for i in range(args.block + 1):
                    seconds, _ = run.step()
                    if r > 0 and i > 0:
                        run.times.append(seconds)
    e, c = _stats(eager.times), _stats(compiled.times)
    gain = e["median"] - c["median"]
    return {
        "threads": threads, "unsplit_eager": _stats(unsplit.times), "eager": e, "compiled": c, "speedup": e["median"] / c["median"],
        "status": compiled_split.compiled,
        "compile": {"build_seconds": build, "first_step_seconds": first_compiled,
                    "added_seconds": first_compiled - e["median"], "eager_first_step_seconds": first_eager,
                    # steps until compiling pays for itself (None: the compiled steps are no faster)
                    "break_even_steps": None if gain <= 0 else (first_compiled - e["median"]) / gain},
        "first_loss": {"eager": loss_eager, "compiled": loss_compiled, "abs_diff": abs(loss_eager - loss_compiled)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="thread counts the splits are timed on (pinned to cores 0..n-1)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--block", type=int, default=2, help="consecutive timed steps of one split")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache (default: a fresh one)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    start = time.time()
    steady_allocator()
    cache = None if args.warm_cache else tempfile.TemporaryDirectory(prefix="inductor-cold-")
    if cache is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name
    model, inputs, _, _ = workload("gpt")
    plan = autosplit.plan(model, ["cpu"] * args.stages, example_inputs=inputs, time_limit=10,
                          costs=ProfileOptions(threads=1, cores=(0,), use_cache=False))
    rows = [split_side_by_side(plan, int(n), args) for n in args.threads.split(",")]
    report(rows, [list(s.modules) for s in plan.stages])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": machine(), "seconds": time.time() - start, "steps": args.steps, "block": args.block,
        "workload": "gpt: 8 layers, d_model 256, vocab 8000, seq 128, batch 8; Adam", "stages": args.stages,
        "cold_cache": cache is not None, "stage_modules": [list(s.modules) for s in plan.stages],
        "split": rows,
    }, indent=1))
    print(f"wrote {args.out} in {time.time() - start:.0f}s")
    if cache is not None:
        cache.cleanup()
    return 0


def report(rows: list[dict], stages: list[list[str]]) -> None:
    print(f"\nGPT (8 layers, d256) on {len(stages)} stages in one process: {stages}; median ms of a step (min-max)")
    print(f"{'threads':>7s} {'unsplit eager':>20s} {'split eager':>20s} {'split compiled':>20s} {'speedup':>8s} "
          f"{'compile s':>10s} {'break-even':>10s} {'loss diff':>10s}")
    for r in rows:
        cells = [f"{x['median'] * 1e3:6.0f} ({x['min'] * 1e3:4.0f}-{x['max'] * 1e3:4.0f})"
                 for x in (r["unsplit_eager"], r["eager"], r["compiled"])]
        even = r["compile"]["break_even_steps"]
        print(f"{r['threads']:>7d} {cells[0]:>20s} {cells[1]:>20s} {cells[2]:>20s} {r['speedup']:7.2f}x "
              f"{r['compile']['added_seconds']:10.1f} {'never' if even is None else f'{even:.0f}':>10s} "
              f"{r['first_loss']['abs_diff']:10.1e}")

if __name__ == "__main__":
    sys.exit(main())
