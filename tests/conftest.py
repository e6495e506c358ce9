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
    share one duration (the page's slowest) and one tier, and an edit above a snippet does not rename it; and
    without the ``@group`` xdist adds to the node ids of a group's tests."""
    return re.sub(r"(\.md):\d+", r"\1", re.sub(r"@[\w./-]+$", "", nodeid))


def _by_key(seconds: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for nodeid, value in seconds.items():
        key = duration_key(nodeid)
        out[key] = max(out.get(key, 0.0), value)
    return out


def recorded_durations() -> dict[str, float]:
    return _by_key(json.loads(DURATIONS.read_text())) if DURATIONS.exists() else {}


TIERS: dict[str, str] = {}
"""This session's collection: each test's tier (``slow`` or ``fast``), by node id."""
PROCESSES = "processes"
"""The xdist group of every test that starts processes of its own: run one after another on one worker."""


def starts_processes(item: pytest.Item) -> bool:
    """Whether ``item`` runs on several processes: the ``gloo`` fixture's group, or a launch marked ``processes``."""
    return "gloo" in getattr(item, "fixturenames", ()) or item.get_closest_marker(PROCESSES) is not None


@pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the groups
def pytest_collection_modifyitems(config, items):
    """The tiers, from the recorded durations: a test is ``slow`` unless it took at most :data:`FAST` seconds
    when last recorded and runs in this process — or is a multi-process case marked ``smoke`` (one per
    runtime path). A test not yet recorded is slow until it is.

    And the workers' shares (``--dist loadgroup``): the tests that start processes form one group, run on one
    worker one after another beside the other worker's single-process tests. Two of them at once put four to
    twelve busy processes on the two cores, and a gloo collective waits for every rank to be scheduled:
    grouped by file, the suite took 22 min; on one worker, 13.5 min. Every other test goes with its file, as
    ``--dist loadfile`` sends it (a file's fixtures, and a documentation page's snippets in page order)."""
    recorded = recorded_durations()
    for item in items:
        processes = starts_processes(item)
        item.add_marker(pytest.mark.xdist_group(PROCESSES if processes else item.path.relative_to(config.rootpath).as_posix()))
        if item.get_closest_marker("smoke"):
            continue
        seconds = recorded.get(duration_key(item.nodeid))
        if seconds is None or seconds > FAST or processes:
            item.add_marker(pytest.mark.slow)
    TIERS.clear()
    TIERS.update({item.nodeid: "slow" if item.get_closest_marker("slow") else "fast" for item in items})
    if os.environ.get("AUTOSPLIT_LIST_TIERS"):  # tests/test_tiers.py reads the tiers from a collection
        for nodeid, tier in TIERS.items():
            print(f"TIER {tier} {nodeid}")


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


@pytest.fixture(scope="session")
def gloo():
    """``gloo(world)``: the group of ``world`` gloo processes (:class:`tests.helpers.Gloo`), started on first use
    and kept for every later test on that many processes, in every file (they run on one worker:
    :func:`pytest_collection_modifyitems`); ``timeout``: the process group's, in seconds."""
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
