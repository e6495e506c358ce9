"""autosplit's own plan beside each layout group of the published record (simulated).

A layout group (``layout_group`` ``Sxx`` in ``../shared/published/runs.csv``) holds the runs of one model, GPU
kind and count, source and release that differ only in layout. For each group with an expressible row, the best
published layout (the highest published tokens/s/GPU among its expressible rows) is costed as
``benchmarks/published.py`` costs it, and beside it autosplit plans the same model, cluster and global batch on
the same stack — the engine profile, the precision, the row's FP8 scaling and its TP overlap — with every degree,
the split, the micro-batches and the recomputation chosen (``tensor_parallel="auto"``, ``micro_batches="auto"``,
``checkpointing="auto"``, ``selective="auto"``, 1F1B). Both are the same calibrated model's figures; the ratio says
whether autosplit's plan is ahead of the best published layout by that model, not on the cluster. Each plan runs
in a fresh process (:mod:`benchmarks.fresh`); prints a table and writes ``benchmarks/results/published_groups.json``.

Usage::

    .venv/bin/python benchmarks/published_groups.py                  # every S group of the shared record
    .venv/bin/python benchmarks/published_groups.py --csv my_runs.csv --groups S03 --out /tmp/groups.json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.published import DEFAULT_CSV  # noqa: E402  (run as a script: the root first)
from benchmarks.published_rows import Classified, read_csv  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "published_groups.json"


def best_rows(classified: list[Classified], groups: set[str] | None = None) -> dict[str, Classified]:
    """Per ``S`` group: its expressible row with the highest published tokens/s/GPU (groups without one left out)."""
    best: dict[str, Classified] = {}
    for c in classified:
        group = c.info.get("layout_group", "")
        published = (c.spec or {}).get("published_tokens_per_s_per_gpu")
        if not group.startswith("S") or c.spec is None or not published or (groups and group not in groups):
            continue
        if group not in best or published > best[group].spec["published_tokens_per_s_per_gpu"]:  # type: ignore[index]
            best[group] = c
    return dict(sorted(best.items()))


def plan_like(spec: dict[str, Any], time_limit: float) -> dict[str, Any]:
    """autosplit's plan of the row's model, cluster and global batch on its stack, every degree chosen (in this process)."""
    import torch

    import autosplit
    from benchmarks.published_models import build

    start = time.perf_counter()
    gpus, tokens = spec["num_gpus"], spec["global_batch"] * spec["seq_len"]
    model = build(spec["shape"], spec["seq_len"])
    row: dict[str, Any] = {}
    try:
        planner = autosplit.Planner(
            model, autosplit.Cluster.of(spec["gpu"], gpus, engine=spec["engine"]),
            example_inputs=(autosplit.Spec((spec["global_batch"], spec["seq_len"]), torch.long),), precision=spec["plan_precision"],
            checkpointing="auto", selective="auto", float8=spec["float8"], async_tp=spec.get("async_tp", False),
            time_limit=time_limit)
        plan = planner.with_options(schedule="1f1b", micro_batches="auto", tensor_parallel="auto").plan()
        row.update(outcome="planned", mesh=plan.mesh, micro_batches=plan.micro_batches, step_s=plan.step_time, gap=plan.step_gap,
                   tokens_per_s_per_gpu=tokens / (plan.step_time * gpus), recomputed_blocks=len(plan.recompute),
                   selective=plan.recompute_selective, float8_linears=len(plan.float8_linears))
    except autosplit.AutosplitError as e:
        row.update(outcome=type(e).__name__, message=str(e).split(". Likely cause")[0][:500])
    row["plan_s"] = time.perf_counter() - start
    row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return row


def compare_group(group: str, c: Classified, time_limit: float, budget: float) -> dict[str, Any]:
    """The group's best published row costed, autosplit's plan beside it, and their ratio by the same model."""
    from benchmarks.fresh import in_fresh_process

    spec = c.spec
    assert spec is not None
    published = in_fresh_process("benchmarks.published:cost_row", spec, [], timeout=budget)
    ours = in_fresh_process("benchmarks.published_groups:plan_like", spec, time_limit, timeout=budget)
    out: dict[str, Any] = {"group": group, "row_id": c.row_id, "model": c.info.get("model_canonical") or c.info.get("model"),
                           "gpu": spec["gpu"], "num_gpus": spec["num_gpus"], "published": spec["published_tokens_per_s_per_gpu"],
                           "layout": {k: spec[k] for k in ("tp", "pp", "vp", "dp", "replicate", "micro_batches")},
                           "layout_predicted": published.get("predicted_tokens_per_s_per_gpu"), "autosplit": ours}
    if published.get("predicted_tokens_per_s_per_gpu") and ours.get("outcome") == "planned":
        out["autosplit_over_layout"] = ours["tokens_per_s_per_gpu"] / published["predicted_tokens_per_s_per_gpu"]
    return out


def _line(r: dict[str, Any]) -> str:
    ours = r["autosplit"]
    if ours.get("outcome") != "planned":
        return f"{r['group']:>4} row {r['row_id']:>4} {r['model']:<14} autosplit: {ours.get('outcome')}: {ours.get('message', '')[:200]}"
    mesh = " × ".join(f"{k} {v}" for k, v in ours["mesh"].items() if v > 1) or "one device"
    layout = r["layout"]
    return (f"{r['group']:>4} row {r['row_id']:>4} {r['model']:<14} {r['num_gpus']:>4} {r['gpu']:<10} published TP{layout['tp']} "
            f"PP{layout['pp']} VP{layout['vp']} DP{layout['dp']}: {r['published']:,.0f} (predicted {r['layout_predicted'] or 0:,.0f})  "
            f"autosplit {mesh}, {ours['micro_batches']} µb: {ours['tokens_per_s_per_gpu']:,.0f}  "
            f"{r.get('autosplit_over_layout', float('nan')):.2f}×  in {ours['plan_s']:.0f} s, {ours['peak_rss_gb']:.1f} GB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="runs in the columns of ../shared/published/runs.csv")
    parser.add_argument("--groups", default=None, help="comma-separated layout groups (default: every S group)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver limit per configuration")
    parser.add_argument("--budget", type=float, default=900.0, help="seconds a plan may take before it is killed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    groups = None if args.groups is None else {g.strip() for g in args.groups.split(",") if g.strip()}
    best = best_rows(read_csv(args.csv, None), groups)
    print("simulated: the published GPUs' presets with the fitted engine profiles (the cost model's figures, not measured)")
    rows = []
    for group, c in best.items():
        rows.append(compare_group(group, c, args.time_limit, args.budget))
        print(_line(rows[-1]), flush=True)
    ratios = [r["autosplit_over_layout"] for r in rows if "autosplit_over_layout" in r]
    summary = {"groups": len(rows), "compared": len(ratios), "at_least_1": sum(x >= 1.0 for x in ratios),
               "min_ratio": min(ratios, default=None)}
    print(f"{summary['at_least_1']} of {summary['compared']} groups: autosplit ≥ 1.0× the best published layout (same model)")
    from benchmarks.plan_time import machine

    args.out.write_text(json.dumps({"benchmark": "published_groups", "simulated": True, "csv": str(args.csv), "machine": machine(),
                                    "summary": summary, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
