"""Cost fidelity: predicted vs measured stage time, step time and peak memory, and plan quality.

For each benchmark model (``bench`` size) split onto 2, 3 and 4 CPU devices, three plans:

- **measured**: ``costs=ProfileOptions(threads=1)`` — every node profiled on one pinned core;
- **analytic**: the roofline on the stock ``cpu`` preset;
- **calibrated**: the roofline on a ``cpu`` spec calibrated (``autosplit.calibrate``) on a
  *different* model (a small GPT), i.e. what a user gets without profiling this model;

plus a **parameter-balanced** split (DeepSpeed's ``partition_method="parameters"``: contiguous
stages of the graph order with equal parameter counts).

Every plan's stages are measured with :func:`autosplit.calibration.measure_stages` (one pinned core,
one thread, GPipe forward of every micro-batch then every backward, Adam step; median of
3 steps) and its whole step with the split module run end to end on the same core.
Transfers between CPU stage processes use the link measured over gloo
(:func:`autosplit.calibration.measure_link`) in every plan's costs.

Errors are ``predicted / measured − 1``:

- stage time: a stage's predicted compute (forward + backward, whole batch) against its
  measured forward + backward;
- step: the sum of predicted stage computes against the measured forward + backward of
  every micro-batch through the whole split module in one process (all stages on one core,
  one after another: what this machine can run; the optimizer step is not predicted);
- peak memory: a stage's predicted memory against its peak in ``MemoryTracker``.

Plan quality compares the pipelined step time of each plan, composed from its *measured*
stage times and the measured link: ``(Σ t_s + (M − 1) · max t_s) / M``. A real
multi-process pipeline run is not part of this benchmark (this machine has 2 cores, so
3 and 4 stage processes could not run side by side).

Usage::

    python benchmarks/cost_fidelity.py                    # all models, 2-4 devices (~10 min)
    python benchmarks/cost_fidelity.py --models gpt mlp --devices 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autosplit
import autosplit.calibration
from autosplit.compiler.manual import partition
from autosplit.microbatch import split_batch
from autosplit.options import ProfileOptions
from autosplit.passes.annotate import annotate
from autosplit.passes.annotations import node_info
from autosplit.passes.capture import capture, flat_inputs
from autosplit.timers import pinned
from benchmarks.plan_time import machine
from benchmarks.workloads.models import GPT, WORKLOADS, make

CORE = (0,)
MICRO_BATCHES = 4


def measure_step(split: torch.nn.Module, micro: list[tuple[tuple, dict]], steps: int = 3) -> float:
    """Median seconds of forward + backward of every micro-batch through the whole split module,
    on one pinned core (the optimizer step runs untimed: the cost model does not predict it)."""
    opt = torch.optim.Adam(split.parameters(), lr=1e-4)
    times = []
    with pinned(1, CORE):
        for i in range(steps + 1):
            t0 = time.perf_counter()
            for args, kwargs in micro:
                out = split(*args, **kwargs)
                torch.stack([t.float().sum() for t in torch.utils._pytree.tree_leaves(out)
                             if isinstance(t, torch.Tensor) and t.requires_grad]).sum().backward()
            if i:
                times.append(time.perf_counter() - t0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return statistics.median(times)


def balanced_plan(plan: autosplit.Plan, param_counts: dict[str, int]) -> autosplit.Plan:
    """Contiguous, non-empty stages of the graph order with the largest stage's parameter count
    as small as possible: DeepSpeed's ``partition_method="parameters"`` (``partition_balanced``)."""
    names = list(plan.assignment)  # graph order
    ranges = partition([param_counts.get(name, 0) for name in names], len(plan.stage_devices))
    assignment = {name: plan.stage_devices[stage] for stage, (a, b) in enumerate(ranges) for name in names[a:b]}
    return dataclasses.replace(plan, assignment=assignment)


def node_params(model: torch.nn.Module, inputs: tuple) -> dict[str, int]:
    """Parameters each graph node owns (each parameter counted at its first user)."""
    captured = capture(model, inputs, {})
    annotate(captured, flat_inputs(captured, inputs, {}))
    return {n.name: node_info(n).param_count for n in captured.gm.graph.nodes if n.op not in ("placeholder", "output")}


def run_plan(model, inputs, devices, *, costs, label, given=None) -> tuple[autosplit.SplitModule, dict]:
    torch.manual_seed(0)
    kwargs = dict(example_inputs=inputs, micro_batches=MICRO_BATCHES)
    split = cast(  # a pipeline plan: a SplitModule
        autosplit.SplitModule, autosplit.autosplit(model, devices if given is None else None, plan=given, costs=costs, **kwargs)
    )
    micro = split_batch(inputs, {}, MICRO_BATCHES)
    stages = autosplit.calibration.measure_stages(split, micro, threads=1, cores=CORE)
    step = measure_step(split, micro)
    plan = split.plan
    M = plan.micro_batches
    measured_t = [m.time + st.transfer for m, st in zip(stages, plan.stages)]
    row = {
        "plan": label,
        "costs": plan.costs,
        "stage_params": [st.params for st in plan.stages],
        "predicted_stage": [st.compute for st in plan.stages],
        "measured_stage": [m.time for m in stages],
        "predicted_memory": [st.memory for st in plan.stages],
        "measured_memory": [m.peak_bytes for m in stages],
        "predicted_step_sequential": sum(st.compute for st in plan.stages),
        "measured_step_sequential": step,
        "pipelined_step_from_measured": (sum(measured_t) + (M - 1) * max(measured_t)) / M,
        "predicted_pipelined_step": plan.step_time,
    }
    return split, row


