"""How long, and in how much memory, the pipeline planner decides the large cases of issue 47 item 4.

Each case runs in a fresh interpreter (its peak RSS, by ``resource.getrusage``, is the planning
process's own); a transformers model built on the meta device, H100-80GB presets (simulated):

- ``hybrid-70b``: ``plan_hybrid`` of Llama-3-70B on ``Cluster.dgx_h100(nodes=32)`` (bf16-mixed, ``checkpointing="auto"``,
  1F1B, one sequence of 4096 per device), replica sizes 16…128, ``time_limit=20``: which replica sizes end without a plan,
  and why (105 s and 2.6 GB RSS on 2026-11-27: 16 and 128 proven infeasible, 32 and 64 planned; it was
  25 min before the mesh work of issue 47; ``hybrid-70b-ends``: replica sizes 16 and 128 only);
- ``fp32-70b`` / ``fp32-mixtral``: fp32, 1F1B, no checkpointing, Llama-3-70B on 32 (32 × 4096),
  Mixtral-8x7B on 16 (16 × 4096): a plan or a proven ``InfeasiblePlanError``;
- ``mixed-70b``: bf16-mixed, ``checkpointing="auto"``, 1F1B, Llama-3-70B on 32 (32 × 4096): time, gap,
  stages without a decoder layer;
- ``mixed-8b-gpipe`` / ``mixed-8b-1f1b``: Llama-3-8B on 8 (8 × 8192) as ``benchmarks/plan_llms.py`` plans it;
- ``mesh-…``: the same cases planned on ``Cluster.dgx_h100`` (the data-parallel degrees chosen with the
  split, ``autosplit.compiler.mesh``): the mesh chosen, the gap over every configuration, each configuration's outcome.

Usage::

    .venv/bin/python benchmarks/investigations/scale_cases.py                 # every case, about 5 min
    .venv/bin/python benchmarks/investigations/scale_cases.py mixed-70b fp32-70b
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CASES: dict[str, dict[str, Any]] = {
    "fp32-70b": dict(model="llama3-70b", devices=32, batch=32, seq=4096, precision="fp32", checkpointing="none"),
    "fp32-mixtral": dict(model="mixtral-8x7b", devices=16, batch=16, seq=4096, precision="fp32", checkpointing="none"),
    "mixed-70b": dict(model="llama3-70b", devices=32, batch=32, seq=4096, precision="bf16-mixed", checkpointing="auto"),
    "mixed-8b-1f1b": dict(model="llama3-8b", devices=8, batch=8, seq=8192, precision="bf16-mixed", checkpointing="auto"),
    "mixed-8b-gpipe": dict(model="llama3-8b", devices=8, batch=8, seq=8192, precision="bf16-mixed", checkpointing="auto",
                           schedule="gpipe"),
    **{f"mesh-{name}": {**case, "mesh": True} for name, case in (
        ("fp32-70b", dict(model="llama3-70b", devices=32, batch=32, seq=4096, precision="fp32", checkpointing="none")),
        ("fp32-mixtral", dict(model="mixtral-8x7b", devices=16, batch=16, seq=4096, precision="fp32", checkpointing="none")),
        ("mixed-70b", dict(model="llama3-70b", devices=32, batch=32, seq=4096, precision="bf16-mixed", checkpointing="auto")),
        ("mixed-8b", dict(model="llama3-8b", devices=8, batch=8, seq=8192, precision="bf16-mixed", checkpointing="auto")),
    )},
    "hybrid-70b": dict(model="llama3-70b", hybrid=True, batch=1, seq=4096, precision="bf16-mixed", checkpointing="auto",
                       replica_sizes=[16, 32, 64, 128]),
    "hybrid-70b-ends": dict(model="llama3-70b", hybrid=True, batch=1, seq=4096, precision="bf16-mixed", checkpointing="auto",
                            replica_sizes=[16, 128]),
}


def _plan(case: dict[str, Any]) -> dict[str, Any]:
    import torch

    import autosplit
    from benchmarks.plan_llms import _model

    start = time.perf_counter()
    model = _model(case["model"])
    spec = autosplit.Spec((case["batch"], case["seq"]), torch.long)
    row: dict[str, Any] = {}
    try:
        devices = autosplit.Cluster.dgx_h100(nodes=case["devices"] // 8) if case.get("mesh") else ["H100-80GB"] * case["devices"]
        plan = autosplit.plan(model, devices, example_inputs=(spec,), schedule=case.get("schedule", "1f1b"),
                              precision=case["precision"], checkpointing=case["checkpointing"], time_limit=case.get("time_limit", 10.0))
        layerless = [s for s, st in enumerate(plan.stages) if not any(re.search(r"layers\.\d+", m) for m in st.modules)]
        if case.get("mesh"):  # the degrees chosen with the split: the mesh, and what each configuration gave
            row.update(mesh=plan.mesh, step_gap=plan.step_gap, configurations=[
                {"pp": len(a.rank_memory) or None, "data_parallel": a.data_parallel, "dp_shard": a.dp_shard, "step_s": a.step_time,
                 "bound_s": a.bound, "note": a.note[:200]} for a in plan.alternatives])
        row.update(outcome="planned", step_s=plan.step_time, gap=plan.solver.gap, solver=plan.solver.name,
                   status=plan.solver.status, layerless=layerless, timings={k: round(v, 2) for k, v in plan.timings.items()},
                   max_memory_gib=max(st.memory for st in plan.stages) / 2**30)
    except autosplit.AutosplitError as e:
        row.update(outcome=type(e).__name__, message=str(e)[:400])
    row["wall_s"] = time.perf_counter() - start
    return row


def _hybrid(case: dict[str, Any]) -> dict[str, Any]:
    import torch

    import autosplit
    from benchmarks.plan_llms import _model

    start = time.perf_counter()
    model = _model(case["model"])
    spec = autosplit.Spec((case["batch"], case["seq"]), torch.long)
    try:
        hp = autosplit.plan_hybrid(model, autosplit.Cluster.dgx_h100(nodes=32), example_inputs=(spec,), per_device_batch=case["batch"],
                                   replica_sizes=case["replica_sizes"], time_limit=20, schedule="1f1b", precision=case["precision"],
                                   checkpointing=case["checkpointing"])
    except autosplit.AutosplitError as e:  # no replica size planned: the message lists each one's cause
        return {"outcome": type(e).__name__, "message": str(e)[:3000], "wall_s": time.perf_counter() - start}
    rows = [{"k": r.k, "worker_batch": r.worker_batch, "planned": r.feasible, "error": (r.error or "")[:500]} for r in hp.rows]
    return {"outcome": "done", "rows": rows, "wall_s": time.perf_counter() - start}


def one(name: str) -> dict[str, Any]:
    """Run case ``name`` in this process (call it in a fresh one)."""
    case = CASES[name]
    row = {"case": name, **(_hybrid(case) if case.get("hybrid") else _plan(case))}
    row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return row


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=[c for c in CASES if not c.startswith("hybrid")])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "scale_cases.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from benchmarks.fresh import in_fresh_process

    rows = []
    for name in args.cases:
        row = {"case": name, **in_fresh_process("benchmarks.investigations.scale_cases:one", name)}
        rows.append(row)
        logging.warning("%s", json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
