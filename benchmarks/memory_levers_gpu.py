"""Precision and activation checkpointing at GPU scale, in simulation: Llama-3-70B on 16 and 32
H100-80GB (issue 25 item 5).

The model is built from its published configuration on the meta device (``plan_llms._model``: no
weights) and planned from shapes alone (``autosplit.Spec`` inputs) onto ``H100-80GB`` presets:
sequence 4096, one sequence per micro-batch and as many micro-batches as devices (torch keeps a
receive buffer per micro-batch all step), bf16-mixed (autocast compute at the tensor-core peak,
fp32 master weights, gradients and Adam state), 1F1B. For each device count, with
``checkpointing="none"``, ``"full"`` and ``"auto"``: the predicted step, tokens/s per GPU, the peak
memory of the fullest device against its 80 GiB, the blocks recomputed, the solver's gap, and the
planning time on this machine (the model is captured once; each mode is planned anew from the
capture). Where no plan fits, the planner's reason. Then the joint search — schedule, micro-batches
and recomputation left to the planner (``schedule="auto"``, ``micro_batches="auto"``,
``checkpointing="auto"``) — timed as a whole (target: ≤ 60 s on this machine).

These are planned for GPUs this machine does not have: every figure is the cost model's (the H100
preset's roofline), not a measurement.

Usage::

    nice -n 19 .venv/bin/python benchmarks/memory_levers_gpu.py                # 16 and 32 GPUs
    nice -n 19 .venv/bin/python benchmarks/memory_levers_gpu.py --devices 32 --no-search
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autosplit
from autosplit.errors import AutosplitError
from benchmarks.plan_llms import _model
from benchmarks.plan_time import machine

RESULTS = Path(__file__).resolve().parent / "results"
PRESET, SEQ, GiB = "H100-80GB", 4096, 2**30


def _row(plan: autosplit.Plan, ranks: int, batch: int, seconds: float) -> dict[str, Any]:
    peaks = list(plan.rank_memory or [s.memory for s in plan.stages])
    return {
        "schedule": plan.schedule, "micro_batches": plan.micro_batches, "stages_per_rank": plan.stages_per_rank,
        "step_s": plan.step_time, "tokens_per_s_per_gpu": batch * SEQ / plan.step_time / ranks,
        "peak_gib": max(peaks) / GiB, "peaks_gib": [p / GiB for p in peaks], "recomputed_blocks": len(plan.recompute),
        "recompute_per_stage": [len(s.recompute) for s in plan.stages],
        "partial": [[p.block, p.keep, p.window] for p in plan.recompute_partial], "solver": plan.solver.name, "status": plan.solver.status,
        "gap": plan.solver.gap, "planning_s": seconds, "timings": dict(plan.timings),
    }


def run(ranks: int, micro_batches: int, time_limit: float, search: bool) -> dict[str, Any]:
    batch = micro_batches  # one sequence per micro-batch
    model = _model("llama3-70b")
    start = time.perf_counter()
    planner = autosplit.Planner(model, [PRESET] * ranks, example_inputs=(autosplit.Spec((batch, SEQ), torch.long),),
                                schedule="1f1b", micro_batches=micro_batches, precision="bf16-mixed", time_limit=time_limit)
    planner.traced  # noqa: B018 (capture and annotate once, timed apart)
    out: dict[str, Any] = {"devices": ranks, "batch": batch, "seq": SEQ, "capture_s": time.perf_counter() - start, "modes": {}}
    for mode in ("none", "full", "auto"):
        t0 = time.perf_counter()
        try:
            out["modes"][mode] = _row(planner.what_if(checkpointing=mode), ranks, batch, time.perf_counter() - t0)
        except AutosplitError as e:
            out["modes"][mode] = {"error": str(e).split(". Likely cause")[0], "planning_s": time.perf_counter() - t0}
    if search:
        t0 = time.perf_counter()
        try:
            plan = planner.what_if(schedule="auto", micro_batches="auto", checkpointing="auto")
            out["search"] = {**_row(plan, ranks, batch, time.perf_counter() - t0), "tried": len(plan.alternatives)}
        except AutosplitError as e:
            out["search"] = {"error": str(e).split(". Likely cause")[0], "planning_s": time.perf_counter() - t0}
    return out


def report(r: dict[str, Any]) -> None:
    print(f"\nLlama-3-70B on {r['devices']} × {PRESET}, batch {r['batch']} × {r['seq']}, bf16-mixed, 1F1B "
          f"(capture + annotate {r['capture_s']:.1f} s)")
    print(f"{'mode':>6s} {'step s':>7s} {'tok/s/GPU':>9s} {'peak GiB':>8s} {'blocks':>6s} {'partly':>6s} "
          f"{'solver':>15s} {'gap':>6s} {'plan s':>6s}")
    rows = [*r["modes"].items(), *([("search", r["search"])] if "search" in r else [])]
    for mode, m in rows:
        if "error" in m:
            print(f"{mode:>6s}  no plan ({m['planning_s']:.1f} s): {m['error'][:160]}")
            continue
        print(f"{mode:>6s} {m['step_s']:7.2f} {m['tokens_per_s_per_gpu']:9.0f} {m['peak_gib']:8.1f} {m['recomputed_blocks']:6d} "
              f"{len(m['partial']):6d} {m['solver'] + ' ' + m['status'][:4]:>15s} {m['gap']:6.1%} {m['planning_s']:6.1f}"
              + (f"  ({m['schedule']}, M={m['micro_batches']}, v={m['stages_per_rank']}, {m['tried']} tried)" if mode == "search" else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", type=int, default=[16, 32])
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "memory_levers_gpu.json"))
    args = parser.parse_args(argv)
    rows = []
    for ranks in args.devices:
        rows.append(run(ranks, ranks, args.time_limit, not args.no_search))
        report(rows[-1])
    Path(args.out).write_text(json.dumps({
        "machine": machine(), "preset": PRESET, "simulated": "cost model (H100 preset roofline), planned on the meta device",
        "rows": rows, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
    }, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
