"""Published parallelism recipes as plans, beside autosplit's own plan of the same model, cluster and batch.

Simulated: the models are built by transformers on the meta device and planned onto H100 presets
(``Cluster.dgx_h100``); every figure is the cost model's, not a measurement. Each row is planned
in a fresh process (its peak RSS is the planning process's own):

- **recipe**: torchtitan's Llama-3.1-8B on 8 H100s as published (torchtitan
  ``benchmarks/llama3_h100_202412_torchtitan.md``, Table 1: FSDP 8 alone, local batch 2 × 8192, global
  batch 16, bf16, selective activation checkpointing: 5,762 tokens/s/GPU at 82.4 GiB on 96 GB H100s)
  — written as an ``autosplit.Recipe(data_parallel=8, replicate="fully_shard", options=...)`` over
  ``Cluster.dgx_h100(nodes=1)`` and the global batch, costed by ``Planner.manual`` (what
  ``autosplit.compare`` puts beside autosplit's plan). torchtitan's selective (per-op) checkpointing
  recomputes the element-wise ops between the matmuls, which a recipe's ``checkpointing`` cannot say:
  the two rows bracket it, ``recipe:full-ac`` (every layer recomputed: no selective mode recomputes more)
  and ``recipe:no-ac`` (nothing recomputed, over the 80 GiB cap: shown, not refused);
- **autosplit**: ``autosplit.plan(model, Cluster.dgx_h100(nodes=1), ...)`` at the same global batch
  (16 × 8192), bf16-mixed, ``checkpointing="auto"``: the degrees, split, schedule, micro-batches and
  recomputation chosen together;
- **memory**: the pipeline-only plan of Llama-3-8B on 8 H100s (8 stages, GPipe, 8 micro-batches, no
  recomputation, caps lifted) in fp32 and in bf16-mixed: the fullest stage's activation memory
  (with the weights cast once per step, bf16-mixed holds less).

Prints a table and writes ``benchmarks/results/plan_3d.json`` (``--out``).

Usage::

    .venv/bin/python benchmarks/plan_3d.py          # about 5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

PUBLISHED_8B_FSDP8 = 5762.0
"""torchtitan Llama-3.1-8B, 8 × H100, FSDP 8, bf16, local batch 2 × 8192, selective activation checkpointing:
tokens/s/GPU (torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1)."""
SEQ = 8192
GLOBAL_8B = 16
"""The published run's global batch: local batch 2 × 8 FSDP ranks."""


def _plan_row(kind: str, time_limit: float) -> dict[str, Any]:
    """One row, planned in this process."""
    import torch

    import autosplit
    from benchmarks.plan_llms import _model

    model = _model("llama3-8b")
    rows = 8 if kind.startswith("memory") else GLOBAL_8B
    tokens = autosplit.Spec((rows, SEQ), torch.long)
    start = time.perf_counter()
    row: dict[str, Any] = {"kind": kind}
    try:
        if kind.startswith("recipe"):
            recipe = autosplit.Recipe(data_parallel=8, replicate="fully_shard", options={
                "precision": "bf16-mixed", "checkpointing": "full" if kind == "recipe:full-ac" else "none", "micro_batches": 1})
            plan = autosplit.Planner(model, autosplit.Cluster.dgx_h100(nodes=1), example_inputs=(tokens,)).manual(
                recipe, check_memory=False)
            row["fits"] = all(st.memory <= st.capacity for st in plan.stages)
        elif kind == "autosplit":
            plan = autosplit.plan(model, autosplit.Cluster.dgx_h100(nodes=1), example_inputs=(tokens,), precision="bf16-mixed",
                                  checkpointing="auto", time_limit=time_limit)
        else:  # no recomputation and room for everything: the activations as each precision holds them
            plan = autosplit.plan(model, ["H100-80GB"] * 8, example_inputs=(tokens,), precision=kind.split(":")[1],
                                  schedule="gpipe", micro_batches=8, time_limit=time_limit, memory={d: "1TiB" for d in range(8)})
        devices = plan.mesh["pp"] * plan.data_parallel
        tokens_per_gpu = rows * SEQ / plan.step_time / devices
        row.update(
            outcome="planned", mesh=plan.mesh, step_s=plan.step_time, gap=plan.step_gap, schedule=plan.schedule,
            micro_batches=plan.micro_batches, tokens_per_s_per_gpu=tokens_per_gpu,
            memory_state_gib=[s.memory_state / 2**30 for s in plan.stages], memory_gib=[s.memory / 2**30 for s in plan.stages],
            activations_gib=[s.memory_activations / 2**30 for s in plan.stages], terms=plan.terms.__dict__ if plan.terms else None,
            alternatives=[{"data_parallel": a.data_parallel, "dp_shard": a.dp_shard, "pp": len(a.rank_memory), "step_s": a.step_time,
                           "note": a.note} for a in plan.alternatives],
        )
    except autosplit.AutosplitError as e:
        row.update(outcome=type(e).__name__, message=str(e).split(". Likely cause")[0])
    row["total_s"] = time.perf_counter() - start
    row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return row


