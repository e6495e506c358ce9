"""Published parallelism recipes as plans, beside autosplit's own plan of the same model, cluster and batch.

Simulated: the models are built by transformers on the meta device and planned onto the presets of the GPUs
each run had, with the engine profile of its stack (``Cluster.of(gpu, count, engine=...)``: the figures fitted
once to the published record, :mod:`autosplit.engine_profiles`, ``docs/published.md``); every figure is the cost
model's, not a measurement. Each row is planned in a fresh process (its peak RSS is the planning process's own):

- **recipe**: torchtitan's Llama-3.1-8B on 8 H100s as published (torchtitan
  ``benchmarks/llama3_h100_202412_torchtitan.md``, Table 1: FSDP 8 alone, local batch 2 × 8192, global
  batch 16, bf16, eager, selective activation checkpointing: 5,762 tokens/s/GPU at 82.4 GiB on its 96 GB,
  500 W H100s) — written as an ``autosplit.Recipe(data_parallel=8, replicate="fully_shard", options=...)`` over
  ``Cluster.of("H100-500W", 8, engine="torch-eager")`` and the global batch, costed by ``Planner.manual`` (what
  ``autosplit.compare`` puts beside autosplit's plan). torchtitan's selective (per-op) checkpointing
  recomputes the element-wise ops between the matmuls: ``recipe:selective-ac`` is autosplit's
  selective recomputation of every layer (``selective=True``: every matmul's output kept, where
  torchtitan's also recomputes every second ``mm``), and two rows bracket it, ``recipe:full-ac`` (every
  layer recomputed: no selective mode recomputes more) and ``recipe:no-ac`` (nothing recomputed: shown, not refused);
- **autosplit**: ``autosplit.plan(model, <the same cluster>, ...)`` at the same global batch
  (16 × 8192), in :data:`PRECISION` as the recipes, ``checkpointing="auto"``, ``selective="auto"``,
  ``micro_batches="auto"``: the degrees, split, micro-batches and recomputation (selective or whole) chosen together;
- **memory**: the pipeline-only plan of Llama-3-8B on 8 H100s (8 stages, GPipe, 8 micro-batches, no
  recomputation, caps lifted) in fp32, bf16-mixed and bf16-fsdp: the fullest stage's activation memory
  (with the weights cast once per step, bf16-mixed holds less; bf16-fsdp's residual stream is bf16).

- **at scale** (:mod:`benchmarks.workloads.recipes`): torchtitan's Llama-3.1-70B on 256 H100s (FSDP 32 ×
  TP 8), its Llama-3.1-405B on 512 (FSDP 8 × TP 8 × PP 8, Interleaved 1F1B, async TP), both compiled on its
  500 W H100s, and Megatron-Bridge's Llama-3-70B on 64 DGX H100s (TP 4 × PP 8 × VP 5, TP overlap), each with its
  linears in FP8 as it ran (``float8="tensorwise"``): ``NAME:recipe`` costs the recipe in :data:`PRECISION`
  (``Recipe`` with its degrees, layers per stage, schedule, micro-batches and checkpointing over the whole cluster
  and global batch); ``megatron-70b:recipe-recompute`` the Megatron layout with Megatron's own full recomputation
  (``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``: the most memory Megatron's
  flags save, what its users add on OOM), ``megatron-70b:recipe-recompute-block`` with the first layer of each
  stage recomputed (``--recompute-method block --recompute-num-layers 1``: half of each two-layer stage, the only
  variant between the two); ``NAME:autosplit`` plans the same model, cluster and global batch with every degree and
  the micro-batch count chosen (:data:`PRECISION`, ``checkpointing="auto"``, ``selective="auto"``,
  ``micro_batches="auto"``, 1F1B), on the same stack: FP8 linears (``float8="auto"``: each linear by its cost), and
  the recipe's TP overlap;
  ``megatron-70b:autosplit-recipe-mesh`` plans it on the recipe's own degrees, schedule, stages per rank and
  micro-batches (TP 4 × PP 8 × VP 5 over DP 2, 64 micro-batches), autosplit choosing the split and the recomputation;
  ``megatron-70b:autosplit-recipe-schedule`` on the recipe's schedule and stages per rank (interleaved 1F1B, VP 5, as
  Megatron's flags fix them) with every degree, the micro-batches, the split, the recomputation and the FP8 linears
  chosen: the mesh search then plans every mesh whose floor leaves room (:data:`SEARCH_S`).

Prints a table and writes ``benchmarks/results/plan_3d.json`` (``--out``); name rows to plan only those: they replace
their rows in the file, the others kept (the summary recomputed over them all).

Usage::

    .venv/bin/python benchmarks/plan_3d.py                       # every row
    .venv/bin/python benchmarks/plan_3d.py titan-70b:recipe      # one row
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PUBLISHED_8B_FSDP8 = 5762.0
"""torchtitan Llama-3.1-8B, 8 × H100, FSDP 8, bf16, local batch 2 × 8192, selective activation checkpointing:
tokens/s/GPU (torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1)."""
SEQ = 8192
GLOBAL_8B = 16
"""The published run's global batch: local batch 2 × 8 FSDP ranks."""
PRECISION = "bf16-fsdp"
"""What the published runs train in, and every recipe and autosplit row is planned in: FSDP2's
``MixedPrecisionPolicy`` (bf16 parameters gathered, fp32 master weights and reductions), torchtitan's
default; Megatron's ``--bf16`` likewise computes with every weight in bf16 over fp32 master weights."""


