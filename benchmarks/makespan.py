"""The makespan objective (DLPlacer) against the pipeline objective and one device, on 2 CPU workers.

For a two-tower retrieval model (``benchmarks.workloads.models.TwoTower``: two independent MLP towers,
joined by the in-batch score matrix) and Inception-V3 (parallel towers inside each block), at
bench size, measured in one run:

(a) the unsplit model, one process, 1 thread; (b) the same on 2 threads;
(c) the makespan plan through its runtime (``MakespanRunner``: one worker thread per device,
    one intra-op thread each, the process on 2 cores; one optimizer per device stepped at once);
(d) the pipeline plan with M = 1 and with M = 4 (GPipe) through ``autosplit.distribute``
    (2 processes over gloo, each pinned to its own core with one thread).

(a), (b) and (c) are timed round-robin in this process, step by step; (d) is timed in its own
processes right after. A step is forward, backward and an Adam step; the figure is the median of
``--steps`` steps after ``--warmup`` (min and max beside it). Every plan's predicted step stands
beside its measured one; costs are per-node profiles on one pinned core made in this run (one
micro-batch's for the pipeline plans, the whole batch's for the makespan plan). The pipeline
plans use the link and runtime overhead measured by ``autosplit.calibration.measure_runtime``; the makespan
plan's devices are the threads of one process, joined by memory (the ``cpu`` preset's link).

Usage::

    .venv/bin/python benchmarks/makespan.py                       # both models, a few minutes
    .venv/bin/python benchmarks/makespan.py --models two_tower --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch.multiprocessing as mp

import autosplit
from autosplit.options import ProfileOptions
from autosplit.runtime.makespan import MakespanRunner
from autosplit.timers import steady_allocator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pipeline_runtime import _worker, measured_cpu, workload  # noqa: E402
from benchmarks.plan_time import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "makespan.json"
PROFILE = ProfileOptions(threads=1, cores=(0,), use_cache=False)  # as each worker runs: one core, one thread


def _summary(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def local_runs(name: str, plan: autosplit.Plan, steps: int, warmup: int) -> dict[str, list[float]]:
    """(a), (b) and (c), round-robin: step i of each, then step i + 1."""
    runs: dict[str, Callable[[], None]] = {}
    for threads in (1, 2):
        model, inputs, target, loss_fn = workload(name)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def unsplit(model=model, inputs=inputs, target=target, loss_fn=loss_fn, opt=opt, threads=threads):
            torch.set_num_threads(threads)
            loss_fn(model(*inputs), target).backward()
            opt.step()
            opt.zero_grad()

        runs[f"unsplit {threads} thread{'s' * (threads > 1)}"] = unsplit
    model, inputs, target, loss_fn = workload(name)
    runner = cast(MakespanRunner, autosplit.autosplit(model, None, example_inputs=inputs, plan=plan))  # a makespan plan
    device_opt = runner.optimizer(torch.optim.Adam, lr=1e-4)

    def makespan():
        runner.step(*inputs, target=target, loss_fn=loss_fn)
        device_opt.step()
        device_opt.zero_grad()

    runs["makespan"] = makespan
    times: dict[str, list[float]] = {label: [] for label in runs}
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0, 1})
    try:
        for i in range(warmup + steps):
            for label, run in runs.items():
                t0 = time.perf_counter()
                run()
                if i >= warmup:
                    times[label].append(time.perf_counter() - t0)
    finally:
        os.sched_setaffinity(0, previous)
        torch.set_num_threads(1)
    return times


def pipeline_runs(name: str, plans: dict[str, autosplit.Plan], steps: int) -> dict[str, list[float]]:
    """(d): each plan through ``distribute`` on 2 pinned processes, in interleaved blocks of 5 steps
    after one untimed round (``pipeline_runtime._worker``); the slower rank's time."""
    with tempfile.TemporaryDirectory() as tmp:
        saved = []
        for i, (label, plan) in enumerate(plans.items()):
            path = os.path.join(tmp, f"{i}.json")
            plan.save(path)
            saved.append((label, path))
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), name, saved, steps, 1, 5, out), nprocs=2, join=True)
        ranks = torch.load(out, weights_only=False)
    return {label: [max(a, b) for a, b in zip(ranks[0][i]["times"], ranks[1][i]["times"])] for i, label in enumerate(plans)}


def run_model(name: str, args: argparse.Namespace, spec: autosplit.DeviceSpec) -> dict:
    model, inputs, _, _ = workload(name)
    makespan = autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, objective="makespan",
                              time_limit=args.time_limit, costs=PROFILE)
    pipelines = {
        f"pipeline M={M}": autosplit.plan(model, [spec] * 2, example_inputs=inputs, micro_batches=M, schedule="gpipe",
                                          time_limit=args.time_limit, costs=PROFILE)
        for M in (1, 4)
    }
    measured = {**local_runs(name, makespan, args.steps, args.warmup), **pipeline_runs(name, pipelines, args.steps)}
    predicted = {"makespan": makespan, **pipelines}
    rows = []
    for label, times in measured.items():
        plan = predicted.get(label)
        row: dict = {"run": label, "measured": _summary(times)}
        if plan is not None:
            row |= {
                "predicted": plan.step_time, "error": (plan.step_time - row["measured"]["median"]) / row["measured"]["median"],
                "solver": {"status": plan.solver.status, "gap": plan.solver.gap, "bound": plan.solver.bound},
                "nodes_per_device": [st.nodes for st in plan.stages],
                "busy_per_device": [st.compute for st in plan.stages],
            }
        rows.append(row)
    one = rows[0]["measured"]["median"]
    for row in rows:
        row["speedup_vs_1_thread"] = one / row["measured"]["median"]
    return {"model": name, "nodes": len(makespan.assignment), "rows": rows}


def report(record: dict) -> None:
    print(f"\n{record['model']} ({record['nodes']} nodes)")
    print(f"  {'run':18s} {'measured ms (min-max)':>24s} {'predicted':>10s} {'error':>7s} {'vs 1 thread':>11s}")
    for r in record["rows"]:
        m = r["measured"]
        pred = f"{r['predicted'] * 1e3:10.1f} {r['error']:+7.1%}" if "predicted" in r else f"{'':10s} {'':7s}"
        print(f"  {r['run']:18s} {m['median'] * 1e3:8.1f} ({m['min'] * 1e3:6.1f}-{m['max'] * 1e3:6.1f}) {pred} "
              f"{r['speedup_vs_1_thread']:10.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="two_tower,inception_v3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)

    start = time.time()
    steady_allocator()  # as pipeline_runtime: every timed process alike
    runtime, spec = measured_cpu()
    records = []
    for name in args.models.split(","):
        records.append(run_model(name, args, spec))
        report(records[-1])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": machine(), "seconds": time.time() - start, "steps": args.steps, "warmup": args.warmup,
        "runtime": runtime.to_dict(), "models": records,
    }, indent=1))
    print(f"wrote {args.out} in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