def run(time_limit: float) -> list[dict[str, Any]]:
    from benchmarks.fresh import in_fresh_process

    rows = []
    for kind in ("recipe:full-ac", "recipe:no-ac", "autosplit", "memory:fp32", "memory:bf16-mixed"):
        row = {"kind": kind, **in_fresh_process("benchmarks.plan_3d:_plan_row", kind, time_limit, timeout=1200)}
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    if row["outcome"] != "planned":
        return f"{row['kind']:>18}  {row['outcome']}: {row.get('message', row.get('stderr', ''))[:300]}"
    mesh = " × ".join(f"{k} {v}" for k, v in row["mesh"].items() if v > 1) or "one device"
    gap = f"{row['gap']:.1%}" if row["gap"] is not None else "unknown"
    return (f"{row['kind']:>18}  {mesh:<22} step {row['step_s']:7.3f} s  {row['tokens_per_s_per_gpu']:8,.0f} tokens/s/GPU  "
            f"gap {gap:>7}  fullest {max(row['memory_gib']):5.1f} GiB (activations {max(row['activations_gib']):5.1f})  "
            f"planned in {row['total_s']:5.1f} s, {row['peak_rss_gb']:.2f} GB RSS"
            + ("  (over the cap)" if row.get("fits") is False else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver limit per configuration")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "plan_3d.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.plan_time import machine

    print("simulated: H100 presets, the cost model's figures (not measured)")
    rows = run(args.time_limit)
    by_kind = {r["kind"]: r for r in rows}
    summary: dict[str, Any] = {"published_tokens_per_s_per_gpu": PUBLISHED_8B_FSDP8,
                               "published_source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1: Llama-3.1-8B, "
                                                   "8 x H100, FSDP 8, local batch 2, selective AC, bf16"}
    for kind in ("recipe:full-ac", "recipe:no-ac"):
        if by_kind[kind]["outcome"] == "planned":
            summary[f"{kind}_over_published"] = by_kind[kind]["tokens_per_s_per_gpu"] / PUBLISHED_8B_FSDP8
            print(f"{kind} predicted / published: {summary[f'{kind}_over_published']:.2f}")
    ours, recipe = by_kind["autosplit"], by_kind["recipe:full-ac"]
    if ours["outcome"] == "planned" and recipe["outcome"] == "planned":
        summary["autosplit_over_recipe"] = ours["tokens_per_s_per_gpu"] / recipe["tokens_per_s_per_gpu"]
        print(f"autosplit / recipe:full-ac (predicted): {summary['autosplit_over_recipe']:.2f}")
    args.out.write_text(json.dumps({"benchmark": "plan_3d", "simulated": True, "machine": machine(), "summary": summary,
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
