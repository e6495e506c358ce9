"""Published training runs, each costed as an ``autosplit.Recipe`` on its published cluster (simulated).

Reads a CSV with the columns of ``../shared/published/runs.csv`` (see its README) and, for every row it
can express, builds the model on the meta device from the shapes the CSV gives (a transformers
``LlamaConfig``: layers, hidden size, heads, KV heads, FFN width, vocabulary), writes the published
layout as a ``Recipe`` — TP, PP, VP (``stages_per_rank``; ``interleaved1f1b`` when VP > 1, ``1f1b`` when
PP > 1, else ``gpipe``), data parallel ``GPUs / (TP·PP·CP)`` as FSDP2 (``fully_shard``: FSDP or Megatron's
distributed optimizer) or DDP, micro-batches per copy, recomputation, bf16 precision with its linears in FP8 where
the row ran them so (``float8``: tensorwise, rowwise or mxfp8) — and costs it with
``Planner.manual(recipe, check_memory=False)`` on ``Cluster.of(gpu, count)``: the published GPUs as
their system came (:mod:`autosplit.gpu_presets`). Per row: predicted tokens/s/GPU (global batch · sequence / (step · GPUs)), the
published figure, their ratio, the fullest device's predicted memory against its capacity, and
planning seconds; a row it cannot express names why (``nvfp4``, ``cp``, ``ep``, ``moe``, ``lora``,
``model shape unknown``, ``no device preset for B200``, …); a malformed row says what is wrong with it
and the run goes on. Every figure is the cost model's, not a measurement. Each row is costed in a fresh
process (:mod:`benchmarks.fresh`), killed past ``--budget`` seconds.

Summary: median and 90th percentile (nearest rank) of ``|predicted / published − 1|``, the rows within
10%, and per ``layout_group`` the pairs of rows whose predicted order agrees with the published one.

Usage::

    .venv/bin/python benchmarks/published.py --ids 294,295 --out /tmp/published.json
    .venv/bin/python benchmarks/published.py --dry-run          # classify every row only: counts per reason
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import resource
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = ROOT.parent / "shared" / "published" / "runs.csv"
SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size")
REQUIRED = ("row_id", "task", "model", *SHAPE, "moe_experts", "gpu", "num_gpus", "precision", "seq_len", "global_batch_size",
            "micro_batch_size", "tp", "pp", "vp", "cp", "ep", "dp", "fsdp", "distributed_optimizer", "recompute",
            "tokens_per_sec_per_gpu")
TASKS = ("pretrain", "sft")
"""Tasks costed as a training step (LoRA freezes the weights: left out of the step model, as the README says)."""


class Malformed(ValueError):
    """A cell that cannot be read as its column says."""


@dataclass
class Classified:
    """One CSV row read: the reasons it cannot be costed (none: ``spec`` is the recipe to cost)."""

    row_id: str
    info: dict[str, Any]
    reasons: list[str] = field(default_factory=list)
    message: str = ""
    spec: dict[str, Any] | None = None


def _int(row: dict[str, str], column: str, default: int | None = None) -> int | None:
    text = (row.get(column) or "").strip()
    if not text:
        return default
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        raise Malformed(f"{column}={text!r} is not a number") from None
    if value != int(value) or value < 1:
        raise Malformed(f"{column}={text!r} is not a whole number ≥ 1")
    return int(value)


def _published(row: dict[str, str]) -> float | None:
    text = (row.get("tokens_per_sec_per_gpu") or "").strip().replace(",", "")
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise Malformed(f"tokens_per_sec_per_gpu={text!r} is not a number") from None


def _float8(text: str) -> str | Malformed | None:
    """The ``float8`` recipe a ``precision`` cell names (``None``: BF16), or why it is not one autosplit costs
    (a :class:`Malformed` carrying the reason's name). Per-tensor scales (current scaling, Transformer Engine's
    FP8-CS, torchao's tensorwise, and the per-tensor delayed scaling older NeMo pages name "FP8") cost as
    ``tensorwise``; MXFP8 and Megatron-Bridge's "32x32" alternate granularity as ``mxfp8``."""
    upper = text.upper().strip()
    if upper == "BF16":
        return None
    if "NVFP4" in upper:
        return Malformed("nvfp4")
    if "FINE-GRAINED" in upper or "BLOCKWISE" in upper:
        return Malformed("fp8 blockwise")
    if any(name in upper for name in ("MXFP8", "FP8-MX", "32X32", "PARENTHETICAL")):
        return "mxfp8"
    if "ROWWISE" in upper:
        return "rowwise"
    if "FP8" in upper:
        return "tensorwise"
    return Malformed("precision not stated" if "NOT STATED" in upper or not upper else f"precision {text.strip()[:20]}")


def _recompute(text: str) -> tuple[str, bool] | str:
    """``(checkpointing, selective)`` for a ``recompute`` cell, or the reason it is not expressible. An empty cell
    (``config_match`` partial) is read as no recomputation, both engines' default."""
    low = text.strip().lower()
    if "offload" in low:
        return "activation offload"
    if "block" in low:
        return "block recompute"
    if "selective" in low:
        return "full", True
    if low.startswith("full"):
        return "full", False
    if not low or low.startswith("none") or "no recompute" in low or "null" in low:
        return "none", False
    return "recompute unknown"


def _gpu_kind(text: str) -> str | None:
    """The system a ``gpu`` cell names (:data:`autosplit.gpu_presets.SYSTEMS`): its first word
    (``"H100 (DGX-H100)"`` → ``"H100"``), the 500 W H100 of torchtitan's Grand Teton hosts apart."""
    kind = re.match(r"\s*([A-Za-z]+\d+)", text)
    if kind is None:
        return None
    return kind.group(1).upper() + ("-500W" if re.search(r"\b500\s*W\b", text) else "")


def _blockers(row: dict[str, str]) -> list[str]:
    """What in the row's categorical cells autosplit cannot express today, by name."""
    reasons = []
    task = row["task"].strip().lower()
    if task not in TASKS:
        reasons.append("lora" if task == "lora" else f"task {task or 'unknown'}")
    from autosplit.gpu_presets import SYSTEMS

    kind = _gpu_kind(row["gpu"])
    if kind is None:
        reasons.append("gpu unknown")
    elif kind not in SYSTEMS:
        reasons.append(f"no device preset for {kind}")
    if isinstance(recipe := _float8(row["precision"]), Malformed):
        reasons.append(str(recipe))
    if row["moe_experts"].strip():
        reasons.append("moe")
    if any(not re.fullmatch(r"\d+", row[c].strip()) for c in SHAPE):
        reasons.append("model shape unknown")
    if row["cp"].strip() not in ("", "1"):
        reasons.append("cp")
    if row["ep"].strip() not in ("", "1"):
        reasons.append("ep")
    vp = row["vp"].strip()
    if vp and not re.fullmatch(r"\d+", vp):
        reasons.append("schedule dualpipe" if "dualpipe" in vp.lower() else f"vp {vp[:20]}")
    if isinstance(recompute := _recompute(row["recompute"]), str):
        reasons.append(recompute)
    if not row["micro_batch_size"].strip():
        reasons.append("micro batch unknown")
    return reasons


def _layout(row: dict[str, str]) -> dict[str, Any]:
    """The recipe's degrees and batch from the row's numeric cells; :class:`Malformed` where they disagree."""
    gpus, seq, batch = (_int(row, c) for c in ("num_gpus", "seq_len", "global_batch_size"))
    if gpus is None or seq is None or batch is None:
        raise Malformed("num_gpus, seq_len and global_batch_size are all needed")
    tp, pp, cp = (_int(row, c, 1) or 1 for c in ("tp", "pp", "cp"))
    vp = _int(row, "vp", 1) if re.fullmatch(r"\d*", row["vp"].strip()) else 1
    if gpus % (tp * pp * cp):
        raise Malformed(f"num_gpus {gpus} is not a multiple of TP {tp} · PP {pp} · CP {cp}")
    dp = gpus // (tp * pp * cp)
    if (given := _int(row, "dp")) is not None and given != dp:
        raise Malformed(f"dp {given} given, but num_gpus / (TP·PP·CP) = {dp}")
    micro = _int(row, "micro_batch_size")
    if micro is not None and batch % (micro * dp):
        raise Malformed(f"global batch {batch} is not a multiple of micro batch {micro} · dp {dp}")
    sharded = any(row[c].strip().lower().startswith(("yes", "fsdp", "zero")) for c in ("fsdp", "distributed_optimizer"))
    return dict(num_gpus=gpus, seq_len=seq, global_batch=batch, tp=tp, pp=pp, vp=vp or 1, cp=cp, dp=dp, micro_batch=micro,
                micro_batches=None if micro is None else batch // (micro * dp), replicate="fully_shard" if sharded else "replicate",
                float8=recipe if isinstance(recipe := _float8(row["precision"]), str) else None,
                plan_precision="bf16-fsdp" if sharded else "bf16-mixed", published_tokens_per_s_per_gpu=_published(row))


def classify(row: dict[str, str], line: int) -> Classified:
    """The row's reasons not to cost it (a malformed one says what is wrong), or the spec :func:`cost_row` costs."""
    from autosplit.errors import ConstraintError
    from autosplit.options import refuse_selective_tp

    row_id = row.get("row_id", "").strip() or f"line {line}"
    info = {c: row.get(c, "").strip() for c in ("model", "model_canonical", "gpu", "precision", "layout_group", "recompute")}
    out = Classified(row_id, info)
    out.reasons = _blockers(row)
    if missing := [c for c in ("num_gpus", "seq_len", "global_batch_size") if not row[c].strip()]:
        out.reasons += [f"{c} unknown" for c in missing]
        return out
    try:
        layout = _layout(row)
    except Malformed as e:
        out.reasons.insert(0, "malformed")
        out.message = str(e)
        return out
    info.update({k: v for k, v in layout.items() if k != "micro_batches"})
    recompute = _recompute(row["recompute"])
    if isinstance(recompute, tuple) and recompute[1]:
        try:  # the planner's own rule, asked without costing
            refuse_selective_tp(layout["tp"], True)
        except ConstraintError:
            out.reasons.append("selective recompute under tp")
    if out.reasons or not isinstance(recompute, tuple):
        return out
    vp = layout["vp"]
    out.spec = {**layout, "row_id": row_id, "shape": {c: int(row[c]) for c in SHAPE},
                "gpu": _gpu_kind(row["gpu"]), "engine": _engine(row), "checkpointing": recompute[0], "selective": recompute[1],
                "schedule": "interleaved1f1b" if vp > 1 else "1f1b" if layout["pp"] > 1 else "gpipe",
                "torchtitan_split": "torchtitan" in (row.get("repo", "") + row.get("source", "")).lower()}
    return out


def _model(shape: dict[str, int], seq: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=shape["hidden_size"], intermediate_size=shape["ffn_hidden_size"],
                         num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_attention_heads"],
                         num_key_value_heads=shape["num_kv_heads"], vocab_size=shape["vocab_size"], max_position_embeddings=seq)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _fullest(plan: Any) -> tuple[float, float]:
    """(bytes, capacity) of the fullest device: a rank's stages together where it runs several (as plan_3d counts them)."""
    held = ([(m, plan.stages[plan.stage_devices.index(r)].capacity) for r, m in enumerate(plan.rank_memory)]
            if plan.stages_per_rank > 1 else [(st.memory, st.capacity) for st in plan.stages])
    return max(held, key=lambda mc: mc[0] / mc[1])


def _engine(row: dict[str, str]) -> str:
    """The engine profile (:mod:`autosplit.engine_profiles`) of the stack a row ran on: torchtitan's runs
    compiled or eager as their ``other_config`` says, every other source's Megatron-Core with Transformer Engine."""
    if "torchtitan" not in (row.get("repo", "") + row.get("source", "")).lower():
        return "megatron-te"
    return "torch-compile" if re.search(r"(torch\.)?compile\s*=\s*yes", row.get("other_config", "").lower()) else "torch-eager"


def _regrid(planner: Any, recipe: Any, grid: Sequence[tuple[float, float]], tokens: int, gpus: int) -> dict[str, float]:
    """Predicted tokens/s/GPU of ``recipe`` with the devices' (GEMM, memory) efficiencies at each point of
    ``grid`` (the capture reused): what ``--grid`` fits the engine profiles from, keyed ``"gemm:memory"``."""
    import copy
    import dataclasses

    out = {}
    for gemm, memory in grid:
        other = copy.copy(planner)
        other.devices = tuple(dataclasses.replace(d, efficiency=gemm, memory_efficiency=memory) for d in planner.devices)
        out[f"{gemm:g}:{memory:g}"] = tokens / (other.manual(recipe, check_memory=False).step_time * gpus)
    return out


def cost_row(spec: dict[str, Any], grid: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """One expressible row costed in this process (call it in a fresh one: its peak RSS is its own); with
    ``grid``, also at each GEMM efficiency there (:func:`_regrid`)."""
    import torch

    import autosplit
    from autosplit.compiler.manual import execution_order, torchtitan_fqns

    start = time.perf_counter()
    model = _model(spec["shape"], spec["seq_len"])
    gpus, tokens = spec["num_gpus"], spec["global_batch"] * spec["seq_len"]
    devices = autosplit.Cluster.of(spec["gpu"], gpus, engine=spec["engine"])
    row: dict[str, Any] = {}
    planning = time.perf_counter()
    try:
        planner = autosplit.Planner(model, devices, example_inputs=(autosplit.Spec((spec["global_batch"], spec["seq_len"]), torch.long),),
                                    precision=spec["plan_precision"])
        stages, layers = spec["pp"] * spec["vp"], spec["shape"]["num_layers"]
        # torchtitan weighs the embedding and the head as a layer each; Megatron none, unless the layers do not fill
        # the stages evenly: then its account_for_{embedding,loss}_in_pipeline_split (405B: 126 layers + 2 in 32/64/128)
        weight = int(spec["torchtitan_split"] or layers % stages != 0)
        split = None if stages == 1 else torchtitan_fqns(model, stages, repeated="model.layers", input_weight=weight,
                                                         output_weight=weight, order=execution_order(planner.traced))
        options: dict[str, Any] = {"precision": spec["plan_precision"], "float8": spec["float8"], "checkpointing": spec["checkpointing"],
                                   "selective": spec["selective"], "micro_batches": spec["micro_batches"], "schedule": spec["schedule"],
                                   "sequence_parallel": spec["tp"] > 1}
        if spec["vp"] > 1:
            options["stages_per_rank"] = spec["vp"]
        recipe = autosplit.Recipe(split, data_parallel=spec["dp"], replicate=spec["replicate"], tensor_parallel=spec["tp"],
                                  options=options)
        plan = planner.manual(recipe, check_memory=False)
        memory, capacity = _fullest(plan)
        row.update(outcome="costed", step_s=plan.step_time, predicted_tokens_per_s_per_gpu=tokens / (plan.step_time * gpus),
                   mesh=plan.mesh, schedule=plan.schedule, stages_per_rank=plan.stages_per_rank, micro_batches=plan.micro_batches,
                   memory_gib=memory / 2**30, capacity_gib=capacity / 2**30, fits=memory <= capacity,
                   recomputed_blocks=len(plan.recompute), selective=plan.recompute_selective, device=plan.devices[0].name)
        if grid:
            row["grid"] = _regrid(planner, recipe, grid, tokens, gpus)
    except autosplit.AutosplitError as e:
        first = str(e).split(". Likely cause")[0].splitlines()[0]
        row.update(outcome=type(e).__name__, reason=f"{type(e).__name__}: {first[:300]}")
    row["plan_s"] = time.perf_counter() - planning
    row["total_s"] = time.perf_counter() - start
    row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return row


def read_csv(path: Path, ids: set[str] | None) -> list[Classified]:
    """Every row of ``path`` (only ``ids`` where given), classified; a CSV without the columns is refused whole."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise SystemExit(f"{path}: missing column(s) {', '.join(missing)} (see ../shared/published/README.md)")
        rows = [(line, row) for line, row in enumerate(reader, start=2) if ids is None or row["row_id"].strip() in ids]
    out = []
    for line, row in rows:
        if None in row or any(v is None for v in row.values()):  # more or fewer cells than the header names
            out.append(Classified((row.get("row_id") or "").strip() or f"line {line}", {}, ["malformed"],
                                  f"line {line} has {'more' if None in row else 'fewer'} cells than the header"))
            continue
        out.append(classify(row, line))
    for c in out:
        if "malformed" in c.reasons:
            print(f"row {c.row_id}: malformed: {c.message}", file=sys.stderr)
    if ids is not None and (unknown := ids - {c.row_id for c in out}):
        print(f"no row with id {', '.join(sorted(unknown))}", file=sys.stderr)
    return out


def _result(c: Classified, costed: dict[str, Any] | None) -> dict[str, Any]:
    """A row of the JSON: the row's cells read, then its reason or its costed figures."""
    row: dict[str, Any] = {"row_id": c.row_id, **c.info}
    if costed is None:
        row.update(outcome="malformed" if "malformed" in c.reasons else "not expressible", reason=c.reasons[0],
                   reasons=c.reasons, **({"message": c.message} if c.message else {}))
        return row
    row.update(costed)
    published = c.info.get("published_tokens_per_s_per_gpu")
    if row.get("predicted_tokens_per_s_per_gpu") is not None and published:
        row["ratio"] = row["predicted_tokens_per_s_per_gpu"] / published
    if row["outcome"] in ("crashed", "timed out"):
        row["reason"] = f"{row['outcome']}: {row.get('stderr', '').strip().splitlines()[-1:] or ''}"
    return row


def run(classified: Sequence[Classified], budget: float, jobs: int = 1, grid: Sequence[tuple[float, float]] = ()) -> list[dict[str, Any]]:
    """Each expressible row costed in a fresh process, ``jobs`` at a time; every row's result, printed as it comes."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.fresh import in_fresh_process

    print(f"{'id':>5} {'model':<18} {'GPUs':>5} {'layout':<30} {'predicted':>9} {'published':>9} {'ratio':>6} "
          f"{'memory GiB':>12} {'plan s':>6}  outcome")

    def one(c: Classified) -> dict[str, Any]:
        costed = None if c.spec is None else in_fresh_process("benchmarks.published:cost_row", c.spec, list(grid), timeout=budget)
        result = _result(c, costed)
        print(_line(result), flush=True)
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, classified))


def _line(r: dict[str, Any]) -> str:
    def num(key: str, form: str) -> str:
        return format(r[key], form) if isinstance(r.get(key), (int, float)) else "-"

    layout = (f"TP{r['tp']} PP{r['pp']} VP{r['vp']} DP{r['dp']} {'FSDP' if r['replicate'] == 'fully_shard' else 'DDP'}"
              if "tp" in r else "")
    memory = f"{r['memory_gib']:5.1f}/{r['capacity_gib']:.0f}" if "memory_gib" in r else "-"
    outcome = {"costed": "costed", "malformed": f"malformed: {r.get('message', '')}",
               "not expressible": f"not expressible: {'; '.join(r.get('reasons', []))}"}.get(r["outcome"], r.get("reason", r["outcome"]))
    model = (r.get("model_canonical") or r.get("model") or "")[:18]
    return (f"{r['row_id']:>5} {model:<18} {num('num_gpus', 'd'):>5} {layout:<30} {num('predicted_tokens_per_s_per_gpu', ',.0f'):>9} "
            f"{num('published_tokens_per_s_per_gpu', ',.0f'):>9} {num('ratio', '.2f'):>6} {memory:>12} {num('plan_s', '.1f'):>6}  "
            f"{outcome[:160]}")


def dry_run(classified: Sequence[Classified]) -> dict[str, Any]:
    """Counts per reason (a row under each reason it has, and under its first), nothing costed."""
    every = Counter(r for c in classified for r in c.reasons)
    first = Counter(c.reasons[0] for c in classified if c.reasons)
    expressible = [c.row_id for c in classified if c.spec is not None]
    print(f"{len(classified)} rows: {len(expressible)} expressible ({', '.join(expressible) or 'none'})")
    print(f"{'rows with it':>12} {'as first':>8}  reason")
    for reason, n in every.most_common():
        print(f"{n:12d} {first.get(reason, 0):8d}  {reason}")
    return {"rows": len(classified), "expressible": expressible, "reasons": dict(every.most_common()),
            "first_reasons": dict(first.most_common()),
            "malformed": {c.row_id: c.message for c in classified if "malformed" in c.reasons}}


def _grid(text: str) -> list[tuple[float, float]]:
    """``"0.4,0.5x0.6,0.8"`` → every (GEMM, memory) pair of the two lists; ``""``: none."""
    if not text.strip():
        return []
    gemms, _, memories = text.partition("x")
    return [(float(g), float(m)) for g in gemms.split(",") for m in (memories or "0.6").split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="runs in the columns of ../shared/published/runs.csv")
    parser.add_argument("--ids", default=None, help="comma-separated row_ids to cost (default: every row)")
    parser.add_argument("--out", type=Path, default=None, help="JSON (default benchmarks/results/published.json; --dry-run: none)")
    parser.add_argument("--budget", type=float, default=900.0, help="seconds a row may take before it is killed")
    parser.add_argument("--dry-run", action="store_true", help="only classify the rows and count the reasons")
    parser.add_argument("--jobs", type=int, default=1, help="rows costed at once, each in its own process")
    parser.add_argument("--grid", default="", help="GEMM × memory efficiencies to cost every row at too, to fit the engine profiles: "
                        "'0.4,0.5,0.6x0.6,0.8'")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if not args.csv.is_file():
        raise SystemExit(f"no CSV at {args.csv}")
    ids = None if args.ids is None else {i.strip() for i in args.ids.split(",") if i.strip()}
    classified = read_csv(args.csv, ids)
    from benchmarks.plan_time import machine

    if args.dry_run:
        report: dict[str, Any] = {"benchmark": "published", "dry_run": True, "csv": str(args.csv), "summary": dry_run(classified)}
    else:
        print("simulated: device presets, the cost model's figures (not measured)")
        results = run(classified, args.budget, args.jobs, _grid(args.grid))
        from benchmarks.published_summary import print_summary, summarize

        summary = summarize(results)
        print_summary(summary)
        report = {"benchmark": "published", "simulated": True, "csv": str(args.csv), "machine": machine(), "summary": summary,
                  "rows": results}
    out = args.out or (None if args.dry_run else ROOT / "benchmarks" / "results" / "published.json")
    if out is not None:
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
