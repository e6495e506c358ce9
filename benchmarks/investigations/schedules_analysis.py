"""Analyses of ``benchmarks/schedules.py`` results files that measure nothing.

- ``overstatement FILE...``: how far the replay overstated autosplit's lead over torchtitan's splits
  in those files, over their replayed configurations (several stages per rank, or a split backward):
  per configuration, the predicted (b) / (a) over the measured one, round by round, less 1 (> 0:
  autosplit measured less ahead than predicted). ``PlanOptions.cut_margin``'s default (3%) is the
  90th percentile of this over 92 configurations of runs of the benchmark made before
  ``cut_margin`` existed (``git log -- benchmarks/results/`` finds those files).
- ``summarise FILE``: judge the rows of a results file again with the current code's verdicts
  (:func:`benchmarks.schedules.verdicts`), written back into it. A run of the benchmark writes its
  own summary; this is for files written by older code.

Usage::

    .venv/bin/python benchmarks/investigations/schedules_analysis.py overstatement run6.json run7.json ...
    .venv/bin/python benchmarks/investigations/schedules_analysis.py summarise old_run.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.schedules import verdicts, write_json  # noqa: E402

OUT = ROOT / "benchmarks" / "investigations" / "results" / "overstatement.json"


def overstatement(paths: list[Path]) -> dict:
    """Per placement (loop or V) and over all: the overstatement's mean, percentiles and maximum."""
    from autosplit import schedules as registry

    by: dict[str, list[float]] = {}
    for path in paths:
        results = json.loads(path.read_text())
        summary = verdicts(results["models"], results.get("block", 2))
        for key, measured in summary["b_over_a"].items():
            _, schedule, v, _ = key.split()
            entry = registry.lookup(schedule)
            if entry.replayed(int(v.removeprefix("v="))):
                by.setdefault(entry.placement, []).append(summary["b_over_a_predicted"][key] / measured - 1)

    def stats(xs: list[float]) -> dict:
        ranked = sorted(xs)
        return {"configurations": len(xs), "mean": statistics.mean(xs),
                **{f"p{q}": ranked[math.ceil(q / 100 * len(ranked)) - 1] for q in (50, 75, 90, 95)}, "max": ranked[-1]}

    return {"files": [p.name for p in paths], "all": stats([x for xs in by.values() for x in xs]),
            **{placement: stats(xs) for placement, xs in by.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    over = sub.add_parser("overstatement", help="how far the replay overstated autosplit's lead in these files")
    over.add_argument("files", nargs="+", type=Path)
    over.add_argument("--out", type=Path, default=OUT)
    again = sub.add_parser("summarise", help="judge a results file with this code's verdicts, written back into it")
    again.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    if args.mode == "overstatement":
        found = overstatement(args.files)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, found)
        for name, x in found.items():
            if name != "files":
                print(f"{name:6s} {x['configurations']:3d} configurations: mean {x['mean']:+.1%}, median {x['p50']:+.1%}, "
                      f"75th {x['p75']:+.1%}, 90th {x['p90']:+.1%}, 95th {x['p95']:+.1%}, max {x['max']:+.1%}")
        return 0
    results = json.loads(args.file.read_text())
    results["summary"] = verdicts(results["models"], results.get("block", 2))
    write_json(args.file, results)
    print(json.dumps(results["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
