"""Activation checkpointing chosen by the planner, measured: memory per rank against the plan, and
the step against recomputing every block (issue 25 item 4).

For a GPT (``autosplit.examples.GPT``) and a transformers Llama (built from a config, no download),
both real, fp32, on 2 gloo processes (one core and one thread each), 1F1B (``--schedule gpipe``:
GPipe, where every stage holds all 8 micro-batches and a block may keep some of them):

1. the cap: 2% under the least cap at which ``checkpointing="none"`` fits (bisected between the
   fullest devices of the uncapped ``"full"`` and ``"none"`` plans), so that keeping every
   activation does not fit and recomputing every block does;
2. plan ``"auto"``, ``"full"`` and ``"selective"`` (``checkpointing="auto", selective=True``: the solver
   chooses the blocks, each keeping its matmuls' and attention's outputs) under that cap, run them,
   interleaved step by step (a slow minute of this machine falls on all), and report the median step
   of each and their ratios to ``"full"``;
3. per rank, the peak of the bytes of live tensors during one step (``autosplit.timers.MemoryTracker``:
   every storage created inside it, plus the stage's parameters, optimizer state and torch's receive
   buffers, counted once)
   against the plan's predicted peak for that device (``plan.rank_memory``), and the peak resident
   set increase (``VmHWM``) beside it for reference.

Beside the pipelines: the unsplit model's step on 1 thread and on 2 threads.

Targets (issue 25): "auto" fits where "none" does not; measured peak within 15% of the predicted on
every rank; "auto" faster than "full" (ratio < 1). Selective recomputation is reported beside them.

Prints a table and writes ``benchmarks/results/memory_levers.json`` (``--out``), the file
``docs/precision-and-recomputation.md`` reads.

Usage::

    python benchmarks/memory_levers.py               # GPT and Llama, ~2 min on 2 cores
    python benchmarks/memory_levers.py --schedule gpipe --out /tmp/gpipe.json   # every stage holding all M
    python benchmarks/memory_levers.py --models gpt --steps 4 --out /tmp/quick.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autosplit
from autosplit.errors import InfeasiblePlanError, SolverError
from autosplit.timers import MemoryTracker, steady_allocator
from benchmarks.pipeline_runtime import timed_steps
from benchmarks.plan_time import machine

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, SEQ, VOCAB = 8, 128, 2048
MICRO = {"gpt": 8, "llama": 4}
"""Micro-batches per step: the Llama's exported graph specialises a batch of one row, so its micro-batches hold two."""


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = getattr(logits, "logits", logits)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def workload(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor], torch.Tensor]:
    """The model (seeded, the same in every process), its input tokens and their targets."""
    torch.manual_seed(0)
    if name == "gpt":
        from autosplit.examples import GPT

        model: torch.nn.Module = GPT(vocab=VOCAB, d_model=256, n_layers=8, n_heads=4, max_len=SEQ)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False)
        config._attn_implementation = "sdpa"
        model = LlamaForCausalLM(config)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, (tokens,), torch.roll(tokens, -1, dims=1)


def _rss() -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def _receive_buffers(pipe: Any) -> list[torch.Tensor]:
    """The buffers torch's stages made before the measured step (one per micro-batch for each
    received activation and each gradient coming back; torch's private ``_RecvInfo`` records)."""
    infos = [info for stage in pipe._stages for table in (stage.args_recv_info, stage.grad_recv_info)
             for chunk in table.values() for info in chunk]
    return [info.buffer for info in infos if isinstance(getattr(info, "buffer", None), torch.Tensor)]