def _eight_b_cluster() -> Any:
    """The published 8B run's cluster: one of torchtitan's Grand Teton hosts (8 × 96 GB H100 at 500 W), eager."""
    import autosplit

    return autosplit.Cluster.of("H100-500W", 8, engine="torch-eager")


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
                "precision": PRECISION, "checkpointing": "none" if kind == "recipe:no-ac" else "full", "micro_batches": 1,
                "selective": kind == "recipe:selective-ac"})
            plan = autosplit.Planner(model, _eight_b_cluster(), example_inputs=(tokens,)).manual(
                recipe, check_memory=False)
        elif kind == "autosplit":
            plan = autosplit.plan(model, _eight_b_cluster(), example_inputs=(tokens,), precision=PRECISION,
                                  checkpointing="auto", selective="auto", micro_batches="auto", time_limit=time_limit)
        else:  # no recomputation and room for everything: the activations as each precision holds them
            plan = autosplit.plan(model, ["H100-80GB"] * 8, example_inputs=(tokens,), precision=kind.split(":")[1],
                                  schedule="gpipe", micro_batches=8, time_limit=time_limit, memory={d: "1TiB" for d in range(8)})
        row.update(_described(plan, rows))
    except autosplit.AutosplitError as e:
        row.update(outcome=type(e).__name__, message=str(e).split(". Likely cause")[0])
    row["total_s"] = time.perf_counter() - start
    row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return row


def _described(plan: Any, rows: int) -> dict[str, Any]:
    """A plan's row: its mesh, step, throughput per GPU and memory, and every configuration it tried."""
    devices = math.prod(plan.mesh.values())
    # (bytes, cap) of each device: its stages together where a schedule puts several on one rank, as the report counts them
    held = ([(m, plan.stages[plan.stage_devices.index(r)].capacity) for r, m in enumerate(plan.rank_memory)]
            if plan.stages_per_rank > 1 else [(st.memory, st.capacity) for st in plan.stages])
    return dict(
        outcome="planned", mesh=plan.mesh, step_s=plan.step_time, gap=plan.step_gap, schedule=plan.schedule,
        stages_per_rank=plan.stages_per_rank, micro_batches=plan.micro_batches, tokens_per_s_per_gpu=rows * SEQ / plan.step_time / devices,
        fits=all(m <= cap for m, cap in held), recompute=len(plan.recompute), selective=plan.recompute_selective,
        sequence_parallel=plan.sequence_parallel, float8=plan.float8, float8_linears=len(plan.float8_linears),
        memory_state_gib=[s.memory_state / 2**30 for s in plan.stages], memory_gib=[m / 2**30 for m, _ in held],
        activations_gib=[s.memory_activations / 2**30 for s in plan.stages],
        # torch's PipelineStage buffers, one per micro-batch all step: received tensors and their gradients, and the gradients of those sent
        buffers_gib=[(s.memory_received + s.memory_buffers) / 2**30 for s in plan.stages],
        terms=plan.terms.__dict__ if plan.terms else None,
        alternatives=[{"data_parallel": a.data_parallel, "dp_shard": a.dp_shard, "tp": a.tensor_parallel, "pp": len(a.rank_memory),
                       "micro_batches": a.micro_batches, "step_s": a.step_time, "note": a.note[:300]} for a in plan.alternatives],
    )


