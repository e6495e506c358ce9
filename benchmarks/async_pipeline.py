"""Asynchronous pipelines on a real task: GPipe (synchronous) against async, PipeDream and XPipe.

The task: a character-level language model (``autosplit.examples.GPT``, untied head) trained
on Python's own standard-library source, which ships with every Python (the first
``--chars`` characters of its ``.py`` files in sorted order, bytes above 127 folded to 127);
the last tenth is held out. Every schedule trains on the same mini-batches for the same number
of samples, on 2 processes over gloo (each pinned to its own core with one thread, the model
split by autosplit, ``--micro`` micro-batches per mini-batch), with Adam; the figure is the
held-out loss after training (mean and spread over ``--seeds`` seeds: the model's
initialisation and the batch order). Throughput is samples per second of the training loop,
measured in the same runs, beside the unsplit model on 1 and 2 threads (same steps, same
batches).

``--stages 4`` runs the pipeline 4 deep (4 gloo processes; XPipe's case for weight prediction
is deep pipelines, where the version difference grows with the stage count: with ``--micro 2``
stage 0 holds two mini-batches in flight and runs up to 2 updates behind; GPipe, whose training
does not depend on M, runs at least one micro-batch per stage). With more processes
than cores the processes share them, so throughput is not measured but predicted (the plan's
replayed step); the held-out losses and every stage's version differences are measured. The
verdict compares each asynchronous schedule's gap to GPipe with GPipe's spread over seeds.

Usage::

    .venv/bin/python benchmarks/async_pipeline.py                 # 4 schedules × 3 seeds, about 6 min
    .venv/bin/python benchmarks/async_pipeline.py --stages 4 --micro 2 --out /tmp/depth4.json   # about 10 min
    .venv/bin/python benchmarks/async_pipeline.py --steps 50 --seeds 1 --out /tmp/quick.json

Writes ``benchmarks/results/async_pipeline.json`` (``--out``), the file ``docs/schedules.md`` reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
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
from benchmarks.plan_time import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "async_pipeline.json"
SCHEDULES = ("gpipe", "async", "pipedream", "xpipe")
VOCAB = 128


def corpus(chars: int) -> torch.Tensor:
    """The standard library's source as byte codes (0–127)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= chars:
            break
    text = b"".join(parts)[:chars]
    return torch.tensor(list(text), dtype=torch.long).clamp_(max=VOCAB - 1)


def make(args: argparse.Namespace, seed: int) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The model, the training mini-batches (inputs, targets) and the held-out text, for ``seed``."""
    torch.manual_seed(seed)
    model = GPT(vocab=VOCAB, d_model=args.width, n_layers=args.layers, n_heads=4, max_len=args.seq, tied=False)
    data = corpus(args.chars)
    split = len(data) * 9 // 10
    train, held = data[:split], data[split:]
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train) - args.seq - 1, (args.steps, args.batch), generator=g)
    batches = [(torch.stack([train[s:s + args.seq] for s in row]), torch.stack([train[s + 1:s + args.seq + 1] for s in row]))
               for row in starts]
    return model, batches, held


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def held_out_loss(model: torch.nn.Module, held: torch.Tensor, seq: int, rows: int = 64) -> float:
    n = min(rows, (len(held) - 1) // seq)
    x = held[: n * seq].view(n, seq)
    y = held[1: n * seq + 1].view(n, seq)
    with torch.no_grad():
        return float(loss_fn(model(x), y))


def _worker(rank: int, init: str, schedule: str, seed: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})  # a core each; shared beyond the cores
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.stages, timeout=timedelta(minutes=10))
    try:
        model, batches, held = make(args, seed)
        # GPipe's training does not depend on M (one synchronous update per mini-batch): below one
        # micro-batch per stage it runs one per stage, which only its (predicted) throughput sees.
        micro = max(args.micro, args.stages) if schedule == "gpipe" else args.micro
        pipe = autosplit.distribute(model, ["cpu"] * args.stages, example_inputs=(batches[0][0],), loss_fn=loss_fn,
                                    schedule=schedule, micro_batches=micro, time_limit=5, seed=0)
        opt = torch.optim.Adam(pipe.parameters(), lr=args.lr)
        dist.barrier()
        t0 = time.perf_counter()
        if schedule == "gpipe":
            for x, y in batches:
                pipe.step(x, target=y)
                opt.step()
                opt.zero_grad()
        else:
            pipe.run(batches, optimizer=opt)
        dist.barrier()
        seconds = time.perf_counter() - t0
        state = pipe.full_state_dict()
        runs: list = [None] * args.stages
        dist.all_gather_object(runs, pipe.last_run)
        if rank == 0:
            model.load_state_dict(state)
            torch.save({"seconds": seconds, "held_out": held_out_loss(model, held, args.seq), "predicted_step": pipe.plan.step_time,
                        "stage_params": [s.params for s in pipe.plan.stages], "run": runs[0],
                        "version_differences": [_differences(r) for r in runs]}, out)
    finally:
        dist.destroy_process_group()


def _differences(run: dict) -> dict | None:
    """A stage's version differences (updates between a forward and the update its gradient meets), summarised."""
    values = run.get("version_differences") if run else None
    if not values:
        return None
    return {"min": min(values), "max": max(values), "mean": statistics.mean(values)}


