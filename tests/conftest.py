"""Fixtures for every test; the helpers the tests share are in ``tests/helpers.py``."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch

# The ranks the distributed tests spawn inherit this: a rank that aborts in C++ (SIGABRT,
# SIGSEGV) prints where its Python threads were, into the failing test's captured stderr.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

# One intra-op thread, here and in every process a test starts (torchrun's ranks, python -c): the
# tests' models are small, and on this 2-core machine, shared, a second OpenMP thread mostly waits
# for the first (MobileNet's 3 float64 steps took 8 s on 2 threads, 0.4 s on 1). Timings with more
# threads belong to benchmarks/.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_finish(session):
    """What collection imported (torch, autosplit, the test modules) stays for good: moved out of the
    collector's reach, no full collection walks it again (the runtime's ``close()`` runs one per pipeline)."""
    import gc

    gc.collect()
    gc.freeze()


DURATIONS = Path(__file__).with_name("durations.json")
"""Each test's seconds (setup, call and teardown) in the last full run recorded with ``--record-durations``."""
FAST = 1.0
"""Seconds a recorded test may take and stay in the fast tier (``-m "not slow"``)."""


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help=f"write each test's seconds into {DURATIONS.name} (what the fast tier is chosen from)")


def duration_key(nodeid: str) -> str:
    """The name a test's duration is kept under: its node id, a documentation snippet's without its line
    (``README.md:33`` → ``README.md``), so that a page's snippets, which run in one namespace in page order,
    share one duration (the page's slowest) and one tier, and an edit above a snippet does not rename it."""
    return re.sub(r"(\.md):\d+", r"\1", nodeid)


def _by_key(seconds: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for nodeid, value in seconds.items():
        key = duration_key(nodeid)
        out[key] = max(out.get(key, 0.0), value)
    return out


def recorded_durations() -> dict[str, float]:
    return _by_key(json.loads(DURATIONS.read_text())) if DURATIONS.exists() else {}


def pytest_collection_modifyitems(config, items):
    """The tiers, from the recorded durations: a test is ``slow`` unless it took at most :data:`FAST` seconds
    when last recorded and runs in this process — or is a multi-process case marked ``smoke`` (one per
    runtime path). A test not yet recorded is slow until it is."""
    recorded = recorded_durations()
    for item in items:
        if item.get_closest_marker("smoke"):
            continue
        seconds = recorded.get(duration_key(item.nodeid))
        if seconds is None or seconds > FAST or "gloo" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("AUTOSPLIT_LIST_TIERS"):  # tests/test_tiers.py reads the tiers from a collection
        for item in items:
            print(f"TIER {'slow' if item.get_closest_marker('slow') else 'fast'} {item.nodeid}")


_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] += report.duration


def pytest_sessionfinish(session, exitstatus):
    """With ``--record-durations``, on the controller: this run's seconds merged into :data:`DURATIONS`."""
    if session.config.getoption("record_durations") and not hasattr(session.config, "workerinput") and _seconds:
        merged = {**recorded_durations(), **{k: round(v, 2) for k, v in _by_key(_seconds).items()}}
        partial = DURATIONS.with_suffix(".json.partial")  # replaced whole, never half written
        partial.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")
        os.replace(partial, DURATIONS)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def gloo():
    """``gloo(world)``: this test file's group of ``world`` gloo processes (:class:`tests.helpers.Gloo`),
    started on first use and kept for the file's other tests; ``timeout``: the process group's, in seconds."""
    from tests.helpers import Gloo

    groups: dict[tuple[int, float], Gloo] = {}

    def group(world: int, *, timeout: float = 60) -> Gloo:
        key = (world, timeout)
        if key not in groups or groups[key].closed:
            groups[key] = Gloo(world, timeout=timeout)
        return groups[key]

    yield group
    for made in groups.values():
        made.close()
