"""Planning time and quality as graphs and device counts grow (issues #3 and #9).

GPT-style models with more and more layers, built on the meta device (planning reads shapes
only), planned onto 4…64 A100-80GB presets. ``--shapes`` picks the transformer shapes
(:data:`SHAPES`: width, vocabulary, sequence, batch, tied or untied head; default the
GPT-2 small shape). For each pair it prints the time of each pass and,
side by side under the same cost model, the predicted step time of:

- ``autosplit``: the full strategy (DP + coarsening + refinement + CP-SAT), with its bound and gap;
- ``dp``: the dynamic program alone (the strategy's baseline);
- ``cpsat-node``: CP-SAT on the nodes without coarsening, no hint, its workers in parallel
  (the model as one would run it alone), under ``--node-limit`` seconds (skipped when the
  model would exceed ``--node-vars`` stage booleans);
- ``uniform``: layers split evenly by count, the embeddings with the first and the head with the last.

Writes ``benchmarks/results/solver_scaling.json`` (``--out``); the file kept there, which
``docs/options.md`` reads, is the run of the seven shapes below.

The summary checks issue #9's targets on every shape: a gap ≤ 1% at ≥ 3,000 nodes onto 8
devices and ≤ 2% at ≥ 10,000 nodes onto 64, planned end to end (capture + annotate +
estimate + solve) in ≤ 5 s and ≤ 10 s.

Usage::

    python benchmarks/solver_scaling.py                                  # 12…260 layers × 4…64 devices
    python benchmarks/solver_scaling.py --layers 12 96 --devices 8 64    # a subset
    python benchmarks/solver_scaling.py --shapes all --pairs 80x8 260x64 --node-vars 0   # issue #9's targets
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosplit.devices import resolve_devices
from autosplit.errors import AutosplitError
from autosplit.examples import GPT
from autosplit.options import PlanOptions
from autosplit.passes.annotate import annotate
from autosplit.passes.capture import capture, flat_inputs
from autosplit.passes.costs import estimate
from autosplit.solver.build import build_problem
from autosplit.solver.evaluation import evaluate
from autosplit.solver.pipeline.cpsat import cpsat
from autosplit.solver.pipeline.strategy import solve
from autosplit.solver.validate import violations
from benchmarks.plan_time import machine

SHAPES = {
    # name: (d_model, heads, vocab, seq, batch, tied head)
    "gpt2": (768, 12, 50257, 1024, 8, True),
    "narrow": (512, 8, 16000, 256, 8, True),
    "wide-untied": (1024, 16, 32000, 512, 4, False),
    "long-small-vocab": (384, 6, 8000, 2048, 2, True),
    "big-batch-untied": (640, 10, 32000, 128, 64, False),
    "small": (256, 4, 8000, 128, 8, True),
    "small-untied-batch2": (256, 4, 8000, 128, 2, False),
}
TARGETS = ((3000, 8, 0.01, 5.0), (10000, 64, 0.02, 10.0))
"""(at least this many nodes, onto this many devices, largest gap, most seconds end to end)."""


def uniform_by_layers(problem, layers: int) -> tuple[int, ...]:
    """The split people write by hand: layer i on stage i·S // L, embeddings first, head last."""
    S = problem.num_stages
    stage_of = []
    for label in problem.labels:
        parts = label.split(".")
        if parts[0] == "blocks" and len(parts) > 1:
            stage_of.append(int(parts[1]) * S // layers)
        elif parts[0] in ("ln_f", "head"):
            stage_of.append(S - 1)
        else:
            stage_of.append(0)
    return tuple(stage_of)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48, 96, 260])
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--pairs", nargs="+", default=None, help="LAYERSxDEVICES pairs instead of the grid, e.g. 80x8 260x64")
    parser.add_argument("--shapes", nargs="+", default=["gpt2"], help=f"of {sorted(SHAPES)}, or all")
    parser.add_argument("--time-limit", type=float, default=10.0, help="autosplit's solver limit, seconds")
    parser.add_argument("--node-limit", type=float, default=10.0, help="node-level CP-SAT limit, seconds")
    parser.add_argument("--node-vars", type=int, default=40_000, help="largest node-level CP-SAT model run")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "solver_scaling.json"))
    args = parser.parse_args(argv)

    shapes = sorted(SHAPES) if args.shapes == ["all"] else args.shapes
    limits, gap = PlanOptions().limits, PlanOptions().gap  # the planner's defaults: what these numbers measure
    if args.pairs:
        pairs = [tuple(int(x) for x in p.split("x")) for p in args.pairs]
    else:
        pairs = [(layers, S) for layers in args.layers for S in args.devices]
    rows: list[dict[str, Any]] = []
    header = (f"{'shape':>16} {'layers':>6} {'nodes':>6} {'S':>3} {'annotate':>8} {'solve':>7} {'total':>7} {'status':>8} "
              f"{'gap':>6} {'autosplit':>10} {'dp':>10} {'cpsat-node':>10} {'uniform':>10}")
    print("predicted step time in ms (A100-80GB presets, GPipe, M = the most ≤ 4·S dividing the batch); times in seconds")
    print(header)
    for shape, layers in ((shape, layers) for shape in shapes for layers in dict.fromkeys(L for L, _ in pairs)):
        d_model, heads, vocab, seq, batch, tied = SHAPES[shape]
        torch.manual_seed(0)
        with torch.device("meta"):  # planning needs shapes, not values: no memory for 256 layers' weights
            model = GPT(vocab=vocab, d_model=d_model, n_layers=layers, n_heads=heads, max_len=seq, tied=tied)
            tokens = torch.randint(0, vocab, (batch, seq))
        t0 = time.perf_counter()
        captured = capture(model, (tokens,))
        t_capture = time.perf_counter() - t0
        t0 = time.perf_counter()
        annotate(captured, flat_inputs(captured, (tokens,), {}))
        t_annotate = time.perf_counter() - t0
        for S in (S for L, S in pairs if L == layers):
            t0 = time.perf_counter()
            table = estimate(captured.gm, resolve_devices(["A100-80GB"] * S))
            # The planner's default: the most micro-batches ≤ 4·S that divide the batch (few per stage on small batches).
            problem = build_problem(table, micro_batches=PlanOptions().micro_batches_for(S, batch), schedule="gpipe")
            t_build = time.perf_counter() - t0
            t0 = time.perf_counter()
            try:
                sol = solve(problem, time_limit=args.time_limit, seed=0, limits=limits, gap=gap)
            except AutosplitError as e:  # e.g. the model does not fit on so few devices
                rows.append({"shape": shape, "layers": layers, "nodes": len(problem.nodes), "devices": S,
                             "error": f"{type(e).__name__}: {e}"})
                print(f"{shape:>16} {layers:>6} {len(problem.nodes):>6} {S:>3} {t_annotate:8.2f}  {type(e).__name__}: {str(e)[:90]}")
                continue
            t_solve = time.perf_counter() - t0
            M = problem.micro_batches

            def ms(obj: float, M: int = M) -> float:  # the step, per micro-batch, in ms
                return obj / M / 1e6

            node_obj, node_status = None, "skipped: model too large"
            if len(problem.nodes) * (S - 1) <= args.node_vars:
                name, found, _, _ = cpsat(
                    problem, None, time_limit=args.node_limit, seed=0, workers=None, deterministic=False
                )
                node_status = name
                if found is not None and not violations(problem, found):
                    node_obj = evaluate(problem, found).objective
            uniform = uniform_by_layers(problem, layers)
            uni_obj = evaluate(problem, uniform).objective if not violations(problem, uniform) else None
            total = t_capture + t_annotate + t_build + t_solve
            row: dict[str, Any] = {
                "shape": shape, "layers": layers, "nodes": len(problem.nodes), "devices": S, "micro_batches": M,
                "seconds": {"capture": t_capture, "annotate": t_annotate, "estimate+build": t_build, "solve": t_solve,
                            "total": total},
                "status": sol.status, "gap": sol.gap, "method": sol.solver, "units": sol.units,
                "step_ms": {"autosplit": ms(sol.objective), "bound": ms(sol.bound),
                            "dp": None if sol.baseline is None else ms(sol.baseline),
                            "cpsat_node": None if node_obj is None else ms(node_obj), "uniform": None if uni_obj is None else ms(uni_obj)},
                "cpsat_node_status": node_status,
                "never_worse_than_dp_and_uniform": all(sol.objective <= x for x in (sol.baseline, uni_obj) if x is not None),
            }
            rows.append(row)
            fmt = lambda v: "-" if v is None else f"{v:10.2f}"  # noqa: E731
            print(f"{shape:>16} {layers:>6} {row['nodes']:>6} {S:>3} {t_annotate:8.2f} {t_solve:7.2f} {total:7.2f} {sol.status:>8} "
                  f"{sol.gap:6.2%} {fmt(row['step_ms']['autosplit'])} {fmt(row['step_ms']['dp'])} "
                  f"{fmt(row['step_ms']['cpsat_node'])} {fmt(row['step_ms']['uniform'])}", flush=True)
        del captured, model

    checks = [
        {"shape": r["shape"], "nodes": r["nodes"], "devices": r["devices"], "gap": r["gap"], "seconds": r["seconds"]["total"],
         "gap_target": gap, "seconds_target": seconds, "met": r["gap"] <= gap and r["seconds"]["total"] <= seconds}
        for r in rows if "gap" in r
        for nodes, devices, gap, seconds in TARGETS if r["nodes"] >= nodes and r["devices"] == devices
    ]
    for c in checks:
        print(f"target {c['nodes']} nodes onto {c['devices']} ({c['shape']}): gap {c['gap']:.2%} (≤ {c['gap_target']:.0%}), "
              f"{c['seconds']:.1f} s (≤ {c['seconds_target']:.0f} s): {'met' if c['met'] else 'NOT MET'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "solver_scaling", "args": vars(args), "limits": dataclasses.asdict(limits), "gap": gap,
                               "machine": machine(), "rows": rows, "targets": checks}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
