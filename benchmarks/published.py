"""Published training runs, each costed as an ``autosplit.Recipe`` on its published cluster (simulated).

Reads a CSV with the columns of ``../shared/published/runs.csv`` (see its README) and, for every row it can
express (:mod:`benchmarks.published_rows`), builds the model on the meta device from the shape the CSV gives
(layers, hidden size, heads, KV heads, FFN width, vocabulary), or the one a model it names was published with
(:mod:`benchmarks.published_models`: Llama 2, NeMo's GPT-3 and Nemotron), writes the
published layout as a ``Recipe`` — TP (async where the engine overlapped it), PP, VP (``stages_per_rank``;
``interleaved1f1b`` when VP > 1, ``1f1b`` when PP > 1, else ``gpipe``), data parallel ``GPUs / (TP·PP·CP)``
as FSDP2 (``fully_shard``: FSDP or Megatron's distributed optimizer) or DDP, micro-batches per copy,
recomputation, bf16 with the linears in FP8 where the row ran them so (``float8``) — and costs it with
``Planner.manual(recipe, check_memory=False)`` on ``Cluster.of(gpu, count, engine=...)``: the published GPUs
as their system came (:mod:`autosplit.gpu_presets`), with the fitted profile of the stack that ran it
(:mod:`autosplit.engine_profiles`). Per row: predicted tokens/s/GPU (global batch · sequence / (step · GPUs)),
the published figure, their ratio, the fullest device's predicted memory against its capacity, the step's
terms, and planning seconds; a row it cannot express names why (``nvfp4``, ``cp``, ``ep``, ``moe``, ``lora``,
``model shape unknown``, …); a malformed row says what is wrong with it and the run goes on. Every figure is
the cost model's, not a measurement. Each row is costed in a fresh process (:mod:`benchmarks.fresh`), killed
past ``--budget`` seconds; ``--grid`` costs each at other device figures too, for
:mod:`benchmarks.published_fit`.

Summary (:mod:`benchmarks.published_summary`): median and 90th percentile (nearest rank) of
``|predicted / published − 1|``, the rows within 10%, and per ``layout_group`` the pairs of rows whose
predicted order agrees with the published one.

Usage::

    .venv/bin/python benchmarks/published.py --ids 294,295 --out /tmp/published.json
    .venv/bin/python benchmarks/published.py --jobs 2          # every row: benchmarks/results/published.json
    .venv/bin/python benchmarks/published.py --dry-run          # classify every row only: counts per reason
    .venv/bin/python benchmarks/published.py --judge OLD.json   # OLD's costed rows, labelled and summarised as read now
    .venv/bin/python benchmarks/published.py --ids 308,311 --into benchmarks/results/published.json   # two rows costed again in it
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = ROOT.parent / "shared" / "published" / "runs.csv"
sys.path.insert(0, str(ROOT))

from benchmarks.published_models import build  # noqa: E402  (run as a script: the root first)
from benchmarks.published_rows import Classified, read_csv  # noqa: E402


def _fullest(plan: Any) -> tuple[float, float]:
    """(bytes, capacity) of the fullest device: a rank's stages together where it runs several (as plan_3d counts them)."""
    held = ([(m, plan.stages[plan.stage_devices.index(r)].capacity) for r, m in enumerate(plan.rank_memory)]
            if plan.stages_per_rank > 1 else [(st.memory, st.capacity) for st in plan.stages])
    return max(held, key=lambda mc: mc[0] / mc[1])