def _scale_row(kind: str, time_limit: float) -> dict[str, Any]:
    """One row of a recipe at scale (:mod:`benchmarks.workloads.recipes`), ``"NAME:recipe"`` or
    ``"NAME:autosplit"`` (the same model, cluster and global batch, every degree chosen), in this process."""
    import torch

    import autosplit
    from autosplit.compiler.manual import execution_order, torchtitan_fqns
    from benchmarks.plan_llms import _model
    from benchmarks.workloads.recipes import RECIPES

    name, which = kind.split(":")
    r = RECIPES[name]
    model = _model(r.model)
    cluster = autosplit.Cluster.of(r.gpu, 8 * r.nodes, engine=r.engine)
    tokens = autosplit.Spec((r.rows, SEQ), torch.long)
    if (which in MEGATRON_RECOMPUTE or which.startswith("autosplit-recipe")) and not r.megatron:  # read from Megatron's flags
        raise SystemExit(f"{kind}: {which} reads the recipe's Megatron flags, and {name} is not a Megatron recipe")
    start = time.perf_counter()
    row: dict[str, Any] = {"kind": kind, "published": r.published, "source": r.source}
    try:
        if which.startswith("recipe") and r.megatron:  # the published layout, read as Megatron reads it
            planner = autosplit.Planner(model, cluster, example_inputs=(tokens,), precision=PRECISION)
            recompute = f" {MEGATRON_RECOMPUTE[which]}" if which in MEGATRON_RECOMPUTE else ""  # same layout
            plan = planner.manual(f"megatron:{r.megatron}{recompute}", check_memory=False)
        elif which.startswith("recipe"):
            planner = autosplit.Planner(model, cluster, example_inputs=(tokens,), precision=PRECISION)
            split = None if r.stages == 1 else torchtitan_fqns(
                model, r.stages, repeated="model.layers", input_weight=r.input_weight, output_weight=r.output_weight,
                order=execution_order(planner.traced))
            plan = planner.manual(autosplit.Recipe(split, data_parallel=r.data_parallel, replicate=r.replicate,
                                                   tensor_parallel=r.tensor_parallel, options=r.options), check_memory=False)
        else:
            searched = which == "autosplit-recipe-schedule"
            planner = autosplit.Planner(model, cluster, example_inputs=(tokens,), precision=PRECISION, checkpointing="auto",
                                        selective="auto", time_limit=max(time_limit, SEARCH_S) if searched else time_limit,
                                        float8="auto", async_tp=r.async_tp)  # the recipe's stack: FP8 linears by cost, TP overlap
            pinned: dict[str, Any] = {"schedule": "1f1b", "micro_batches": "auto", "tensor_parallel": "auto"}
            if which.startswith("autosplit-recipe"):
                mesh = _recipe_mesh(planner, r)  # all of it pinned, or (searched) its schedule and stages per rank
                pinned = mesh if not searched else {**pinned, "schedule": mesh["schedule"], "stages_per_rank": mesh["stages_per_rank"]}
            plan = planner.with_options(**pinned).plan()
        row.update(_described(plan, r.rows))
    except autosplit.AutosplitError as e:
        row.update(outcome=type(e).__name__, message=str(e).split(". Likely cause")[0][:2000])
    row["total_s"] = time.perf_counter() - start
    row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return row


def _recipe_mesh(planner: Any, r: Any) -> dict[str, Any]:
    """The recipe's degrees, schedule, stages per rank and micro-batches, as ``plan`` options: what
    ``NAME:autosplit-recipe-mesh`` pins, leaving autosplit the split and the recomputation (read from
    ``planner``'s capture, which then plans)."""
    recipe = planner.manual(f"megatron:{r.megatron}", check_memory=False)
    return {"data_parallel": recipe.data_parallel, "replicate": "fully_shard" if recipe.dp_shard > 1 else "replicate",
            "tensor_parallel": recipe.tensor_parallel, "schedule": recipe.schedule, "stages_per_rank": recipe.stages_per_rank,
            "micro_batches": recipe.micro_batches}


EIGHT_B = ("recipe:full-ac", "recipe:selective-ac", "recipe:no-ac", "autosplit", "memory:fp32", "memory:bf16-mixed", "memory:bf16-fsdp")
AT_SCALE = (*(f"{name}:{which}" for name in ("titan-70b", "titan-405b", "megatron-70b") for which in ("recipe", "autosplit")),
            "megatron-70b:recipe-recompute", "megatron-70b:recipe-recompute-block", "megatron-70b:autosplit-recipe-mesh",
            "megatron-70b:autosplit-recipe-schedule")
SEARCH_S = 1200.0
"""The mesh search's ``time_limit`` on the recipe's interleaved schedule, long enough that it ends on the floors, not
the clock: each mesh takes 10–40 s to split there, and the floors, which count compute and not the collectives, put
the tensor-parallel meshes last, so a shorter search ends before it reaches them."""
MEGATRON_RECOMPUTE = {
    "recipe-recompute": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "recipe-recompute-block": "--recompute-granularity full --recompute-method block --recompute-num-layers 1",
}
"""Megatron's recomputation flags per row: every layer (the most activation memory its flags save), and
the first layer of each stage."""