def verdict(summary: dict) -> dict:
    """Each asynchronous schedule's held-out gap to GPipe, against GPipe's spread over seeds; and
    whether weight prediction (XPipe) closes the gap that staleness (async) opens."""
    if "gpipe" not in summary:
        return {}
    base, noise = summary["gpipe"]["held_out_mean"], summary["gpipe"]["held_out_std"]
    gaps = {name: s["held_out_mean"] - base for name, s in summary.items() if name != "gpipe"}
    out: dict = {"gpipe_std": noise, "gap_to_gpipe": gaps}
    if "async" in gaps and "xpipe" in gaps:
        stale, predicted = gaps["async"], gaps["xpipe"]
        if stale <= noise:
            out["xpipe"] = f"staleness opens no gap beyond GPipe's spread over seeds ({stale:+.4f} vs sd {noise:.4f})"
        elif predicted <= noise:
            out["xpipe"] = f"weight prediction closes it: XPipe {predicted:+.4f} against async {stale:+.4f} (GPipe sd {noise:.4f})"
        elif predicted < stale:
            out["xpipe"] = f"weight prediction narrows it by {1 - predicted / stale:.0%}: XPipe {predicted:+.4f} against async {stale:+.4f}"
        else:
            out["xpipe"] = f"weight prediction does not narrow it: XPipe {predicted:+.4f} against async {stale:+.4f}"
    return out


def unsplit(args: argparse.Namespace, threads: int) -> dict:
    model, batches, held = make(args, 0)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    torch.set_num_threads(threads)
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(range(threads)))
    try:
        t0 = time.perf_counter()
        for x, y in batches:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        seconds = time.perf_counter() - t0
    finally:
        os.sched_setaffinity(0, previous)
    return {"seconds": seconds, "samples_per_s": args.steps * args.batch / seconds, "held_out": held_out_loss(model, held, args.seq)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="mini-batches per run")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--chars", type=int, default=2_000_000)
    parser.add_argument("--stages", type=int, default=2, help="pipeline depth: one process per stage")
    parser.add_argument("--out", default=str(RESULTS), help="default: results/async_pipeline.json, the file the docs read")
    args = parser.parse_args(argv)
    timed = args.stages <= len(os.sched_getaffinity(0))  # a core per process: throughput measured, else predicted

    start = time.time()
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for schedule in args.schedules.split(","):  # the schedules of one seed side by side
                out = os.path.join(tmp, f"{schedule}-{seed}.pt")
                mp.spawn(_worker, args=(os.path.join(tmp, f"init-{schedule}-{seed}"), schedule, seed, args, out),
                         nprocs=args.stages, join=True)
                r = torch.load(out, weights_only=False)
                r["samples_per_s"] = args.steps * args.batch / r["seconds"] if timed else None
                r["predicted_samples_per_s"] = args.batch / r["predicted_step"]
                runs.setdefault(schedule, []).append(r)
                shown = f"{r['samples_per_s']:7.1f} samples/s" if timed else f"{r['predicted_samples_per_s']:7.1f} samples/s predicted"
                gaps = " ".join(f"{d['max']}" if d else "-" for d in r["version_differences"])
                print(f"seed {seed} {schedule:9s} held-out loss {r['held_out']:.4f}  {shown}  most updates behind, per stage: {gaps}")
    baseline = {f"{t} thread{'s' * (t > 1)}": unsplit(args, t) for t in (1, 2)}
    summary = {}
    for schedule, rs in runs.items():
        losses, speed = [r["held_out"] for r in rs], [r["samples_per_s"] for r in rs]
        summary[schedule] = {
            "held_out_mean": statistics.mean(losses), "held_out_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "held_out": losses, "samples_per_s_median": statistics.median(speed) if timed else None, "samples_per_s": speed,
            "predicted_samples_per_s": rs[0]["predicted_samples_per_s"],
            "stashed_copies_stage0": [(r["run"] or {}).get("stashed_copies") for r in rs],
            "version_differences": rs[0]["version_differences"],
        }
    print(f"\n{'schedule':12s} {'held-out loss (mean ± sd)':>26s} {'samples/s':>10s} {'predicted':>10s}  "
          "version difference per stage (mean)")
    for schedule, s in summary.items():
        measured = f"{s['samples_per_s_median']:10.1f}" if timed else f"{'-':>10s}"
        differences = " ".join(f"{d['mean']:.2f}" if d else "-" for d in s["version_differences"])
        print(f"{schedule:12s} {s['held_out_mean']:15.4f} ± {s['held_out_std']:.4f} {measured} "
              f"{s['predicted_samples_per_s']:10.1f}  {differences}")
    verdicts = verdict(summary)
    print(json.dumps(verdicts, indent=1))
    for label, b in baseline.items():
        print(f"{'unsplit ' + label:24s} {b['held_out']:7.4f} (seed 0) {b['samples_per_s']:12.1f}")
    print(f"(initial loss ln {VOCAB} = {math.log(VOCAB):.3f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": machine(), "seconds": time.time() - start, "args": vars(args), "throughput_measured": timed,
        "summary": summary, "verdict": verdicts, "unsplit": baseline, "runs": runs,
    }, indent=1, default=str))
    print(f"wrote {args.out} in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