def _regrid(planner: Any, recipe: Any, grid: Sequence[dict[str, float]], tokens: int, gpus: int) -> dict[str, float]:
    """Predicted tokens/s/GPU of ``recipe`` at each point of ``grid`` (the capture reused): a point sets the devices'
    fitted figures (``efficiency``, ``memory_efficiency``, ``tp_overlap``, ``ep_overlap``, ``attention_share``) and entries
    of :data:`~autosplit.engine_profiles.FITTED` read at cost time by name (``float8.rowwise``), keyed ``"efficiency=0.5 …"``:
    what ``--grid`` fits the engine profiles from. A point differing only in what the recipe does not use (``tp_overlap``
    without ``async_tp``, ``ep_overlap`` without it, ``float8.rowwise`` without rowwise FP8) is costed once."""
    import copy
    import dataclasses

    from autosplit.engine_profiles import FITTED

    unused = {"tp_overlap": not recipe.options.get("async_tp"), "ep_overlap": not recipe.options.get("ep_overlap"),
              "float8.rowwise": recipe.options.get("float8") != "rowwise"}
    kept = dict(FITTED)
    out: dict[str, float] = {}
    costed: dict[tuple, float] = {}
    for point in grid:
        used = tuple(sorted((k, v) for k, v in point.items() if not unused.get(k)))
        if used not in costed:
            for name, value in used:
                if name in FITTED:
                    FITTED[name] = dataclasses.replace(FITTED[name], value=value)
            for traced in (planner.traced, *planner.traced._shares.values()):
                traced._tables.clear()  # costed under the fitted figures just set
            other = copy.copy(planner)
            other.devices = tuple(dataclasses.replace(d, **{k: v for k, v in used if k not in FITTED}) for d in planner.devices)
            costed[used] = tokens / (other.manual(recipe, check_memory=False).step_time * gpus)
            FITTED.update(kept)
        out[" ".join(f"{k}={v:g}" for k, v in sorted(point.items()))] = costed[used]
    return out


def cost_row(spec: dict[str, Any], grid: Sequence[dict[str, float]] = ()) -> dict[str, Any]:
    """One expressible row costed in this process (call it in a fresh one: its peak RSS is its own); with
    ``grid``, also at each of its points (:func:`_regrid`)."""
    import dataclasses

    import torch

    import autosplit
    from autosplit.compiler.manual import execution_order, torchtitan_fqns

    start = time.perf_counter()
    model = build(spec["shape"], spec["seq_len"], pipelined=spec["pp"] > 1)
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
                                   "sequence_parallel": "auto" if spec["tp"] > 1 else False, "async_tp": spec.get("async_tp", False),
                                   "ep_overlap": spec.get("ep_overlap", False)}
        if spec["vp"] > 1:
            options["stages_per_rank"] = spec["vp"]
        recipe = autosplit.Recipe(split, data_parallel=spec["dp"], replicate=spec["replicate"], tensor_parallel=spec["tp"],
                                  expert_parallel=spec.get("ep", 1), context_parallel=spec.get("cp", 1), options=options)
        plan = planner.manual(recipe, check_memory=False)
        memory, capacity = _fullest(plan)
        row.update(outcome="costed", step_s=plan.step_time, predicted_tokens_per_s_per_gpu=tokens / (plan.step_time * gpus),
                   mesh=plan.mesh, schedule=plan.schedule, stages_per_rank=plan.stages_per_rank, micro_batches=plan.micro_batches,
                   memory_gib=memory / 2**30, capacity_gib=capacity / 2**30, fits=memory <= capacity,
                   recomputed_blocks=len(plan.recompute), selective=plan.recompute_selective, device=plan.devices[0].name,
                   float8=plan.float8, async_tp=plan.async_tp, ep_overlap=plan.ep_overlap,
                   terms=None if plan.terms is None else dataclasses.asdict(plan.terms))
        if not row["fits"] and not spec.get("recompute_stated", True):
            row.update(outcome="levers unknown", reason=f"levers unknown: the row states no recomputation or offload, and without "
                       f"them its layout needs {row['memory_gib']:.0f} of {row['capacity_gib']:.0f} GiB")
        if grid:
            row["grid"] = _regrid(planner, recipe, grid, tokens, gpus)
    except autosplit.AutosplitError as e:
        first = str(e).split(". Likely cause")[0].splitlines()[0]
        row.update(outcome=type(e).__name__, reason=f"{type(e).__name__}: {first[:300]}")
    row["plan_s"] = time.perf_counter() - planning
    row["total_s"] = time.perf_counter() - start
    row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return row


def _result(c: Classified, costed: dict[str, Any] | None) -> dict[str, Any]:
    """A row of the JSON: the row's cells read, then its reason or its costed figures."""
    row: dict[str, Any] = {"row_id": c.row_id, **c.info}
    if costed is None:
        row.update(outcome="malformed" if "malformed" in c.reasons else "not expressible", reason=c.reasons[0],
                   reasons=c.reasons, **({"message": c.message} if c.message else {}))
        return row
    row.update(costed)
    published = c.info.get("published_tokens_per_s_per_gpu")
    if row["outcome"] == "costed" and row.get("predicted_tokens_per_s_per_gpu") is not None and published:
        row["ratio"] = row["predicted_tokens_per_s_per_gpu"] / published
    if row["outcome"] in ("crashed", "timed out"):
        row["reason"] = f"{row['outcome']}: {row.get('stderr', '').strip().splitlines()[-1:] or ''}"
    return row


