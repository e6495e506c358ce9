"""Planning real LLM sizes on the meta device, from shapes alone.

Each model is built by transformers from its published configuration under
``torch.device("meta")`` (no weights are allocated) and planned with ``autosplit.Spec`` inputs
onto H100 presets, in a fresh process each, so its peak RSS is the planning process's own:

- Llama-3-8B onto 8 H100s; Llama-3-70B onto 16, 32 and 64 (80 layers, GQA, vocabulary 128256,
  sequence 8192); a Mixtral-8x7B-shaped mixture of experts onto 16.

Recorded per model: capture, annotate, estimate and solve seconds, the process's peak RSS, and
the outcome: the plan's layers per stage, memory per device and predicted step — or, where no
plan fits (fp32 without recomputation: Adam state and activations exceed 80 GB), the least
memory any plan needs, as the solver proves it. ``precision="bf16"`` converts the meta model to
bfloat16 and plans it as it is (parameters, gradients and Adam moments in bf16: torch.export bakes
the dtypes it traces, so autosplit refuses to convert an exported graph itself). Beside it, torchtitan's uniform layout
(``generate_llm_fqn_per_model_part``: input and output modules weighing one layer each) costed by
the same model, memory caps not enforced (its memory per device says by how much it misses).
These are planned for GPUs this machine does not have: the figures are the cost model's (H100
presets), not measurements.

Prints a table and writes ``benchmarks/results/plan_llms.json`` (``--out``), the file
``docs/big-models.md`` reads.

Usage::

    .venv/bin/python benchmarks/plan_llms.py                          # bf16-mixed, checkpointing="auto"; about 5 min
    .venv/bin/python benchmarks/plan_llms.py --precision fp32 --checkpointing none --out /tmp/fp32.json
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any

LLAMA3_8B: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
)
LLAMA3_70B: dict[str, Any] = {
    **LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
}
LLAMA3_405B: dict[str, Any] = {
    **LLAMA3_8B, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
}
MIXTRAL_8X7B: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=32000, max_position_embeddings=8192, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
)
CASES = [("llama3-8b", 8), ("llama3-70b", 16), ("llama3-70b", 32), ("llama3-70b", 64), ("mixtral-8x7b", 16)]


def _model(name: str) -> Any:
    """The model on the meta device, its attention causal as the engines run it (as the record's stand-ins:
    :func:`benchmarks.published_models.build`), so that a plan here and a row of ``benchmarks/published.py`` cost one
    layout alike."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from benchmarks.published_models import causal_attention

    config: Any
    cls: Any
    if name == "mixtral-8x7b":
        config, cls = MixtralConfig(**MIXTRAL_8X7B), MixtralForCausalLM
    else:
        config, cls = LlamaConfig(**{"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "llama3-405b": LLAMA3_405B}[name]), LlamaForCausalLM
    config._attn_implementation = causal_attention()
    with torch.device("meta"):
        return cls(config)


def _layers(modules: tuple[str, ...]) -> str:
    return ", ".join(modules)


def _attention_share(gm: Any) -> float:
    """The share of the forward and backward FLOPs annotation counts in attention kernels
    (``scaled_dot_product_attention`` and the kernels it dispatches to)."""
    from autosplit.passes.annotations import node_info

    work = [(node_info(n).fwd_flops + node_info(n).bwd_flops, "attention" in str(n.target)) for n in gm.graph.nodes
            if n.op == "call_function" and "autosplit" in n.meta]
    total = sum(f for f, _ in work)
    return sum(f for f, attention in work if attention) / total if total else 0.0


def plan_one(
    name: str, devices: int, batch: int, seq: int, schedule: str, time_limit: float, precision: str = "fp32", checkpointing: str = "none",
) -> dict[str, Any]:
    """Plan one model in this process (call it in a fresh one: its peak RSS is reported)."""
    import torch

    import autosplit
    from autosplit.compiler.manual import execution_order, manual_plan, torchtitan_fqns

    start = time.perf_counter()
    model = _model(name)
    runs_in = precision
    if precision == "bf16":  # torch.export bakes dtypes: the model is converted first and planned as it is
        model.to(torch.bfloat16)
        runs_in = "fp32"
    row: dict[str, Any] = {"model": name, "devices": devices, "batch": batch, "seq": seq, "schedule": schedule,
                           "precision": precision, "checkpointing": checkpointing, "params": sum(p.numel() for p in model.parameters())}
    planner = None
    try:
        planner = autosplit.Planner(model, ["H100-80GB"] * devices, example_inputs=(autosplit.Spec((batch, seq), torch.long),),
                                    schedule=schedule, time_limit=time_limit, precision=runs_in, checkpointing=checkpointing)
        plan = planner.plan()
        row["attention_flops_share"] = _attention_share(planner.traced.captured.gm)
        row.update(outcome="planned", passes_s={k: round(v, 3) for k, v in plan.timings.items()}, step_s=plan.step_time,
                   stages=[{"modules": _layers(s.modules), "memory_gib": s.memory / 2**30, "recompute": len(s.recompute)}
                           for s in plan.stages],
                   solver=plan.solver.status, gap=plan.solver.gap)
    except autosplit.AutosplitError as e:
        need = re.search(r"needs (?:at least )?([\d.]+) GiB", str(e))
        row.update(outcome=type(e).__name__, message=str(e).split(". Likely cause")[0],
                   least_memory_gib=float(need.group(1)) if need else None,
                   passes_s={} if planner is None else {k: round(v, 3) for k, v in planner.traced.timings.items()})
    row["total_s"] = time.perf_counter() - start
    if planner is None:  # refused before any work: nothing to compare against
        row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        return row
    try:
        split = torchtitan_fqns(model, devices, repeated="model.layers", order=execution_order(planner.traced))
        uniform = manual_plan(planner, split, name="torchtitan uniform", check_memory=False)
        row["torchtitan"] = {"step_s": uniform.step_time, "stages": [{"modules": _layers(s.modules), "memory_gib": s.memory / 2**30}
                                                                    for s in uniform.stages]}
    except autosplit.AutosplitError as e:
        row["torchtitan"] = {"error": str(e).split(". Likely cause")[0]}
    row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return row


def run(
    batch: int, seq: int, schedules: list[str], time_limit: float, precision: str = "fp32", checkpointing: str = "none",
) -> list[dict[str, Any]]:
    """Every case, each planned in a fresh interpreter; prints a table row as each finishes."""
    from benchmarks.fresh import in_fresh_process

    rows = []
    print(f"{'model':>13} {'devices':>7} {'schedule':>8} {'capture':>8} {'annotate':>8} {'estimate':>8} {'solve':>6} {'total s':>7} "
          f"{'RSS GB':>6}  outcome")
    for name, devices in CASES:
        for schedule in schedules:
            row = in_fresh_process("benchmarks.plan_llms:plan_one", name, devices, batch, seq, schedule, time_limit, precision,
                                   checkpointing, timeout=900)
            if row["outcome"] == "crashed":
                print(f"{name:>13} {devices:>7} {schedule:>8} failed: {row['stderr'].strip().splitlines()[-1:]}")
                rows.append({"model": name, "devices": devices, "schedule": schedule, **row})
                continue
            rows.append(row)
            p = row.get("passes_s", {})
            outcome = (f"step {row['step_s']:.2f} s, max memory {max(s['memory_gib'] for s in row['stages']):.1f} GiB, "
                       f"attention {row['attention_flops_share']:.1%} of the FLOPs"
                       if row["outcome"] == "planned" else f"{row['outcome']}: needs {row['least_memory_gib']} GiB")
            times = " ".join(f"{p[k]:8.2f}" if k in p else f"{'-':>8}" for k in ("capture", "annotate", "estimate"))  # - : not reached
            solve = f"{p['solve']:6.2f}" if "solve" in p else f"{'-':>6}"
            print(f"{name:>13} {devices:>7} {schedule:>8} {times} {solve} {row['total_s']:7.2f} "
                  f"{row['peak_rss_gb']:6.2f}  {outcome}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver limit (the library default)")
    parser.add_argument("--precision", default="bf16-mixed", help="fp32, bf16-mixed, bf16 (the meta model converted first), ...")
    parser.add_argument("--checkpointing", default="auto", help="none, full or auto")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "plan_llms.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.plan_time import machine

    rows = run(args.batch, args.seq, args.schedules, args.time_limit, args.precision, args.checkpointing)
    args.out.write_text(json.dumps({"benchmark": "plan_llms", "machine": machine(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
