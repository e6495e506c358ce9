"""AUTOSPLIT_DEBUG levels: 1 pass times, 2 also the solver and each plan, 3 also each stage's code."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from autosplit import debug

SCRIPT = """
import torch, autosplit
from autosplit.examples import GPT
model = GPT(vocab=30, d_model=16, n_layers=2, n_heads=2, max_len=8)
autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(torch.randint(0, 30, (4, 8)),), time_limit=1)
"""
LOGGERS = {"autosplit.debug.passes", "autosplit.debug.plans", "autosplit.debug.stage_code"}


def _loggers(level: str) -> set[str]:
    env = {**os.environ, "AUTOSPLIT_DEBUG": level}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return {line.split(":")[0].removeprefix("[autosplit] ") for line in done.stderr.splitlines() if line.startswith("[autosplit]")}


@pytest.mark.parametrize("level", ["", "3"])
def test_the_environment_variable_turns_the_logs_on(level):
    """Read at import: off by default; at the top level, a plan shows its passes, its report and its stages' code."""
    seen = _loggers(level)
    assert seen >= LOGGERS if level else not seen & LOGGERS, seen


@pytest.mark.parametrize("level, shown", [
    (1, {"autosplit.debug.passes"}),
    (2, {"autosplit.debug.passes", "autosplit.debug.plans", "autosplit.solver"}),
    (3, {*LOGGERS, "autosplit.solver"}),
])
def test_each_level_shows_what_it_says(level, shown, capsys):
    """The handler each level attaches passes its loggers' lines and holds back the rest."""
    root = logging.getLogger("autosplit")
    handlers, old = list(root.handlers), root.level
    try:
        debug.configure(level)
        for name in [*LOGGERS, "autosplit.solver"]:
            logging.getLogger(name).info("line")
    finally:
        root.handlers, root.level = handlers, old
    seen = {line.split(":")[0].removeprefix("[autosplit] ") for line in capsys.readouterr().err.splitlines()}
    assert seen == shown
