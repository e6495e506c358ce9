"""The large models planned on a whole cluster, the data-parallel degrees chosen with the split: how
long, in how much memory, and to what end (a plan, with its gap over every configuration, or a
proven ``InfeasiblePlanError``).

Simulated: transformers models built on the meta device, planned onto ``Cluster.dgx_h100`` presets
(the cost model's figures, not measurements). Each case is planned in a fresh process
(``benchmarks/investigations/scale_cases.py``'s ``mesh-…`` cases), so its peak RSS is its own:

- Llama-3-8B on 8 H100s (8 × 8192, bf16-mixed, ``checkpointing="auto"``);
- Llama-3-70B on 32 (32 × 4096) in fp32 without recomputation, and in bf16-mixed with ``"auto"``;
- Mixtral-8x7B on 16 (16 × 4096, fp32, no recomputation). All 1F1B.

Prints a table and writes ``benchmarks/results/plan_mesh.json`` (``--out``).

Usage::

    .venv/bin/python benchmarks/plan_mesh.py          # about 2 min on an idle 2-core machine
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES = ("mesh-mixed-8b", "mesh-fp32-70b", "mesh-mixed-70b", "mesh-fp32-mixtral")


def _line(row: dict[str, Any]) -> str:
    if row["outcome"] == "planned":
        mesh = " × ".join(f"{k} {v}" for k, v in row["mesh"].items() if v > 1)
        gap = "unknown" if row.get("step_gap") is None else f"{row['step_gap']:.1%}"
        end = f"{mesh}, step {row['step_s']:.3f} s, gap {gap}, {len(row['configurations'])} configurations"
    else:
        end = f"{row['outcome']}: {row.get('message', row.get('stderr', ''))[:160]}"
    return f"{row['case']:>18} {row.get('wall_s', 0):7.1f} s {row.get('peak_rss_gb', 0):6.2f} GB  {end}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "plan_mesh.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from benchmarks.fresh import in_fresh_process
    from benchmarks.plan_time import machine

    print("simulated: H100 presets, the cost model's figures (not measured)")
    print(f"{'case':>18} {'planned in':>9} {'RSS':>9}  outcome")
    rows = []
    for name in CASES:
        rows.append({"case": name, **in_fresh_process("benchmarks.investigations.scale_cases:one", name)})
        print(_line(rows[-1]), flush=True)
    args.out.write_text(json.dumps({"benchmark": "plan_mesh", "simulated": True, "machine": machine(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
