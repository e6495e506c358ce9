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

STEP = 0.01
"""The spacing of the efficiencies tried between the grid's points."""
SHARE_STEP = 0.05
"""The spacing of the shares (``tp_overlap``, ``attention_share``) tried between them."""


def _point(key: str) -> dict[str, float]:
    return {k: float(v) for k, v in (part.split("=") for part in key.split())}


PER_ENGINE = ("efficiency", "tp_overlap", "attention_share")
"""The figures fitted per engine profile, read between the grid's points (:func:`_at`); ``memory_efficiency`` is shared."""


_TABLES: dict[tuple[int, float], tuple[dict[tuple[float, ...], float], list[list[float]]]] = {}


def _parsed(row: dict[str, Any], memory: float) -> tuple[dict[tuple[float, ...], float], list[list[float]]]:
    """The row's grid at ``memory`` keyed by :data:`PER_ENGINE`'s figures, and each figure's values (parsed once)."""
    key = (id(row), memory)
    if key not in _TABLES:
        defaults = {"tp_overlap": 0.0, "attention_share": 1.0}
        table = {tuple(p.get(f, defaults.get(f, 0.0)) for f in PER_ENGINE): v for k, v in row["grid"].items()
                 if math.isclose((p := _point(k))["memory_efficiency"], memory)}
        _TABLES[key] = table, [sorted({k[i] for k in table}) for i in range(len(PER_ENGINE))]
    return _TABLES[key]


def _at(row: dict[str, Any], efficiency: float, memory: float, overlap: float, attention: float = 1.0) -> float | None:
    """The row's predicted tokens/s/GPU at these figures: multilinear between the grid's points in efficiency,
    ``tp_overlap`` and ``attention_share`` at ``memory`` (one of the grid's)."""
    table, axes = _parsed(row, memory)

    def bracket(values: list[float], x: float) -> tuple[float, float, float] | None:
        if len(values) == 1:  # a figure the row does not use (tp_overlap without async TP), or the grid's one value
            return values[0], values[0], 0.0
        for a, b in itertools.pairwise(values):
            if a <= x <= b:
                return a, b, (x - a) / (b - a)
        return None

    brackets = [bracket(axis, x) for axis, x in zip(axes, (efficiency, overlap, attention))]
    if any(b is None for b in brackets):
        return None
    total = 0.0
    for corner in itertools.product((0, 1), repeat=len(brackets)):
        weight, key = 1.0, []
        for (lo, hi, t), side in zip(brackets, corner):  # type: ignore[misc]
            weight *= t if side else 1 - t
            key.append(hi if side else lo)
        total += weight * table[tuple(key)] if weight else 0.0
    return total


def _errors(rows: Sequence[dict[str, Any]], efficiency: float, memory: float, overlap: float, attention: float = 1.0) -> list[float]:
    """|predicted / published − 1| of ``rows`` at these figures, sorted."""
    predicted = [_at(r, efficiency, memory, overlap, attention) for r in rows]
    return sorted(abs(p / r["published_tokens_per_s_per_gpu"] - 1) for p, r in zip(predicted, rows) if p is not None)


def _loss(errors: list[float]) -> float:
    """What the fit minimises: the mean |log(predicted / published)| (each row's error, over and under alike)."""
    return statistics.fmean(abs(math.log1p(e)) for e in errors) if errors else math.inf


def _quality(errors: list[float]) -> dict[str, float]:
    return {"median": statistics.median(errors), "p90": errors[math.ceil(0.9 * len(errors)) - 1], "worst": errors[-1],
            "within_10pct": sum(e <= 0.10 for e in errors)}


def _engine(row: dict[str, Any]) -> str:
    """The profile whose kernels costed the row (Megatron-FSDP's are Megatron-Core's with Transformer Engine)."""
    from autosplit.engine_profiles import ENGINES

    name = row["device"].rsplit("(", 1)[-1].rstrip(")")
    return ENGINES[name].kernels or name


