"""Pipelined training on 2 CPU processes: autosplit's plan against the manual splits users write.

For each model (GPT with tied embeddings as in issue #8 — 8 layers, d_model 256, vocab 8000,
seq 128, batch 8 — and Inception-V3, GNMT, BigLSTM at bench size), M ∈ {4, 8} micro-batches and
the GPipe and 1F1B schedules, measured in one run:

(a) the unsplit model, one process, 1 thread; (b) the same on 2 threads;
(c) autosplit's plan through ``autosplit.distribute`` (2 processes over gloo, each pinned to its
    own core with one thread);
(d) the manual splits, through the same runtime: torchtitan's even split of the repeated blocks
    (``module_fqns_per_model_part``; models with one list of repeated blocks), DeepSpeed
    ``partition_method="parameters"`` and ``"uniform"``.

A step is forward + backward of every micro-batch and an Adam step; the figure is the median of
``--steps`` steps (min and max beside it), the slower rank's time per step. The plans of a model
are timed side by side on this noisy machine, in interleaved blocks: ``--block`` consecutive
steps of each plan after one untimed step, then the next plan's, after ``--warmup`` untimed
rounds. (Interleaving single steps measured every plan on caches the other plans had filled,
slower than the same plan run on its own.)
Each plan's predicted step (measured per-node costs profiled on one pinned core, the loss the
last stage computes timed as well, the link and the
runtime's per-micro-batch overhead measured first by ``autosplit.calibration.measure_runtime``) stands beside
its measured one. Pipeline efficiency is the schedule's ideal step from the stages' measured
compute (forward + backward chunks and the optimizer step, timed inside the run) over the measured
step.

Usage::

    .venv/bin/python benchmarks/pipeline_runtime.py                # all models, about 13 min
    .venv/bin/python benchmarks/pipeline_runtime.py --models gpt --micro 8 --schedules gpipe
"""

from __future__ import annotations

import argparse
import copy
import json
import math
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
import torch.nn.functional as F

import autosplit
import autosplit.calibration
from autosplit.calibration.overhead import RuntimeMeasurement
from autosplit.compiler.manual import deepspeed_fqns, plan_from_fqns, torchtitan_fqns
from autosplit.devices import resolve_devices
from autosplit.options import ProfileOptions
from autosplit.timers import pinned, steady_allocator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.plan_time import machine  # noqa: E402
from benchmarks.workloads.models import GPT, make  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "pipeline_runtime.json"
REPEATED = {"gpt": "blocks", "inception_v3": "blocks", "biglstm": None, "gnmt": None}


def workload(name: str):
    """(model, inputs, target, loss_fn), seeded so every process builds the same weights."""
    torch.manual_seed(0)
    model: torch.nn.Module
    if name == "gpt":
        model, inputs = GPT(vocab=8000, d_model=256, n_layers=8, n_heads=4, max_len=128), (torch.randint(0, 8000, (8, 128)),)
    else:
        model, inputs = make(name, "bench")
    out = model(*inputs)
    torch.manual_seed(1)
    if name == "two_tower":  # in-batch negatives: query i's item is item i (of its own micro-batch, when pipelined)
        return model, inputs, torch.arange(out.shape[0]), lambda o, _: F.cross_entropy(o, torch.arange(o.shape[0]))
    if out.dim() == 3:
        target = torch.randint(0, out.shape[-1], out.shape[:2])
        return model, inputs, target, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())
    return model, inputs, torch.randint(0, out.shape[-1], out.shape[:1]), F.cross_entropy


def unsplit_step(name: str, threads: int, steps: int, warmup: int) -> list[float]:
    return timed_steps(*workload(name), threads=threads, steps=steps, warmup=warmup)


