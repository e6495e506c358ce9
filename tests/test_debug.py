"""AUTOSPLIT_DEBUG levels: 1 pass times, 2 also the solver and each plan, 3 also each stage's code."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import torch, autosplit
from autosplit.examples import GPT
model = GPT(vocab=30, d_model=16, n_layers=2, n_heads=2, max_len=8)
autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(torch.randint(0, 30, (4, 8)),), time_limit=1)
"""


def _loggers(level: str) -> set[str]:
    env = {**os.environ, "AUTOSPLIT_DEBUG": level}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return {line.split(":")[0].removeprefix("[autosplit] ") for line in done.stderr.splitlines() if line.startswith("[autosplit]")}


@pytest.mark.parametrize("level, shown, hidden", [
    ("", set(), {"autosplit.debug.passes"}),
    ("1", {"autosplit.debug.passes"}, {"autosplit.debug.plans", "autosplit.debug.stage_code"}),
    ("2", {"autosplit.debug.passes", "autosplit.debug.plans"}, {"autosplit.debug.stage_code"}),
    ("3", {"autosplit.debug.passes", "autosplit.debug.plans", "autosplit.debug.stage_code"}, set()),
])
def test_each_level_shows_what_it_says(level, shown, hidden):
    seen = _loggers(level)
    assert shown <= seen and not hidden & seen, seen
