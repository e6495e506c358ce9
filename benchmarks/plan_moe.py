"""autosplit's own plans of the published mixtures of experts, every degree chosen, beside the published layouts (simulated).

Three settings of issue 65, each on the meta device with the published GPUs' presets and fitted engine profiles:

- DeepSeek-V3 on 1,024 H100s: NeMo AutoModel's BF16 run (row 398 of ``../shared/published/runs.csv``: PP 4 × VP 8 ×
  EP 64 over FSDP 256, 8,192 sequences of 4,096, every layer recomputed);
- DeepSeek-V3 on 256 H100s: the same recipe at 512 sequences (PP 4 × VP 8 × EP 64 over FSDP 64, 1,002 tokens/s/GPU;
  NeMo AutoModel's ``docs/performance-summary.md``, the row beside 398's, ``examples/benchmark/configs/
  deepseek_v3_te_deepep.yaml``), not in the shared file;
- Qwen3-235B-A22B on 256 H100s: the best of Megatron-Bridge's FP8 rows (TP 2 × PP 8 × VP 4 × EP 32).

Each published layout is costed as ``benchmarks/published.py`` costs it, and autosplit plans the same model, cluster,
global batch, precision and stack with ``tensor_parallel``, ``data_parallel``, ``replicate``, ``expert_parallel``,
the split, the micro-batches and the recomputation all ``"auto"`` (1F1B), in a fresh process each (its planning
seconds and peak RSS its own). Both figures are the same cost model's, whose MoE terms are not yet held to the record
(``docs/experts.md``): the ratio says whether autosplit's plan is ahead by that model, not on a cluster. Prints a table
and writes ``benchmarks/results/plan_moe.json``.

Usage::

    .venv/bin/python benchmarks/plan_moe.py                 # about 10 minutes
    .venv/bin/python benchmarks/plan_moe.py --settings deepseek-v3-1024
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.published import DEFAULT_CSV  # noqa: E402  (run as a script: the root first)
from benchmarks.published_rows import read_csv  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "plan_moe.json"


def settings(csv: Path) -> dict[str, dict[str, Any]]:
    """The three settings' published layouts as ``benchmarks/published.py`` specs (the module docstring)."""
    rows = {c.row_id: c for c in read_csv(csv, {"398", "133", "177", "215", "275"})}
    big = rows["398"].spec
    assert big is not None
    qwens = [spec for i in ("133", "177", "215", "275") if (spec := rows[i].spec) is not None]
    qwen = max(qwens, key=lambda s: s["published_tokens_per_s_per_gpu"])
    small = {**big, "row_id": "AutoModel 256", "num_gpus": 256, "global_batch": 512, "dp": 64,
             "published_tokens_per_s_per_gpu": 1002.0}
    small["micro_batches"] = small["global_batch"] // (small["micro_batch"] * small["dp"])
    return {"deepseek-v3-1024": big, "deepseek-v3-256": small, "qwen3-235b-a22b-256": qwen}


def plan_auto(spec: dict[str, Any], time_limit: float, axes: tuple[str, ...] = ("expert_parallel",)) -> dict[str, Any]:
    """autosplit's plan of the spec's model, cluster and batch with every degree ``"auto"`` (in this process): tp, the
    data-parallel degree and layout, the micro-batches, the recomputation and the ``axes`` named beside them."""
    import resource
    import time

    import torch

    import autosplit
    from benchmarks.published_models import build

    start = time.perf_counter()
    gpus, tokens = spec["num_gpus"], spec["global_batch"] * spec["seq_len"]
    row: dict[str, Any] = {}
    chosen: dict[str, Any] = dict.fromkeys(axes, "auto")
    try:
        planner = autosplit.Planner(
            build(spec["shape"], spec["seq_len"]), autosplit.Cluster.of(spec["gpu"], gpus, engine=spec["engine"]),
            example_inputs=(autosplit.Spec((spec["global_batch"], spec["seq_len"]), torch.long),), precision=spec["plan_precision"],
            checkpointing="auto", selective="auto", float8=spec["float8"], async_tp=spec.get("async_tp", False), time_limit=time_limit,
            schedule="1f1b", micro_batches="auto", tensor_parallel="auto", data_parallel="auto", replicate="auto",
            **chosen)
        plan = planner.plan()
        row.update(outcome="planned", mesh=plan.mesh, expert_parallel=plan.expert_parallel, micro_batches=plan.micro_batches,
                   step_s=plan.step_time, gap=plan.step_gap, tokens_per_s_per_gpu=tokens / (plan.step_time * gpus),
                   recomputed_blocks=len(plan.recompute), configurations=len(plan.alternatives))
    except autosplit.AutosplitError as e:
        row.update(outcome=type(e).__name__, message=str(e).split(". Likely cause")[0][:500])
    row["plan_s"] = time.perf_counter() - start
    row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return row


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, RESULTS, argv)
    chosen = settings(args.csv)
    print("simulated: the published GPUs' presets with the fitted engine profiles; the MoE terms are not held to the record")
    compare(chosen, args, "plan_moe", ("expert_parallel",))
    return 0


