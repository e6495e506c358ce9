"""Does a plan run slower when its processes also hold, and run, other plans?

``schedules.py`` times plans on pairs of gloo processes in interleaved blocks. Until 2026-11-25 one pair
held all of a model's ~40 plans; a user runs one. This benchmark times a few of the GPT's plans
(``schedules.py``'s workload and profile) alone, each on a fresh pair, and then all together with
the others of a crowd (every multi-stage schedule at v = 2 and M ∈ {4, 8}, twice over) on one pair,
as that run did: median step, alone and in the crowd, beside the prediction
(``benchmarks/investigations/results/crowding.json``).

Usage::

    .venv/bin/python benchmarks/investigations/crowding.py      # about 9 min
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
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import autosplit  # noqa: E402
from autosplit.options import ProfileOptions  # noqa: E402
from autosplit.timers import pinned, steady_allocator  # noqa: E402
from benchmarks.pipeline_runtime import measured_cpu  # noqa: E402
from benchmarks.plan_time import machine  # noqa: E402
from benchmarks.schedules import time_plans, workload  # noqa: E402

WATCHED = [("interleavedzerobubble", 2), ("zbvzerobubble", 4), ("interleavedzerobubble", 8)]
"""The plans timed alone: interleaved zero-bubble at M = 2 (``auto``'s choice for the GPT in some
runs of ``schedules.py``) and two others."""
CROWD = [(s, m) for s in ("interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev") for m in (4, 8)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "investigations" / "results" / "crowding.json"))
    args = parser.parse_args(argv)
    args.warmup, args.block = 1, 2
    start = time.time()
    steady_allocator()
    _, spec = measured_cpu()
    model, inputs, target, loss_fn = workload("gpt")
    with tempfile.TemporaryDirectory() as tmp:
        costs = ProfileOptions(threads=1, cores=(0,), cache_dir=os.path.join(tmp, "profiles"))
        plans: list[dict[str, Any]] = []
        for schedule, m in WATCHED + CROWD + CROWD:
            with pinned(1, (0,)):
                plan = autosplit.Planner(model, [spec] * 2, example_inputs=inputs, schedule=schedule, stages_per_rank=2,
                                         micro_batches=m, time_limit=3, costs=costs, loss_fn=loss_fn,
                                         example_target=target).plan()
            path = os.path.join(tmp, f"plan-{len(plans)}.json")
            plan.save(path)
            plans.append({"schedule": schedule, "micro_batches": m, "predicted": plan.step_time, "path": path})

        def medians(indices: list[int], label: str) -> list[float]:
            got = time_plans("gpt", [plans[i]["path"] for i in indices], args, os.path.join(tmp, label))
            return [statistics.median(max(a, b) for a, b in zip(r0[0], r1[0])) for r0, r1 in zip(*got)]

        alone = [medians([i], f"alone-{i}")[0] for i in range(len(WATCHED))]
        crowd = medians(list(range(len(plans))), "crowd")
    rows: list[dict[str, Any]] = [{"schedule": p["schedule"], "micro_batches": p["micro_batches"], "predicted": p["predicted"],
             "alone": alone[i] if i < len(alone) else None, "in_crowd": crowd[i]} for i, p in enumerate(plans)]
    print(f"GPT, v = 2, {len(plans)} plans in the crowd; median of {args.steps} steps, ms")
    print(f"  {'schedule':22s} {'M':>2s} {'pred':>5s} {'alone':>6s} {'crowd':>6s} {'crowd/alone':>11s} {'crowd/pred':>10s}")
    for r in rows:
        alone_ms = f"{r['alone'] * 1e3:6.0f}" if r["alone"] else f"{'':6s}"
        ratio = f"{r['in_crowd'] / r['alone']:11.3f}" if r["alone"] else f"{'':11s}"
        print(f"  {r['schedule']:22s} {r['micro_batches']:2d} {r['predicted'] * 1e3:5.0f} {alone_ms} "
              f"{r['in_crowd'] * 1e3:6.0f} {ratio} {r['in_crowd'] / r['predicted']:10.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "seconds": time.time() - start, "steps": args.steps, "rows": rows},
                              indent=1))
    print(f"wrote {out} in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
