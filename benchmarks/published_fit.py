"""Fit the engine profiles (:data:`autosplit.engine_profiles.FITTED`) to the published record, from a grid run.

``benchmarks/published.py --grid G1,G2,…xM1,M2,…`` costs every expressible row at each (GEMM, memory)
efficiency pair; this picks, for one memory efficiency shared by every engine and one GEMM efficiency per
engine profile, the values that minimise the median |predicted / published − 1| of that engine's rows (ties:
the smaller 90th percentile), reading between grid points by interpolating each row's predicted throughput
linearly in the GEMM efficiency. It prints the fitted values and each engine's errors at them, and writes
them as JSON; ``autosplit/engine_profiles.py`` holds the values the code uses (copied from this output,
with the command), and ``benchmarks/published.py`` run again checks them.

Usage::

    .venv/bin/python benchmarks/published.py --jobs 2 --grid 0.35,0.45,0.55,0.65,0.75,0.85x0.5,0.7,0.9 --out /tmp/grid.json
    .venv/bin/python benchmarks/published_fit.py /tmp/grid.json --out benchmarks/results/published_fit.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STEP = 0.005
"""The GEMM efficiencies tried between the grid's ends."""


def _at(row: dict[str, Any], gemm: float, memory: float) -> float | None:
    """The row's predicted tokens/s/GPU at ``gemm``, interpolated between the grid's GEMM points at ``memory``."""
    points = sorted((float(k.split(":")[0]), v) for k, v in row["grid"].items() if math.isclose(float(k.split(":")[1]), memory))
    for (g0, v0), (g1, v1) in itertools.pairwise(points):
        if g0 <= gemm <= g1:
            return v0 + (v1 - v0) * (gemm - g0) / (g1 - g0)
    return None


def _errors(rows: Sequence[dict[str, Any]], gemm: float, memory: float) -> list[float]:
    predicted = [_at(r, gemm, memory) for r in rows]
    return sorted(abs(p / r["published_tokens_per_s_per_gpu"] - 1) for p, r in zip(predicted, rows) if p is not None)


def _quality(errors: list[float]) -> tuple[float, float]:
    return statistics.median(errors), errors[math.ceil(0.9 * len(errors)) - 1]


def fit(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The shared memory efficiency and each engine's GEMM efficiency (see the module docstring)."""
    usable = [r for r in rows if r.get("grid") and r.get("published_tokens_per_s_per_gpu")]
    engines = sorted({r["device"].rsplit("(", 1)[-1].rstrip(")") for r in usable})
    keys = [tuple(map(float, k.split(":"))) for k in usable[0]["grid"]]
    gemms, memories = sorted({g for g, _ in keys}), sorted({m for _, m in keys})
    tries = [round(gemms[0] + i * STEP, 4) for i in range(int((gemms[-1] - gemms[0]) / STEP) + 1)]
    best: dict[str, Any] | None = None
    for memory in memories:
        fitted, total = {}, []
        for engine in engines:
            mine = [r for r in usable if r["device"].endswith(f"({engine})")]
            gemm = min(tries, key=lambda g: _quality(_errors(mine, g, memory)) if _errors(mine, g, memory) else (math.inf, math.inf))
            errors = _errors(mine, gemm, memory)
            fitted[engine] = {"gemm": gemm, "rows": len(mine), "median": _quality(errors)[0], "p90": _quality(errors)[1]}
            total += errors
        candidate = {"memory": memory, "engines": fitted, "median": _quality(sorted(total))[0], "p90": _quality(sorted(total))[1]}
        if best is None or (candidate["median"], candidate["p90"]) < (best["median"], best["p90"]):
            best = candidate
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", type=Path, help="the JSON of a published.py --grid run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = json.loads(args.grid.read_text())
    best = fit(report["rows"])
    print(f"memory efficiency {best['memory']:g}: median {best['median']:.1%}, 90th percentile {best['p90']:.1%}")
    print(f"{'engine':<15} {'gemm':>6} {'rows':>5} {'median':>7} {'p90':>7}")
    for engine, f in best["engines"].items():
        print(f"{engine:<15} {f['gemm']:6.3f} {f['rows']:5d} {f['median']:7.1%} {f['p90']:7.1%}")
    if args.out is not None:
        args.out.write_text(json.dumps({"benchmark": "published_fit", "grid": str(args.grid), **best}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