def errors(rows: list[dict], pred: str, meas: str) -> list[float]:
    out = []
    for r in rows:
        p, m = r[pred], r[meas]
        pairs = zip(p, m) if isinstance(p, list) else [(p, m)]
        out += [a / b - 1 for a, b in pairs if b > 0]
    return out


def summary(errs: list[float]) -> tuple[float, float]:
    mags = [abs(e) for e in errs]
    return (statistics.median(mags), max(mags)) if mags else (float("nan"), float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--devices", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cost_fidelity.json"))
    args = ap.parse_args()

    link = autosplit.calibration.measure_link()
    print(f"link over gloo: {link.bandwidth / 1e9:.2f} GB/s, latency {link.latency * 1e6:.0f} us")
    cpu = link.apply(autosplit.devices.resolve_devices(["cpu"])[0])
    options = ProfileOptions(threads=1, cores=CORE, use_cache=False)
    start = time.perf_counter()
    cal_model = GPT(vocab=2048, d_model=128, n_layers=2, n_heads=4, max_len=64)
    with pinned(1, CORE):
        calibrated = autosplit.calibrate(cal_model, cpu, example_inputs=(torch.randint(0, 2048, (8, 64)),), options=options)
    print(f"calibrated on a 2-layer GPT in {time.perf_counter() - start:.1f}s: efficiency {calibrated.efficiency:.3f}, "
          f"memory efficiency {calibrated.memory_efficiency:.3f}, overhead {calibrated.launch_overhead * 1e6:.1f} us")

    rows = []
    for name in args.models:
        for S in args.devices:
            torch.manual_seed(0)
            model, inputs = make(name, "bench")
            plans = {}
            for label, devices, costs in [
                ("measured", [cpu] * S, options),
                ("analytic", [cpu] * S, "analytic"),
                ("calibrated", [calibrated] * S, "analytic"),
            ]:
                split, row = run_plan(model, inputs, devices, costs=costs, label=label)
                plans[label] = split.plan
                rows.append({"model": name, "devices": S, **row})
            params = node_params(model, inputs)
            _, row = run_plan(model, inputs, None, costs="analytic", label="param-balanced",
                              given=balanced_plan(plans["analytic"], params))
            rows.append({"model": name, "devices": S, **row})
            for r in rows[-4:]:
                print(f"{name:13s} S={S} {r['plan']:14s} stage err " + " ".join(
                    f"{p / m - 1:+.0%}" for p, m in zip(r["predicted_stage"], r["measured_stage"]))
                    + "  mem err " + " ".join(f"{p / m - 1:+.0%}" for p, m in zip(r["predicted_memory"], r["measured_memory"]))
                    + f"  pipelined {r['pipelined_step_from_measured'] * 1e3:.1f} ms")

    print()
    print(f"{'costs':12s} {'stage time |err| median / worst':>32s} {'step |err| median / worst':>28s} "
          f"{'peak memory |err| median / worst':>34s}")
    table = {}
    for label in ("measured", "analytic", "calibrated"):
        sel = [r for r in rows if r["plan"] == label]
        st, step, mem = (summary(errors(sel, f"predicted_{k}", f"measured_{k}")) for k in ("stage", "step_sequential", "memory"))
        table[label] = {"stage_time": st, "step": step, "peak_memory": mem}
        print(f"{label:12s} {st[0]:>20.1%} / {st[1]:<9.1%} {step[0]:>16.1%} / {step[1]:<9.1%} {mem[0]:>22.1%} / {mem[1]:<9.1%}")

    print()
    print("plan quality: pipelined step from measured stage times (ms), and vs the measured-cost plan")
    print(f"{'model':13s} {'S':>2s} {'measured':>10s} {'analytic':>16s} {'calibrated':>16s} {'param-balanced':>18s}")
    quality = []
    for name in args.models:
        for S in args.devices:
            got = {r["plan"]: r["pipelined_step_from_measured"] for r in rows if r["model"] == name and r["devices"] == S}
            base = got["measured"]
            quality.append({"model": name, "devices": S, **got})
            print(f"{name:13s} {S:>2d} {base * 1e3:>10.1f} " + " ".join(
                f"{got[k] * 1e3:>9.1f} ({got[k] / base:.2f}x)" for k in ("analytic", "calibrated", "param-balanced")))

    result = {
        "benchmark": "cost_fidelity",
        "machine": machine(),
        "device": "cpu (one pinned core, 1 thread per stage)",
        "micro_batches": MICRO_BATCHES,
        "link": {"bandwidth": link.bandwidth, "latency": link.latency, "samples": link.samples},
        "calibration": {"efficiency": calibrated.efficiency, "memory_efficiency": calibrated.memory_efficiency,
                        "launch_overhead": calibrated.launch_overhead},
        "summary": table,
        "quality": quality,
        "rows": rows,
        "wall_time": time.perf_counter() - start,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out} ({result['wall_time']:.0f}s)")


if __name__ == "__main__":
    main()
