"""The fast tier (``pytest -m "not slow"``) is chosen from the recorded durations (``tests/conftest.py``):
every test has one, and the fast tier's add up to its budget."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import DURATIONS, TIERS, duration_key, recorded_durations
from tests.helpers import ROOT

BUDGET = 200.0
"""Seconds the fast tier's recorded durations may add up to: about 70 s on README's two workers, within
the two minutes of issue 67 with the workers' start."""


def _tiers() -> dict[str, str]:
    """Every test's tier, as the conftest sets it: from this session's collection where it holds every test
    file (README's test command), else from a collection of its own."""
    files = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")}
    if files <= {nodeid.split("::")[0] for nodeid in TIERS}:
        return {duration_key(nodeid): tier for nodeid, tier in TIERS.items()}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0", "tests"],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "AUTOSPLIT_LIST_TIERS": "1"}, timeout=240,
    ).stdout
    return {duration_key(line.split(" ", 2)[2]): line.split(" ", 2)[1] for line in out.splitlines() if line.startswith("TIER ")}


def test_every_test_has_a_recorded_duration_and_the_fast_tier_fits_its_budget():
    tiers, recorded = _tiers(), recorded_durations()
    assert len(tiers) > 500, "the collection listed the tests"
    missing = sorted(set(tiers) - set(recorded))
    assert not missing, (f"{len(missing)} tests have no recorded duration, so they run only in the slow tier: "
                         f"record them with `.venv/bin/python -m pytest --record-durations` ({DURATIONS.name}); "
                         f"the first: {missing[:5]}")
    fast = [t for t, tier in tiers.items() if tier == "fast"]
    total = sum(recorded[t] for t in fast)
    assert total <= BUDGET, f"the fast tier's {len(fast)} tests took {total:.0f} s when recorded, over its {BUDGET:.0f} s"