def run(kinds: Sequence[str], time_limit: float, budget: float) -> list[dict[str, Any]]:
    """Each row in a fresh process, killed past ``budget`` seconds (a row then says it timed out)."""
    from benchmarks.fresh import in_fresh_process

    rows = []
    for kind in kinds:
        function = "_plan_row" if kind in EIGHT_B else "_scale_row"
        row = {"kind": kind, **in_fresh_process(f"benchmarks.plan_3d:{function}", kind, time_limit, timeout=budget)}
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    if row["outcome"] != "planned":
        return f"{row['kind']:>22}  {row['outcome']} after {row.get('total_s', 0):.0f} s: {row.get('message', row.get('stderr', ''))[:300]}"
    mesh = " × ".join(f"{k} {v}" for k, v in row["mesh"].items() if v > 1) or "one device"
    gap = f"{row['gap']:.1%}" if row["gap"] is not None else "unknown"
    return (f"{row['kind']:>22}  {mesh:<30} step {row['step_s']:7.3f} s  {row['tokens_per_s_per_gpu']:8,.0f} tokens/s/GPU  "
            f"gap {gap:>7}  fullest {max(row['memory_gib']):5.1f} GiB (activations {max(row['activations_gib']):5.1f})  "
            f"planned in {row['total_s']:5.1f} s, {row['peak_rss_gb']:.2f} GB RSS"
            + ("  (over the cap)" if row.get("fits") is False else "")
            + (f"  published {row['published']:,.0f}" if "published" in row else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", default=[*EIGHT_B, *AT_SCALE], help="rows to plan (default: all)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver limit per configuration")
    parser.add_argument("--budget", type=float, default=1800.0, help="seconds a row may take before it is killed")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "plan_3d.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.plan_time import machine

    print("simulated: the published GPUs' presets with the engine profiles fitted to the published record "
          "(the cost model's figures, not measured)")
    rows = run(args.kinds, args.time_limit, args.budget)
    if args.out.exists():  # the rows not planned now stay as they were
        rows = merged(json.loads(args.out.read_text())["rows"], rows)
    summary = _summary({r["kind"]: r for r in rows})
    args.out.write_text(json.dumps({"benchmark": "plan_3d", "simulated": True, "machine": machine(), "summary": summary,
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


def merged(kept: list[dict[str, Any]], planned: list[dict[str, Any]], key: str = "kind") -> list[dict[str, Any]]:
    """A results file's rows after ``planned``: each in place of the kept row of its ``key``, the others as they were,
    new ones after (also ``benchmarks/published.py --into``'s, by ``row_id``)."""
    fresh = {r[key]: r for r in planned}
    return [*(fresh.pop(r[key], r) for r in kept), *fresh.values()]


def _summary(by_kind: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each recipe's prediction over its published figure, and autosplit's plan over each recipe's prediction."""
    out: dict[str, Any] = {"8b_published": PUBLISHED_8B_FSDP8, "8b_source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, "
                           "Table 1: Llama-3.1-8B, 8 x H100, FSDP 8, local batch 2, selective AC, bf16"}
    planned = {k: r for k, r in by_kind.items() if r["outcome"] == "planned"}
    for kind, r in planned.items():
        if kind.startswith("recipe:"):
            out[f"8b_{kind}_over_published"] = r["tokens_per_s_per_gpu"] / PUBLISHED_8B_FSDP8
        elif kind.endswith((":recipe", *(f":{w}" for w in MEGATRON_RECOMPUTE))):
            out[f"{kind}_over_published"] = r["tokens_per_s_per_gpu"] / r["published"]
    pairs = [("autosplit", "recipe:full-ac"), ("autosplit", "recipe:selective-ac"),
             *((f"{k.split(':')[0]}:autosplit", k) for k in planned if k.endswith((":recipe", *(f":{w}" for w in MEGATRON_RECOMPUTE)))),
             *((k, f"{k.split(':')[0]}:recipe") for k in planned if k.endswith((":autosplit-recipe-mesh", ":autosplit-recipe-schedule")))]
    for ours, theirs in pairs:
        if ours in planned and theirs in planned:
            out[f"{ours}_over_{theirs}"] = planned[ours]["tokens_per_s_per_gpu"] / planned[theirs]["tokens_per_s_per_gpu"]
            out[f"{theirs}_fits"] = planned[theirs]["fits"]  # an over-cap recipe's figure is a plan no H100 holds
    for key, value in out.items():
        if "_over_" in key:
            print(f"{key}: {value:.2f}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
