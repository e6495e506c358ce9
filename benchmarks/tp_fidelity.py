"""Tensor parallelism's costs against its run: a transformers Llama over 2 gloo processes, tp 2.

The model (vocabulary 8000, width 512, 4 layers, 8 heads over 4 key-value heads; batch 8 × 128
tokens) is planned onto this machine's ``cpu`` spec, its link and runtime overhead measured first
(``autosplit.calibration.measure_runtime``), its nodes profiled on one pinned core
(``costs=ProfileOptions(threads=1)``), three ways on the same 2 processes:

- ``tp 2, sequence parallel``: the planner's own tp 2 plan (``sequence_parallel="auto"``: on);
- ``tp 2``: the same without sequence parallelism (norms and residuals whole on both ranks);
- ``pp 2``: the planner's two-stage 1F1B plan, for scale.

Each is run through ``autosplit.distribute`` on 2 processes pinned to a core each with one thread
(:func:`benchmarks.pipeline_runtime._worker`: interleaved blocks of steps, the slower rank's time per
step, forward + backward + Adam), beside the unsplit model on 1 and 2 threads; each plan's predicted
step stands beside its measured one, with its terms. On CPU, gloo's all-reduce is a TCP round
through the kernel: the collectives are what this benchmark tests the model of.

Usage::

    .venv/bin/python benchmarks/tp_fidelity.py            # about 3 min; writes benchmarks/results/tp_fidelity.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autosplit  # noqa: E402
from autosplit.options import ProfileOptions  # noqa: E402
from autosplit.timers import steady_allocator  # noqa: E402
from benchmarks.pipeline_runtime import _worker, measured_cpu, unsplit_step, workload  # noqa: E402
from benchmarks.plan_time import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "tp_fidelity.json"
PLANS = {
    "tp 2, sequence parallel": dict(tensor_parallel=2, data_parallel=1, micro_batches=1, schedule="1f1b"),
    "tp 2": dict(tensor_parallel=2, data_parallel=1, micro_batches=1, schedule="1f1b", sequence_parallel=False),
    "pp 2": dict(micro_batches=4, schedule="1f1b"),
}


def _plans(spec: autosplit.DeviceSpec, folder: str) -> list[tuple[str, str, autosplit.Plan]]:
    """Each plan of :data:`PLANS`, profiled on one pinned core, saved to ``folder``."""
    model, inputs, _, _ = workload("llama")
    made = []
    for i, (label, options) in enumerate(PLANS.items()):
        plan = autosplit.plan(model, [spec] * 2, example_inputs=inputs, time_limit=10,
                              costs=ProfileOptions(threads=1, cores=(0,), use_cache=False), **options)
        path = os.path.join(folder, f"{i}.json")
        plan.save(path)
        made.append((label, path, plan))
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--block", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    start = time.time()
    steady_allocator()
    runtime, spec = measured_cpu()
    unsplit = {f"{t} thread{'s' * (t > 1)}": statistics.median(unsplit_step("llama", t, args.steps, warmup=3)) for t in (1, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        made = _plans(spec, tmp)
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), "llama", [(label, path) for label, path, _ in made], args.steps,
                                args.warmup, args.block, out), nprocs=2, join=True)
        import torch

        ranks = torch.load(out, weights_only=False)
    rows = []
    for i, (label, _, plan) in enumerate(made):
        per_step = [max(a, b) for a, b in zip(ranks[0][i]["times"], ranks[1][i]["times"])]
        measured = statistics.median(per_step)
        rows.append({"plan": label, "mesh": plan.mesh, "sequence_parallel": plan.sequence_parallel,
                     "measured": {"median": measured, "min": min(per_step), "max": max(per_step)},
                     "predicted": plan.step_time, "error": plan.step_time / measured - 1, "terms": vars(plan.terms) if plan.terms else None,
                     "over_unsplit_1_thread": unsplit["1 thread"] / measured})
    print(f"unsplit: {unsplit['1 thread'] * 1e3:.0f} ms (1 thread), {unsplit['2 threads'] * 1e3:.0f} ms (2 threads)")
    print(f"{'plan':26s} {'measured ms (min-max)':>24s} {'predicted':>10s} {'error':>7s} {'vs 1 thread':>11s}")
    for r in rows:
        m = r["measured"]
        print(f"{r['plan']:26s} {m['median'] * 1e3:8.0f} ({m['min'] * 1e3:5.0f}-{m['max'] * 1e3:5.0f}) "
              f"{r['predicted'] * 1e3:10.0f} {r['error']:+7.1%} {r['over_unsplit_1_thread']:10.2f}x")
    Path(args.out).write_text(json.dumps({"benchmark": "tp_fidelity", "machine": machine(), "seconds": time.time() - start,
                                          "runtime": runtime.to_dict(), "unsplit": unsplit, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
