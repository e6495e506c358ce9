"""The command line: the demo job and reading a saved plan back (issue #2, item 1)."""

from __future__ import annotations

import autosplit
from autosplit.cli import main


def test_demo_plans_trains_and_writes_a_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["demo", "--devices", "2", "--layers", "2", "--width", "16", "--seq", "8", "--steps", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "autosplit plan:" in text and "bottleneck" in text
    assert text.count("(split)") == 2 and "(original)" in text
    plan = autosplit.Plan.load(out)
    assert len(plan.devices) == 2 and set(plan.assignment.values()) == {0, 1}

    assert main(["report", str(out)]) == 0
    assert "autosplit plan:" in capsys.readouterr().out


def test_cli_reports_autosplit_errors_without_a_traceback(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "PlanFileError: cannot read plan file" in capsys.readouterr().err
