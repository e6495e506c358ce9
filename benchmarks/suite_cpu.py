"""Where README's test command spends the machine: the CPU-seconds of every test, all its processes counted.

The suite is CPU-bound on a 2-core machine (both cores busy nearly all the run), so its time is its work. This runs
it on one pytest process (``-n 0``), one test at a time, and charges each test the machine's busy CPU time while it
runs (``/proc/stat``: its ranks, its subprocesses and torchrun's launcher included); then sums them by file and by
kind — torchrun launches (``@pytest.mark.processes``), the gloo groups' cases (the ``gloo`` fixture), the rest in
the test's own process. Linux only. Prints a table and writes ``benchmarks/results/suite_cpu.json``.

Usage::

    .venv/bin/python benchmarks/suite_cpu.py              # the whole suite, about 14 min
    .venv/bin/python benchmarks/suite_cpu.py tests/cli    # a part of it
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "suite_cpu.json"
_OUT = "AUTOSPLIT_SUITE_CPU"
"""Where the plugin, loaded into the suite's pytest by ``-p benchmarks.suite_cpu``, writes its rows."""


def _busy() -> float:
    """Seconds of CPU the machine has been busy (every core, user and system), from ``/proc/stat``."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


_started: dict[str, tuple[float, float, str]] = {}
_rows: dict[str, dict[str, Any]] = {}


def pytest_runtest_setup(item: Any) -> None:  # the plugin's hooks: fixtures' set-up is the test's
    kind = ("torchrun" if item.get_closest_marker("processes") else
            "gloo" if "gloo" in getattr(item, "fixturenames", ()) else "in process")
    _started[item.nodeid] = (_busy(), time.monotonic(), kind)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    if nodeid in _started:
        busy, wall, kind = _started.pop(nodeid)
        _rows[nodeid] = {"cpu_s": round(_busy() - busy, 2), "wall_s": round(time.monotonic() - wall, 2), "kind": kind}


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if os.environ.get(_OUT):
        Path(os.environ[_OUT]).write_text(json.dumps(_rows))


def summarise(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    total = sum(r["cpu_s"] for r in rows.values())
    kinds: Counter[str] = Counter()
    files: Counter[str] = Counter()
    for nodeid, r in rows.items():
        kinds[r["kind"]] += r["cpu_s"]
        files[nodeid.split("::")[0]] += r["cpu_s"]
    return {"tests": len(rows), "cpu_s": round(total), "wall_s": round(sum(r["wall_s"] for r in rows.values())),
            "by_kind": {k: {"cpu_s": round(v), "share": round(v / total, 3),
                            "tests": sum(r["kind"] == k for r in rows.values())} for k, v in kinds.most_common()},
            "by_file": {f: round(v, 1) for f, v in files.most_common(20)},
            "slowest": {n: r for n, r in sorted(rows.items(), key=lambda kv: -kv[1]["cpu_s"])[:20]}}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:  # the rows, written by the plugin when the session ends
        partial = Path(tmp) / "rows.json"
        env = {**os.environ, _OUT: str(partial), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-p", "benchmarks.suite_cpu",
                               *args], cwd=ROOT, env=env)
        if not partial.exists():
            raise SystemExit(f"pytest ended ({done.returncode}) before its session finished: no rows to sum")
        rows = json.loads(partial.read_text())
    summary = summarise(rows)
    print(f"\n{summary['tests']} tests: {summary['cpu_s']} CPU-seconds over {summary['wall_s']} s on one pytest process")
    for kind, k in summary["by_kind"].items():
        print(f"  {kind:<11} {k['tests']:4d} tests {k['cpu_s']:6d} CPU-s  {k['share']:.0%}")
    for nodeid, r in list(summary["slowest"].items())[:15]:
        print(f"  {r['cpu_s']:6.1f} CPU-s {r['wall_s']:6.1f} s  {r['kind']:<10} {nodeid[:120]}")
    from benchmarks.plan_time import machine

    RESULTS.write_text(json.dumps({"benchmark": "suite_cpu", "machine": machine(), "argv": args, "pytest_exit": done.returncode,
                                   "summary": summary}, indent=1))
    print(f"wrote {RESULTS}")
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
