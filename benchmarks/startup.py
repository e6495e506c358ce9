"""What a newcomer waits for before autosplit does anything: imports and the command line, beside ``import torch``.

Each command runs in a fresh Python process (the interpreter started as a user starts it, this repository's
``.venv``), in rounds that take every command in turn, so that the machine's noise falls on all of them alike:

- ``import torch`` (``python -c "import torch"``): the floor everything here stands on;
- ``import autosplit`` (the package: its names load on first use);
- ``from autosplit import plan`` (the planner's rooms: capture, costs, the solvers' front ends), what planning pays;
- ``autosplit --help`` (``python -m autosplit --help``);
- ``autosplit demo`` (plans, builds and trains the built-in default a step).

The figure per command is the median wall time over ``--rounds`` rounds (min and max beside it), its ratio
to ``import torch``'s median from the same rounds, and the seconds it takes beyond ``import torch``. Prints a
table and writes ``benchmarks/results/startup.json``.

Usage::

    .venv/bin/python benchmarks/startup.py               # 5 rounds, about 2 min
    .venv/bin/python benchmarks/startup.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.plan_time import machine  # noqa: E402  (run as a script: the root first)

COMMANDS = {
    "import torch": ["-c", "import torch"],
    "import autosplit": ["-c", "import autosplit"],
    "from autosplit import plan": ["-c", "from autosplit import plan"],
    "autosplit --help": ["-m", "autosplit", "--help"],
    "autosplit demo": ["-m", "autosplit", "demo"],
}


def _timed(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "startup.json")
    args = parser.parse_args(argv)
    _timed(COMMANDS["import autosplit"])  # untimed: the first run compiles the bytecode and fills the page cache
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            times[name].append(_timed(command))
    floor = statistics.median(times["import torch"])
    rows = {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                   "over_import_torch": statistics.median(t) / floor, "beyond_import_torch_s": statistics.median(t) - floor}
            for name, t in times.items()}
    print(f"{'command':<27} {'median s':>9} {'min':>7} {'max':>7} {'× import torch':>15} {'+ s':>6}")
    for name, r in rows.items():
        print(f"{name:<27} {r['median_s']:>9.2f} {r['min_s']:>7.2f} {r['max_s']:>7.2f} {r['over_import_torch']:>15.2f}"
              f" {r['beyond_import_torch_s']:>6.2f}")
    args.out.write_text(json.dumps({"benchmark": "startup", "machine": machine(), "rounds": args.rounds, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