def _worker(rank: int, init: str, name: str, plans: list[tuple[str, str]], steps: int, out: str) -> None:
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank})
    steady_allocator()
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2, timeout=timedelta(minutes=10))
    try:
        model, inputs, target = workload(name)
        rows: list[dict[str, Any]] = []
        for label, path in plans:
            pipe = autosplit.distribute(copy.deepcopy(model), None, example_inputs=inputs, loss_fn=_loss, plan=path)
            opt = torch.optim.Adam(pipe.parameters(), lr=1e-4)
            for _ in range(2):  # warm-up: the optimizer's state exists from here on
                pipe.step(*inputs, target=target)
                opt.step()
                opt.zero_grad()
            dist.barrier()
            idle, _ = _rss()
            Path("/proc/self/clear_refs").write_text("5")  # the resident peak from here on
            tracker = MemoryTracker()
            tracker.track(list(pipe.parameters()), _optimizer_tensors(opt), _receive_buffers(pipe))
            with tracker:
                pipe.step(*inputs, target=target)
                opt.step()
                opt.zero_grad()
            _, peak_rss = _rss()
            rows.append({"label": label, "pipe": pipe, "opt": opt, "measured_peak": tracker.peak, "rss_increase": peak_rss - idle,
                         "times": []})
        for _ in range(steps):  # interleaved: one step of each plan in turn
            for row in rows:
                dist.barrier()
                t0 = time.perf_counter()
                row["pipe"].step(*inputs, target=target)
                row["opt"].step()
                row["opt"].zero_grad()
                row["times"].append(time.perf_counter() - t0)
        mine = [{k: v for k, v in row.items() if k not in ("pipe", "opt")} for row in rows]
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def plan_with(model: torch.nn.Module, inputs: tuple, name: str, schedule: str = "1f1b", **options: Any) -> autosplit.Plan:
    return autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, schedule=schedule, micro_batches=MICRO[name],
                          **{"time_limit": 20, **options})


def run_model(name: str, steps: int, tmp: str, schedule: str = "1f1b") -> dict[str, Any]:
    model, inputs, target = workload(name)

    uncapped = {mode: plan_with(model, inputs, name, schedule, checkpointing=mode) for mode in ("none", "full")}
    fullest = {mode: max(p.rank_memory or [s.memory for s in p.stages]) for mode, p in uncapped.items()}
    # The cap: 2% under the least at which keeping every activation fits (bisected), and above
    # what recomputing every block needs.
    low, high = fullest["full"], fullest["none"]
    while high - low > 2**16:
        mid = (low + high) // 2
        try:
            plan_with(model, inputs, name, schedule, checkpointing="none", memory={0: mid, 1: mid}, time_limit=5)
            high = mid
        except (InfeasiblePlanError, SolverError):
            low = mid
    cap = max(fullest["full"] + 2**16, int(high * 0.98))
    memory = {0: cap, 1: cap}
    row: dict[str, Any] = {"model": name, "params": sum(p.numel() for p in model.parameters()), "cap": cap,
                           "fullest_uncapped": fullest, "least_cap_keeping_all": high}
    start = time.perf_counter()
    try:
        plan_with(model, inputs, name, schedule, checkpointing="none", memory=memory)
        row["none"] = "fits (the cap is not tight enough)"
    except (InfeasiblePlanError, SolverError) as e:
        row["none"] = f"no plan: {str(e).split('. Likely cause')[0][:200]}"
    plans = {mode: plan_with(model, inputs, name, schedule, checkpointing=mode, memory=memory) for mode in ("auto", "full")}
    row["planning_s"] = time.perf_counter() - start
    try:
        plans["selective"] = plan_with(model, inputs, name, schedule, checkpointing="auto", selective=True, memory=memory)
    except (InfeasiblePlanError, SolverError) as e:
        row["selective"] = f"no plan: {str(e).split('. Likely cause')[0][:200]}"
    paths = []
    for mode, plan in plans.items():
        path = str(Path(tmp, f"{name}-{mode}.json"))
        plan.save(path)
        paths.append((mode, path))
        row[mode] = {"recompute": list(plan.recompute), "partial": [dataclasses.asdict(p) for p in plan.recompute_partial],
                     "predicted_step": plan.step_time,
                     "predicted_rank_memory": list(plan.rank_memory or [s.memory for s in plan.stages])}
    out = str(Path(tmp, f"{name}-measured.json"))
    mp.spawn(_worker, args=(str(Path(tmp, f"init-{name}")), name, paths, steps, out), nprocs=2, join=True)
    measured = json.loads(Path(out).read_text())
    for i, (mode, _) in enumerate(paths):
        ranks = [measured[r][i] for r in range(2)]
        # A step ends when both ranks have finished it: the slower rank's time, step by step.
        times = [max(a, b) for a, b in zip(ranks[0]["times"], ranks[1]["times"])]
        row[mode].update({
            "measured_step": statistics.median(times), "step_times": times,
            "measured_peak": [r["measured_peak"] for r in ranks], "rss_increase": [r["rss_increase"] for r in ranks],
        })
        row[mode]["peak_error"] = [m / p - 1 for m, p in zip(row[mode]["measured_peak"], row[mode]["predicted_rank_memory"])]
    row["auto_over_full"] = row["auto"]["measured_step"] / row["full"]["measured_step"]
    if "selective" in plans:
        row["selective_over_full"] = row["selective"]["measured_step"] / row["full"]["measured_step"]
    for threads in (1, 2):
        times = timed_steps(copy.deepcopy(model), inputs, target, _loss, threads=threads, steps=steps, warmup=1)
        row[f"unsplit_{threads}_thread"] = statistics.median(times)
    return row