def fit(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The memory efficiency shared by every engine, and each engine's GEMM efficiency and ``tp_overlap`` (the
    latter only where it ran rows with async TP), minimising :func:`_loss` over its rows. Rowwise FP8 rows are
    left out: their one extra figure, ``float8.rowwise``, is fitted on them after, at these (``--grid
    "float8.rowwise=…"`` over those rows with the fitted figures in place)."""
    from autosplit.engine_profiles import ENGINES

    usable = [r for r in rows if r.get("grid") and r.get("published_tokens_per_s_per_gpu") and r.get("float8") != "rowwise"]
    points = [_point(k) for k in usable[0]["grid"]]
    span = {f: sorted({p.get(f, 1.0 if f == "attention_share" else 0.0) for p in points})
            for f in ("efficiency", "memory_efficiency", "tp_overlap", "attention_share")}

    def tries(field: str, step: float = STEP) -> list[float]:
        lo, hi = span[field][0], span[field][-1]
        return [round(lo + i * step, 4) for i in range(round((hi - lo) / step) + 1)]

    best: dict[str, Any] | None = None
    for memory in span["memory_efficiency"]:
        fitted: dict[str, Any] = {}
        every: list[float] = []
        for engine in sorted({_engine(r) for r in usable}, key=lambda e: (bool(ENGINES[e].attention_kernel), e)):  # kernels' own first
            mine = [r for r in usable if _engine(r) == engine]
            overlaps = tries("tp_overlap", SHARE_STEP) if any(r.get("async_tp") for r in mine) else [0.0]
            shared = ENGINES[engine].attention_kernel  # another profile's flash kernel: its fitted share
            shares = [fitted[shared]["attention_share"]] if shared in fitted else tries("attention_share", SHARE_STEP)
            e, o, a = min(((e, o, a) for e in tries("efficiency") for o in overlaps for a in shares),
                          key=lambda eoa: _loss(_errors(mine, eoa[0], memory, eoa[1], eoa[2])))
            errors = _errors(mine, e, memory, o, a)
            fitted[engine] = {"efficiency": e, "tp_overlap": o, "attention_share": a, "rows": len(mine), **_quality(errors)}
            every += errors
        candidate = {"memory_efficiency": memory, "engines": fitted, "loss": _loss(every), **_quality(sorted(every))}
        if best is None or candidate["loss"] < best["loss"]:
            best = candidate
    assert best is not None
    return best


def fit_one(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The one figure a grid varies alone (``--grid "ep_overlap=0,0.25,…"``, ``"float8.rowwise=…"``: run after the profiles
    are fitted, with them in place), at the value that minimises :func:`_loss` over the rows, each row's throughput read
    linearly between the grid's points (:data:`SHARE_STEP` apart)."""
    usable = [r for r in rows if r.get("grid") and r.get("published_tokens_per_s_per_gpu")]
    (name,) = {k for key in usable[0]["grid"] for k in _point(key)}
    at = [sorted((_point(k)[name], v) for k, v in r["grid"].items()) for r in usable]
    lo, hi = at[0][0][0], at[0][-1][0]

    def errors(x: float) -> list[float]:
        out = []
        for r, points in zip(usable, at):
            (a, va), (b, vb) = next(((p, q) for p, q in itertools.pairwise(points) if p[0] <= x <= q[0]), (points[0], points[0]))
            predicted = va + (vb - va) * ((x - a) / (b - a) if b > a else 0.0)
            out.append(abs(predicted / r["published_tokens_per_s_per_gpu"] - 1))
        return sorted(out)

    value = min((round(lo + i * SHARE_STEP, 4) for i in range(round((hi - lo) / SHARE_STEP) + 1)), key=lambda x: _loss(errors(x)))
    return {"figure": name, "value": value, "rows": len(usable), "loss": _loss(errors(value)), **_quality(errors(value)),
            "at_lowest": {"value": lo, **_quality(errors(lo))}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", type=Path, help="the JSON of a published.py --grid run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = json.loads(args.grid.read_text())
    if not any("efficiency" in key for r in report["rows"] for key in r.get("grid", {})):  # one figure alone
        one = fit_one(report["rows"])
        low = one["at_lowest"]
        print(f"{one['figure']} {one['value']:g} over {one['rows']} rows: median {one['median']:.1%}, 90th percentile "
              f"{one['p90']:.1%}, worst {one['worst']:.1%}, within 10%: {one['within_10pct']} (at {low['value']:g}: median "
              f"{low['median']:.1%}, 90th percentile {low['p90']:.1%})")
        if args.out is not None:
            args.out.write_text(json.dumps({"benchmark": "published_fit", "grid": str(args.grid), **one}, indent=1))
        return 0
    best = fit(report["rows"])
    print(f"memory efficiency {best['memory_efficiency']:g}: median {best['median']:.1%}, 90th percentile {best['p90']:.1%}, "
          f"worst {best['worst']:.1%}, within 10%: {best['within_10pct']}")
    print(f"{'engine':<15} {'gemm':>6} {'tp_overlap':>10} {'attention':>9} {'rows':>5} {'median':>7} {'p90':>7} {'worst':>7}")
    for engine, f in best["engines"].items():
        print(f"{engine:<15} {f['efficiency']:6.2f} {f['tp_overlap']:10.2f} {f['attention_share']:9.2f} {f['rows']:5d} "
              f"{f['median']:7.1%} {f['p90']:7.1%} {f['worst']:7.1%}")
    if args.out is not None:
        args.out.write_text(json.dumps({"benchmark": "published_fit", "grid": str(args.grid), **best}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
