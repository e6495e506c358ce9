"""Per-stage prediction against each stage run alone through its GPipe schedule.

For each model at bench size on 2 CPU devices (measured per-node costs, one pinned core, one
thread), the plan's predicted compute per stage (forward + backward of every micro-batch and the
optimizer step) beside ``autosplit.calibration.measure_stages``: the stage alone, all M forwards then all M
backwards, then Adam. A stage whose M micro-batches' activations are alive at once can run slower
than its nodes replayed one micro-batch at a time, which the per-node profile cannot see.

Usage::

    .venv/bin/python benchmarks/investigations/stage_fidelity.py [--models inception_v3,gpt] [--micro 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import autosplit
import autosplit.calibration
from autosplit.microbatch import split_batch
from autosplit.options import ProfileOptions

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.pipeline_runtime import workload  # noqa: E402
from benchmarks.plan_time import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "investigations" / "results" / "stage_fidelity.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,inception_v3,gnmt,biglstm")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    rows = []
    print(f"{'model':13s} {'stage':>5s} {'predicted ms':>13s} {'measured alone ms':>18s} {'error':>7s}")
    for name in args.models.split(","):
        model, inputs, _, _ = workload(name)
        planner = autosplit.Planner(
            model, ["cpu"] * 2, example_inputs=inputs, micro_batches=args.micro, time_limit=5,
            costs=ProfileOptions(threads=1, cores=(0,)),
        )
        plan = planner.plan()
        split = planner.build(plan)
        measured = autosplit.calibration.measure_stages(split, split_batch(inputs, {}, args.micro), threads=1, cores=(0,))
        for s, (stage, got) in enumerate(zip(plan.stages, measured)):
            error = (stage.compute - got.time) / got.time
            rows.append({"model": name, "stage": s, "predicted": stage.compute, "measured": got.time, "error": error,
                         "modules": list(stage.modules)})
            print(f"{name:13s} {s:>5d} {stage.compute * 1e3:13.1f} {got.time * 1e3:18.1f} {error:+7.1%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "micro_batches": args.micro, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