def report(row: dict[str, Any]) -> None:
    mib = 2**20
    print(f"\n{row['model']}: {row['params'] / 1e6:.1f} M parameters, cap {row['cap'] / mib:.1f} MiB per device "
          f"(fullest device uncapped: none {row['fullest_uncapped']['none'] / mib:.1f} MiB, "
          f"full {row['fullest_uncapped']['full'] / mib:.1f} MiB); checkpointing='none' under the cap: {row['none']}")
    print(f"{'mode':>9s} {'blocks':>6s} {'partly':>6s} {'step ms':>8s} {'pred ms':>8s} {'rank':>4s} {'measured MiB':>12s} "
          f"{'predicted MiB':>13s} {'error':>6s} {'RSS+ MiB':>8s}")
    for mode in ("auto", "full", "selective"):
        r = row[mode]
        if isinstance(r, str):
            print(f"{mode:>9s} {r}")
            continue
        for rank in range(2):
            print(f"{mode:>9s} {len(r['recompute']):6d} {len(r['partial']):6d} {r['measured_step'] * 1e3:8.1f} "
                  f"{r['predicted_step'] * 1e3:8.1f} {rank:4d} {r['measured_peak'][rank] / mib:12.2f} "
                  f"{r['predicted_rank_memory'][rank] / mib:13.2f} {r['peak_error'][rank]:+6.1%} {r['rss_increase'][rank] / mib:8.1f}")
    print(f"auto / full step: {row['auto_over_full']:.3f}; selective / full: {row.get('selective_over_full', float('nan')):.3f}; "
          f"unsplit model: {row['unsplit_1_thread'] * 1e3:.1f} ms on 1 thread, "
          f"{row['unsplit_2_thread'] * 1e3:.1f} ms on 2 threads")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--out", default=str(RESULTS / "memory_levers.json"),
                        help="default: results/memory_levers.json, the file the docs read")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            rows.append(run_model(name, args.steps, tmp, args.schedule))
            report(rows[-1])
    targets = {
        "auto_fits_where_none_does_not": all(r["none"].startswith("no plan") for r in rows),
        "peak_within_15_percent": all(abs(e) <= 0.15 for r in rows for m in ("auto", "full", "selective")
                                      if isinstance(r[m], dict) for e in r[m]["peak_error"]),
        "auto_faster_than_full": all(r["auto_over_full"] < 1 for r in rows),
    }
    print(f"\ntargets: {targets}")
    Path(args.out).write_text(json.dumps({"machine": machine(), "batch": BATCH, "seq": SEQ, "vocab": VOCAB, "micro_batches": MICRO,
                                          "schedule": args.schedule, "rows": rows, "targets": targets}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
