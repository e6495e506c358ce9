"""The rows of the published record as ``benchmarks/published.py`` reads them: each classified as a recipe to
cost (:class:`Classified` with a ``spec``) or named by what autosplit cannot express yet; a malformed row
says what is wrong with it, and the others are read on.
"""

from __future__ import annotations

import csv
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Classified", "Malformed", "REQUIRED", "SHAPE", "classify", "read_csv"]

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
    (``config_match`` partial) is read as no recomputation, both engines' default; where that layout is predicted not
    to fit, the row's memory levers are unknown (:func:`benchmarks.published.cost_row`)."""
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


def _recompute_cell(row: dict[str, str]) -> str:
    """The row's ``recompute`` cell, or where it is silent, its recipe's: NeMo AutoModel's mixture-of-experts benchmark
    configs (``examples/benchmark/configs/{qwen3_moe_30b,deepseek_v3,kimi_k2,...}_te_deepep*.yaml``) all set
    ``activation_checkpointing: true``, each decoder layer recomputed whole."""
    cell = row["recompute"].strip()
    if not cell and row["moe_experts"].strip() and "automodel" in (row.get("repo", "") + row.get("source", "")).lower():
        return "full (AutoModel's MoE benchmark configs)"
    return cell


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
    shape = _shape(row)
    if row["moe_experts"].strip() and (shape is None or "canonical" not in shape):
        reasons.append("moe")
    if shape is None:
        reasons.append("model shape unknown")
    vp = row["vp"].strip()
    if vp and not re.fullmatch(r"\d+", vp):
        reasons.append("schedule dualpipe" if "dualpipe" in vp.lower() else f"vp {vp[:20]}")
    if isinstance(recompute := _recompute(_recompute_cell(row)), str):
        reasons.append(recompute)
    if not row["micro_batch_size"].strip() and not _is_torchtitan(row):  # torchtitan's default: _torchtitan_micro
        reasons.append("micro batch unknown")
    return reasons


def _shape(row: dict[str, str]) -> dict[str, Any] | None:
    """The model's shape and family: the row's own cells where it gives them all, else the shape its
    ``model_canonical`` was published with (:data:`benchmarks.published_models.PUBLISHED`); ``None``: unknown."""
    from benchmarks.published_models import family, published_shape

    canonical = row.get("model_canonical", "") or row["model"]
    if row["moe_experts"].strip():  # a mixture: its published configuration whole, where the record knows it
        return None if (shape := published_shape(canonical)) is None else {**shape, "shape_from": "published shapes"}
    if all(re.fullmatch(r"\d+", row[c].strip()) for c in SHAPE):
        return {**{c: int(row[c]) for c in SHAPE}, "family": family(canonical), "shape_from": "row"}
    shape = published_shape(canonical)
    return None if shape is None else {**shape, "shape_from": "published shapes"}


def _default_seq(row: dict[str, str]) -> int | None:
    """The sequence length of a row that does not print one: 8192 for torchtitan's tables, from its train configs
    (the record's README); else none."""
    return 8192 if _is_torchtitan(row) else None


def _layout(row: dict[str, str]) -> dict[str, Any]:
    """The recipe's degrees and batch from the row's numeric cells; :class:`Malformed` where they disagree."""
    gpus, seq, batch = (_int(row, c) for c in ("num_gpus", "seq_len", "global_batch_size"))
    seq = seq or _default_seq(row)
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
    if micro is None and _is_torchtitan(row):
        micro = _torchtitan_micro(batch, dp, pp * (vp or 1))
    if micro is not None and batch % (micro * dp):
        raise Malformed(f"global batch {batch} is not a multiple of micro batch {micro} · dp {dp}")
    sharded = _sharded(row)
    return dict(num_gpus=gpus, seq_len=seq, global_batch=batch, tp=tp, pp=pp, vp=vp or 1, cp=cp, dp=dp, ep=_int(row, "ep", 1) or 1,
                micro_batch=micro,
                micro_batches=None if micro is None else batch // (micro * dp), replicate="fully_shard" if sharded else "replicate",
                float8=recipe if isinstance(recipe := _float8(row["precision"]), str) else None,
                plan_precision="bf16-fsdp" if sharded else "bf16-mixed", published_tokens_per_s_per_gpu=_published(row))