def timed_steps(model, inputs, target, loss_fn, *, threads: int, steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` unsplit steps (forward, backward, Adam) on ``threads`` pinned threads."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = []
    with pinned(threads, tuple(range(threads))):
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            loss_fn(model(*inputs), target).backward()
            opt.step()
            opt.zero_grad()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return times


def _timed_stage(pipe) -> dict[str, float]:
    """Wrap the pipeline stage's forward/backward chunks with clocks, less the time a chunk waits
    for its micro-batch's data to arrive; returns the running totals."""
    totals = {"compute": 0.0, "wait": 0.0}
    stage = pipe._stages[0]
    wait = stage.wait_received

    def timed_wait(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return wait(*args, **kwargs)
        finally:
            totals["wait"] += time.perf_counter() - t0

    stage.wait_received = timed_wait
    for method in ("forward_one_chunk", "backward_one_chunk"):
        inner = getattr(stage, method)

        def timed(*args, _inner=inner, **kwargs):
            t0, waited = time.perf_counter(), totals["wait"]
            try:
                return _inner(*args, **kwargs)
            finally:
                totals["compute"] += time.perf_counter() - t0 - (totals["wait"] - waited)

        setattr(stage, method, timed)
    return totals


def _worker(
    rank: int, init: str, name: str, plans: list[tuple[str, str]], steps: int, warmup: int, block: int, out: str
) -> None:
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank})
    steady_allocator()
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2, timeout=timedelta(minutes=5))
    try:
        model, inputs, target, loss_fn = workload(name)
        runs: list[tuple[Any, Any, Any, dict[str, Any]]] = []
        for label, path in plans:
            pipe = autosplit.distribute(copy.deepcopy(model), None, example_inputs=inputs, loss_fn=loss_fn, plan=path)
            opt = torch.optim.Adam(pipe.parameters(), lr=1e-4)
            runs.append((pipe, opt, _timed_stage(pipe), {"label": label, "times": [], "compute": []}))
        # Interleaved blocks: `block` consecutive steps of each plan (the first one untimed: it
        # brings the plan's weights back into cache), then the next plan's, round after round. The
        # plans are compared side by side, so a slow minute of this machine falls on all of them
        # alike, while each timed step follows a step of its own plan, as in training.
        rounds = warmup + math.ceil(steps / block)
        for r in range(rounds):
            for pipe, opt, totals, row in runs:
                for i in range(block + 1):
                    dist.barrier()
                    totals["compute"] = 0.0
                    t0 = time.perf_counter()
                    pipe.step(*inputs, target=target)
                    t1 = time.perf_counter()
                    opt.step()
                    opt.zero_grad()
                    t2 = time.perf_counter()
                    if r >= warmup and i > 0:
                        row["times"].append(t2 - t0)
                        row["compute"].append((totals["compute"], t2 - t1))
        rows = [row for *_, row in runs]
        gathered = [None, None]
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


def measured_cpu() -> tuple[RuntimeMeasurement, autosplit.DeviceSpec]:
    """This machine's link and pipeline runtime overhead, measured now, and the ``cpu`` preset with them."""
    runtime = autosplit.calibration.measure_runtime(cache=False)
    print(f"link {runtime.link.bandwidth / 1e9:.2f} GB/s, {runtime.link.latency * 1e6:.0f} µs; "
          f"runtime overhead {runtime.microbatch_overhead * 1e3:.2f} ms per micro-batch and stage")
    return runtime, runtime.apply(resolve_devices(["cpu"])[0])


def ideal_step(schedule: str, M: int, stage_compute: list[float], stage_opt: list[float]) -> float:
    """The schedule's step from measured stage times alone (no transfers, no runtime overhead):
    GPipe and 1F1B both take Σ_s τ_s + (M − 1)·max_s τ_s per step, τ_s = stage compute / M."""
    tau = [c / M for c in stage_compute]
    return sum(tau) + (M - 1) * max(tau) + max(stage_opt)


def run_model(name: str, args, spec) -> dict:
    model, inputs, target, loss_fn = workload(name)
    record: dict = {"model": name, "unsplit": {}, "configs": []}
    for threads in (1, 2):
        t = unsplit_step(name, threads, args.steps, warmup=3)
        record["unsplit"][f"{threads} thread{'s' * (threads > 1)}"] = {
            "median": statistics.median(t), "min": min(t), "max": max(t)
        }
    with tempfile.TemporaryDirectory() as tmp:
        plans: list[tuple[str, str]] = []
        meta = {}
        for M in args.micro:
            for schedule in args.schedules:
                planner = autosplit.Planner(
                    model, [spec] * 2, example_inputs=inputs, micro_batches=M, schedule=schedule, time_limit=10,
                    loss_fn=loss_fn, example_target=target,  # the loss the pipeline runs on its last stage, costed
                    # profiled in this run, as timed: on core 0, and with --beside while core 1 runs the same passes
                    costs=ProfileOptions(threads=1, cores=(0,), beside=(1,) if args.beside else (), use_cache=False),
                )
                order = list(planner.traced.captured.module_paths.values())
                candidates = {"autosplit": planner.plan()}
                repeated = REPEATED[name]
                if repeated:
                    candidates["torchtitan even"] = plan_from_fqns(
                        planner, torchtitan_fqns(model, 2, repeated=repeated, order=order), name="torchtitan")
                for method in ("parameters", "uniform"):
                    candidates[f"deepspeed {method}"] = plan_from_fqns(
                        planner, deepspeed_fqns(model, 2, method, order), name=f"deepspeed-{method}")
                for label, plan in candidates.items():
                    key = f"{label} | M={M} {schedule}"
                    path = os.path.join(tmp, f"{len(plans)}.json")
                    plan.save(path)
                    plans.append((key, path))
                    meta[key] = (label, M, schedule, plan)
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), name, plans, args.steps, args.warmup, args.block, out), nprocs=2, join=True)
        ranks = torch.load(out, weights_only=False)
    for i, (key, _) in enumerate(plans):
        label, M, schedule, plan = meta[key]
        per_step = [max(r0, r1) for r0, r1 in zip(ranks[0][i]["times"], ranks[1][i]["times"])]
        compute = [statistics.median(c for c, _ in ranks[r][i]["compute"]) for r in (0, 1)]
        opt = [statistics.median(o for _, o in ranks[r][i]["compute"]) for r in (0, 1)]
        measured = statistics.median(per_step)
        record["configs"].append({
            "plan": label, "micro_batches": M, "schedule": schedule,
            "measured": {"median": measured, "min": min(per_step), "max": max(per_step)},
            "predicted": plan.step_time,
            "predicted_terms": None if plan.terms is None else vars(plan.terms),
            "error": (plan.step_time - measured) / measured,
            "stage_compute": {"measured": compute, "measured_optimizer": opt,
                              "predicted": [s.forward + s.backward for s in plan.stages]},
            "ideal": ideal_step(schedule, M, compute, opt),
            "efficiency": ideal_step(schedule, M, compute, opt) / measured,
            "stage_params": [s.params for s in plan.stages],
            "modules": [list(s.modules) for s in plan.stages],
            "shared": [vars(p) for p in plan.shared_params],
        })
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,inception_v3,gnmt,biglstm")
    parser.add_argument("--micro", default="4,8")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (pipelined plans)")
    parser.add_argument("--block", type=int, default=2, help="consecutive timed steps of one plan")
    parser.add_argument("--beside", action="store_true",
                        help="profile while core 1 runs the same passes (ProfileOptions.beside), not on an idle host")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    args.micro = [int(m) for m in args.micro.split(",")]
    args.schedules = args.schedules.split(",")

    start = time.time()
    steady_allocator()  # every timed process alike: the unsplit runs here, the pipelines in _worker
    runtime, spec = measured_cpu()
    records = []
    for name in args.models.split(","):
        records.append(run_model(name, args, spec))
        report(records[-1])
    summary = summarise(records)
    print(json.dumps(summary, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": machine(), "seconds": time.time() - start, "steps": args.steps, "warmup": args.warmup, "profiled_beside": args.beside,
        "runtime": runtime.to_dict(), "summary": summary, "models": records,
    }, indent=1))
    print(f"wrote {args.out} in {time.time() - start:.0f}s")
    return 0


def report(record: dict) -> None:
    u = record["unsplit"]
    print(f"\n{record['model']}: unsplit {u['1 thread']['median'] * 1e3:.0f} ms (1 thread), "
          f"{u['2 threads']['median'] * 1e3:.0f} ms (2 threads)")
    print(f"  {'plan':18s} {'M':>2s} {'sched':6s} {'measured ms (min-max)':>24s} {'predicted':>10s} {'error':>7s} "
          f"{'eff':>5s} {'vs 1 thr':>8s}")
    for c in record["configs"]:
        m = c["measured"]
        print(f"  {c['plan']:18s} {c['micro_batches']:>2d} {c['schedule']:6s} "
              f"{m['median'] * 1e3:8.0f} ({m['min'] * 1e3:5.0f}-{m['max'] * 1e3:5.0f}) {c['predicted'] * 1e3:10.0f} "
              f"{c['error']:+7.1%} {c['efficiency']:5.2f} {u['1 thread']['median'] / m['median']:7.2f}x")


def summarise(records: list[dict]) -> dict:
    """The issue's targets: autosplit vs the best manual split (same M and schedule), prediction
    error of every plan, pipeline efficiency of autosplit's plans."""
    ratios, errors, efficiency = {}, [], []
    by_schedule: dict[str, list[float]] = {}
    for r in records:
        by: dict[tuple[int, str], dict[str, dict]] = {}
        for c in r["configs"]:
            by.setdefault((c["micro_batches"], c["schedule"]), {})[c["plan"]] = c
            errors.append(abs(c["error"]))
            by_schedule.setdefault(c["schedule"], []).append(c["error"])
        for (M, schedule), plans in by.items():
            best_manual = min(c["measured"]["median"] for label, c in plans.items() if label != "autosplit")
            ratios[f"{r['model']} M={M} {schedule}"] = best_manual / plans["autosplit"]["measured"]["median"]
            efficiency.append(plans["autosplit"]["efficiency"])
    return {
        "autosplit_speed_vs_best_manual": ratios,
        "min_ratio": min(ratios.values()),
        "median_abs_prediction_error": statistics.median(errors),
        "worst_abs_prediction_error": max(errors),
        "error_by_schedule": {s: {"median": statistics.median(e), "low": min(e), "high": max(e)} for s, e in by_schedule.items()},
        "autosplit_efficiency_min": min(efficiency),
        "autosplit_efficiency_median": statistics.median(efficiency),
    }


if __name__ == "__main__":
    sys.exit(main())