def run(classified: Sequence[Classified], budget: float, jobs: int = 1, grid: Sequence[dict[str, float]] = ()) -> list[dict[str, Any]]:
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

    extra = "".join(f" {k.upper()}{r[k]}" for k in ("cp", "ep") if r.get(k, 1) > 1)
    layout = (f"TP{r['tp']} PP{r['pp']} VP{r['vp']}{extra} DP{r['dp']} {'FSDP' if r['replicate'] == 'fully_shard' else 'DDP'}"
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


def _grid(text: str) -> list[dict[str, float]]:
    """``"efficiency=0.4,0.5 memory_efficiency=0.7"`` → every point of the product of the fields' values; ``""``: none."""
    import itertools

    fields = dict(part.split("=", 1) for part in text.split())
    values = [[float(v) for v in vs.split(",")] for vs in fields.values()]
    return [dict(zip(fields, point)) for point in itertools.product(*values)] if fields else []


def judged(earlier: dict[str, Any], classified: list[Classified]) -> dict[str, Any]:
    """``earlier`` (a results file) with each row's labels read again from the CSV and its summary made again:
    a label's fix (which rows are mixtures of experts, say) without costing 150 rows again."""
    from benchmarks.published_summary import print_summary, summarize

    labels = {c.row_id: c.info for c in classified}
    rows = [{**r, **labels.get(r["row_id"], {})} for r in earlier["rows"]]
    summary = summarize(rows)
    print_summary(summary)
    return {**earlier, "summary": summary, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="runs in the columns of ../shared/published/runs.csv")
    parser.add_argument("--ids", default=None, help="comma-separated row_ids to cost (default: every row)")
    parser.add_argument("--out", type=Path, default=None, help="JSON (default benchmarks/results/published.json; --dry-run: none)")
    parser.add_argument("--budget", type=float, default=900.0, help="seconds a row may take before it is killed")
    parser.add_argument("--dry-run", action="store_true", help="only classify the rows and count the reasons")
    parser.add_argument("--jobs", type=int, default=1, help="rows costed at once, each in its own process")
    parser.add_argument("--grid", default="", help="device figures to cost every row at too, to fit the engine profiles: "
                        "'efficiency=0.5,0.6 memory_efficiency=0.6,0.8 tp_overlap=0,0.5'")
    parser.add_argument("--judge", type=Path, default=None, help="an earlier results file: its costed rows summarised again "
                        "under the CSV's rows as they are read now (their labels: model, GPU, experts, layout group), nothing costed")
    parser.add_argument("--into", type=Path, default=None, help="an earlier results file the rows costed now replace theirs in "
                        "(the others kept as they were costed then), summarised again and written back (unless --out)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if not args.csv.is_file():
        raise SystemExit(f"no CSV at {args.csv}")
    ids = None if args.ids is None else {i.strip() for i in args.ids.split(",") if i.strip()}
    classified = read_csv(args.csv, ids)
    from benchmarks.plan_time import machine

    if args.dry_run:
        report: dict[str, Any] = {"benchmark": "published", "dry_run": True, "csv": str(args.csv), "summary": dry_run(classified)}
    elif args.judge is not None:
        report = judged(json.loads(args.judge.read_text()), classified)
    else:
        print("simulated: device presets, the cost model's figures (not measured)")
        results = run(classified, args.budget, args.jobs, _grid(args.grid))
        from benchmarks.published_summary import print_summary, summarize

        if args.into is not None:
            from benchmarks.plan_3d import merged

            results = merged(json.loads(args.into.read_text())["rows"], results, key="row_id")
        summary = summarize(results)
        print_summary(summary)
        report = {"benchmark": "published", "simulated": True, "csv": str(args.csv), "machine": machine(), "summary": summary,
                  "rows": results}
    out = args.out or args.into or (None if args.dry_run else ROOT / "benchmarks" / "results" / "published.json")
    if out is not None:
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