def classify(row: dict[str, str], line: int) -> Classified:
    """The row's reasons not to cost it (a malformed one says what is wrong), or the spec :func:`cost_row` costs."""
    row_id = row.get("row_id", "").strip() or f"line {line}"
    cells = ("model", "model_canonical", "gpu", "precision", "layout_group", "recompute")
    info: dict[str, Any] = {c: row.get(c, "").strip() for c in cells}
    from benchmarks.published_models import MOE

    # a mixture of experts by its row's expert count, or by its name where the row leaves the count out (Kimi K2)
    info["experts"] = bool(row["moe_experts"].strip()) or info["model_canonical"] in MOE
    out = Classified(row_id, info)
    out.reasons = _blockers(row)
    if info["experts"] and not row["ep"].strip():  # AutoModel's GPT-OSS rows: its expert layout is not in the row
        out.reasons.append("ep unknown")
    given = {c: row[c].strip() or (c == "seq_len" and _default_seq(row)) for c in ("num_gpus", "seq_len", "global_batch_size")}
    if missing := [c for c, value in given.items() if not value]:
        out.reasons += [f"{c} unknown" for c in missing]
        return out
    try:
        layout = _layout(row)
    except Malformed as e:
        out.reasons.insert(0, "malformed")
        out.message = str(e)
        return out
    info.update({k: v for k, v in layout.items() if k != "micro_batches"})
    recompute = _recompute(_recompute_cell(row))
    if out.reasons or not isinstance(recompute, tuple):
        return out
    vp = layout["vp"]
    out.spec = {**layout, "row_id": row_id, "shape": _shape(row),
                "gpu": _gpu_kind(row["gpu"]), "engine": _engine(row), "async_tp": _async_tp(row, layout["tp"]),
                "ep_overlap": layout["ep"] > 1 and bool(re.search(r"moe_a2a_overlap\s*=\s*true", row.get("other_config", "").lower())),
                "checkpointing": recompute[0], "selective": recompute[1],
                "schedule": "interleaved1f1b" if vp > 1 else "1f1b" if layout["pp"] > 1 or (layout["micro_batches"] or 1) > 1 else "gpipe",
                "torchtitan_split": _is_torchtitan(row), "recompute_stated": bool(_recompute_cell(row))}
    info["shape_from"] = out.spec["shape"]["shape_from"]
    return out


def _torchtitan_micro(batch: int, dp: int, stages: int) -> int:
    """torchtitan's micro batch where its row leaves it out: each copy's batch split into as many micro-batches as
    the pipeline has stages (its config manager at the record's releases, ``--experimental.pipeline_parallel_microbatches``:
    "The default value will be the number of pipeline stages, if unspecified"); unpipelined, the copy's batch whole."""
    local, rest = divmod(batch, dp)
    if rest or local % stages:
        raise Malformed(f"global batch {batch} over dp {dp} does not split into torchtitan's default {stages} micro-batches "
                        "(one per pipeline stage) and the row gives no micro batch")
    return local // stages


def _is_torchtitan(row: dict[str, str]) -> bool:
    """Whether torchtitan published the row (its repository or source says so)."""
    return "torchtitan" in (row.get("repo", "") + row.get("source", "")).lower()


def _sharded(row: dict[str, str]) -> bool:
    """Whether a row's data parallelism shards its state: where its cells say so (FSDP, ZeRO, the distributed
    optimizer), and on Megatron-Core where they are silent and do not say no: Megatron-Bridge's and NeMo 2.0's
    recipes and Megatron-LM's example scripts all set ``use_distributed_optimizer``."""
    if any(row[c].strip().lower().startswith(("yes", "fsdp", "zero")) for c in ("fsdp", "distributed_optimizer")):
        return True
    return _engine(row).startswith("megatron") and not row["distributed_optimizer"].strip().lower().startswith("no")


def _engine(row: dict[str, str]) -> str:
    """The engine profile (:mod:`autosplit.engine_profiles`) of the stack a row ran on: torchtitan's runs
    compiled or eager as their ``other_config`` says, every other source's Megatron-Core with Transformer Engine,
    sharded by Megatron-FSDP where the row's ``fsdp`` cell says yes, else by its distributed optimizer."""
    if not _is_torchtitan(row):
        return "megatron-fsdp" if row["fsdp"].strip().lower().startswith("yes") else "megatron-te"
    return "torch-compile" if re.search(r"(torch\.)?compile\s*=\s*yes", row.get("other_config", "").lower()) else "torch-eager"


def _async_tp(row: dict[str, str], tp: int) -> bool:
    """Whether a row's tensor-parallel collectives overlap its GEMMs: torchtitan's where its ``other_config`` says
    async TP; Megatron-Core's under tensor parallelism (Megatron-Bridge's performance recipes set
    ``tp_comm_overlap`` wherever TP > 1)."""
    if tp <= 1:
        return False
    if not _engine(row).startswith("megatron"):
        return bool(re.search(r"async\s*tp\s*=\s*yes", row.get("other_config", "").lower()))
    return True


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