def arguments(doc: str, results: Path, argv: list[str] | None, longer: float | None = None) -> argparse.Namespace:
    """The command line this benchmark and ``benchmarks/plan_long.py`` share (``longer``: the default of ``--longer``,
    the time limit a setting is planned again under, where the benchmark has one)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--settings", default=None, help="comma-separated settings (default: all)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="the mesh search's and solver's limit")
    parser.add_argument("--budget", type=float, default=900.0, help="seconds a process may take before it is killed")
    parser.add_argument("--out", type=Path, default=results)
    if longer is not None:
        parser.add_argument("--longer", type=float, default=longer, help="the time limit the named setting is planned again under")
    return parser.parse_args(argv)


def compare(chosen: dict[str, dict[str, Any]], args: argparse.Namespace, benchmark: str, axes: tuple[str, ...],
            longer: dict[str, float] | None = None) -> list[dict]:
    """Each setting's published layout costed, and autosplit's plan of it with ``axes`` also ``"auto"``, each in a fresh
    process; a setting named in ``longer`` planned again under that time limit (``autosplit_longer``): what the search
    finds given the time. Prints a line per setting and writes ``args.out`` after each."""
    from benchmarks.fresh import in_fresh_process
    from benchmarks.plan_time import machine

    if args.settings:
        chosen = {k: v for k, v in chosen.items() if k in args.settings.split(",")}
    rows, longer = [], longer or {}
    for name, spec in chosen.items():
        layout = in_fresh_process("benchmarks.published:cost_row", spec, [], timeout=args.budget)
        ours = in_fresh_process("benchmarks.plan_moe:plan_auto", spec, args.time_limit, axes, timeout=args.budget)
        row = {"setting": name, "row_id": spec["row_id"], "published": spec["published_tokens_per_s_per_gpu"],
               "layout": {k: spec[k] for k in ("tp", "pp", "vp", "cp", "ep", "dp", "replicate", "micro_batches")},
               "layout_predicted": layout.get("predicted_tokens_per_s_per_gpu"), "layout_memory_gib": layout.get("memory_gib"),
               "autosplit": ours}
        if row["layout_predicted"] and ours.get("outcome") == "planned":
            row["autosplit_over_layout"] = ours["tokens_per_s_per_gpu"] / row["layout_predicted"]
        if name in longer:
            again = in_fresh_process("benchmarks.plan_moe:plan_auto", spec, longer[name], axes, timeout=args.budget)
            if row["layout_predicted"] and again.get("outcome") == "planned":
                again["over_layout"] = again["tokens_per_s_per_gpu"] / row["layout_predicted"]
            row["autosplit_longer"] = {"time_limit": longer[name], **again}
        rows.append(row)
        args.out.write_text(json.dumps({"benchmark": benchmark, "simulated": True, "machine": machine(), "rows": rows}, indent=1))
        print(_line(row), flush=True)
        if "autosplit_longer" in row:
            tail = _line({**row, "autosplit": row["autosplit_longer"]}).split("  autosplit")[-1]
            print(f"{'':20} given {row['autosplit_longer']['time_limit']:g} s:{tail}")
    print(f"wrote {args.out}")
    return rows


def _line(r: dict[str, Any]) -> str:
    ours, lay = r["autosplit"], r["layout"]
    published = "-" if r["published"] is None else f"{r['published']:,.0f}"
    head = (f"{r['setting']:<20} published TP{lay['tp']} PP{lay['pp']} VP{lay['vp']} CP{lay['cp']} EP{lay['ep']} DP{lay['dp']}: "
            f"{published} (predicted {r['layout_predicted'] or 0:,.0f})")
    if ours.get("outcome") != "planned":
        seconds = ours.get("plan_s", ours.get("total_s", 0))
        return f"{head}  autosplit: {ours.get('outcome')}: {ours.get('message', '')[:300]} ({seconds:.0f} s)"
    mesh = " × ".join(f"{k} {v}" for k, v in ours["mesh"].items() if v > 1)
    return (f"{head}  autosplit {mesh} (ep {ours['expert_parallel']}), {ours['micro_batches']} µb: {ours['tokens_per_s_per_gpu']:,.0f}"
            f"  {ours['tokens_per_s_per_gpu'] / (r['layout_predicted'] or math.nan):.2f}×, "
            f"gap {'-' if ours['gap'] is None else format(ours['gap'], '.1%')}, "
            f"in {ours['plan_s']:.0f} s, "
            f"{ours['peak_rss_gb']:.1f} GB")


if __name__ == "__main__":
    raise SystemExit(main())
