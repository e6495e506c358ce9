"""The training loop's verbs on a 2-process pipeline: time and peak memory of a training step
(``pipe.step``), a forward-only loss (``pipe.eval_step``) and a forward-only output (``pipe(x)``),
eager and with ``compile=True``, beside the unsplit model on 1 and 2 threads.

Each verb runs in its own fresh pair of gloo processes (each pinned to its own core, one thread),
from one plan made up front, so one verb's buffers never count in another's memory. Memory is the
rise of each rank's peak resident set over its resident set when the verb's first call begins
(Linux: ``/proc/self/clear_refs`` resets the peak, ``VmHWM`` reads it): what the verb holds, its
own stages and receive buffers included. Time is the median of ``--steps`` calls after 2 warm-up
calls, on the slower rank. The issue's requirement: a forward-only verb holds no more memory than a
training step.

Usage::

    .venv/bin/python benchmarks/training_loop.py              # writes benchmarks/results/training_loop.json
    .venv/bin/python benchmarks/training_loop.py --no-compile # eager only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autosplit  # noqa: E402
from autosplit.examples import GPT  # noqa: E402
from autosplit.timers import pinned  # noqa: E402
from benchmarks.plan_time import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "training_loop.json"
VERBS = ("step", "eval_step", "forward")


def _status(key: str) -> int:
    """``key`` of ``/proc/self/status`` (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _make(args: argparse.Namespace):
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d_model=args.width, n_layers=args.layers, n_heads=4, max_len=args.seq)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    return model, tokens, torch.roll(tokens, -1, dims=1)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _worker(rank: int, init: str, out: str, plan: str, verb: str, compiled: bool, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    with pinned(1, [rank]):
        model, tokens, targets = _make(args)
        pipe = autosplit.distribute(model, None, example_inputs=(tokens,), loss_fn=loss_fn, plan=plan, compile=compiled)
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        call = {
            "step": lambda: pipe.step(tokens, target=targets),
            "eval_step": lambda: pipe.eval_step(tokens, target=targets),
            "forward": lambda: pipe(tokens),
        }[verb]
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
        base = _status("VmRSS")
        times = []
        for _ in range(2 + args.steps):
            dist.barrier()
            start = time.perf_counter()
            call()
            if verb == "step":
                opt.step()
                opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        peak = _status("VmHWM") - base
    Path(out, f"{rank}.json").write_text(json.dumps({"time": statistics.median(times[2:]), "first": times[0], "peak": peak}))
    pipe.close()
    dist.destroy_process_group()


def _unsplit(args: argparse.Namespace, threads: int) -> dict[str, float]:
    model, tokens, targets = _make(args)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times: dict[str, list[float]] = {"step": [], "forward": []}
    with pinned(threads, list(range(threads))):
        for _ in range(2 + args.steps):
            start = time.perf_counter()
            loss_fn(model(tokens), targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times["step"].append(time.perf_counter() - start)
            start = time.perf_counter()
            with torch.no_grad():
                model(tokens)
            times["forward"].append(time.perf_counter() - start)
    return {k: statistics.median(v[2:]) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)

    model, tokens, targets = _make(args)
    plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=(tokens,), loss_fn=loss_fn, example_target=targets,
                          schedule=args.schedule, micro_batches=args.micro_batches, time_limit=10)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = str(Path(tmp, "plan.json"))
        plan.save(plan_path)
        for compiled in (False,) if args.no_compile else (False, True):
            for verb in VERBS:
                out = Path(tmp, f"{verb}-{compiled}")
                out.mkdir()
                mp.spawn(_worker, args=(str(out / "init"), str(out), plan_path, verb, compiled, args), nprocs=2, join=True)
                ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
                rows.append({"verb": verb, "compile": compiled, "time_s": max(r["time"] for r in ranks),
                             "first_call_s": max(r["first"] for r in ranks), "peak_mib": [r["peak"] / 2**20 for r in ranks]})
    unsplit = {threads: _unsplit(args, threads) for threads in (1, 2)}

    print(f"{'verb':<10} {'compile':<8} {'time (ms)':>10} {'first call (ms)':>16} {'peak rise MiB (rank 0, 1)':>28}")
    for r in rows:
        peaks = ", ".join(f"{p:.1f}" for p in r["peak_mib"])
        print(f"{r['verb']:<10} {r['compile']!s:<8} {r['time_s'] * 1e3:>10.1f} {r['first_call_s'] * 1e3:>16.1f} {peaks:>28}")
    for threads, times in unsplit.items():
        print(f"unsplit, {threads} thread(s): step {times['step'] * 1e3:.1f} ms, forward {times['forward'] * 1e3:.1f} ms")
    verdict = {}
    for compiled in sorted({r["compile"] for r in rows}):
        by = {r["verb"]: r for r in rows if r["compile"] == compiled}
        verdict[f"forward_only_within_step_memory{'_compiled' if compiled else ''}"] = all(
            max(by[v]["peak_mib"][i] for v in ("eval_step", "forward")) <= by["step"]["peak_mib"][i] for i in range(2))
    print(json.dumps(verdict))
    Path(args.out).write_text(json.dumps({
        "machine": machine(), "args": vars(args), "plan": {"schedule": plan.schedule, "micro_batches": plan.micro_batches,
                                                           "step_time_predicted_s": plan.step_time},
        "rows": rows, "unsplit": {str(k): v for k, v in unsplit.items()}, "verdict": verdict,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
