"""Golden plans: fixed models with fixed cost tables give stored plans and stored report renders,
so a change to the solver, the cost bookkeeping or the report is a visible diff.

After an intended change, rewrite the stored files and review them in the diff::

    AUTOSPLIT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.candidates import Candidate
from autosplit.examples import GPT
from autosplit.passes.costs import estimate
from autosplit.report.html import render
from autosplit.report.text import plan_report
from tests.helpers import GOLDEN

UPDATE = os.environ.get("AUTOSPLIT_UPDATE_GOLDEN") == "1"


def _gpt():
    torch.manual_seed(0)
    return GPT(vocab=128, d_model=32, n_layers=4, n_heads=2, max_len=16), (torch.randint(0, 128, (8, 16)),)


def _cnn():
    torch.manual_seed(0)
    layers = []
    for cin, cout in ((3, 16), (16, 32), (32, 32), (32, 64)):
        layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    return model, (torch.randn(8, 3, 32, 32),)


CASES = {
    "gpt_a100x2_gpipe": (_gpt, ["A100-80GB"] * 2, {"schedule": "gpipe", "micro_batches": 8}),
    "gpt_a100x4_1f1b": (_gpt, ["A100-80GB"] * 4, {"schedule": "1f1b", "micro_batches": 8}),
    "cnn_v100x3_gpipe": (_cnn, ["V100-16GB"] * 3, {"schedule": "gpipe", "micro_batches": 4}),
}


def _normalised(plan: autosplit.Plan) -> autosplit.Plan:
    """The plan without what differs from run to run (wall times, library versions, the table's path)."""
    return dataclasses.replace(
        plan, versions={}, timings={}, costs="given table", solver=dataclasses.replace(plan.solver, wall_time=0.0)
    )


def _check(path: Path, text: str) -> None:
    if UPDATE:
        path.write_text(text)
        return
    assert path.exists(), f"{path.name} is missing: run AUTOSPLIT_UPDATE_GOLDEN=1 pytest {__file__}"
    stored = path.read_text()
    if stored != text:
        diff = "".join(list(difflib.unified_diff(stored.splitlines(True), text.splitlines(True), "stored", "now"))[:80])
        pytest.fail(f"{path.name} changed; if intended, rewrite with AUTOSPLIT_UPDATE_GOLDEN=1:\n{diff}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_plan_and_report(name):
    make, devices, options = CASES[name]
    model, inputs = make()
    table = GOLDEN / f"{name}.costs.json"
    if UPDATE:
        planner = autosplit.Planner(model, devices, example_inputs=inputs, **options)
        estimate(planner.traced.captured.gm, planner.specs(), micro_batches=options["micro_batches"]).save(table)
    plan = _normalised(autosplit.plan(model, devices, example_inputs=inputs, costs=table, time_limit=10, seed=0, **options))
    assert plan.solver.gap <= 1e-9, "golden cases are small enough to prove optimal: a plan that is not would drift"
    _check(GOLDEN / f"{name}.plan.json", json.dumps(plan.to_dict(), indent=1) + "\n")
    _check(GOLDEN / f"{name}.report.txt", plan_report(plan) + "\n")
    _check(GOLDEN / f"{name}.report.html", render([Candidate(plan.solver.name, plan)], title=f"golden: {name}"))
