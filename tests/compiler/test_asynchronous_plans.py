"""An asynchronous schedule's plan: the same split re-costed under PipeDream's and plain async's rules
records their memory and a steady state without a flush."""

from __future__ import annotations

import pytest


def test_an_asynchronous_plan_records_its_schedule_memory_and_steady_state(tmp_path):
    import torch

    import autosplit
    from autosplit.examples import GPT
    from autosplit.plans import Plan
    from autosplit.report.html import write_html
    from autosplit.report.timeline import timeline

    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_layers=4, n_heads=4, max_len=16, tied=False)
    planner = autosplit.Planner(model, ["cpu"] * 4, example_inputs=(torch.randint(0, 64, (8, 16)),), micro_batches=4, time_limit=5)
    flushed = planner.what_if(schedule="1f1b")
    # The same split under each schedule: a saved plan is re-costed under its own schedule.
    plans = {s: planner.plan(Plan.from_dict({**flushed.to_dict(), "schedule": s})) for s in ("async", "pipedream")}
    stash, plain = plans["pipedream"], plans["async"]
    assert stash.schedule == "pipedream" and stash.assignment == flushed.assignment
    assert stash.stages[0].memory > plain.stages[0].memory, "PipeDream's stashed versions cost memory"
    assert stash.stages[-1].memory == plain.stages[-1].memory, "the last stage stashes nothing"
    assert plain.step_time < flushed.step_time, "no flush, no bubble"
    stash.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").schedule == "pipedream"
    write_html(tmp_path / "plan.html", stash)
    assert "pipedream order" in (tmp_path / "plan.html").read_text() and "without a flush" in (tmp_path / "plan.html").read_text()
    tasks = timeline(plain)
    first_of_next = min(t.start for t in tasks if t.kind == "forward" and t.micro >= 4)
    last_of_this = max(t.end for t in tasks if t.kind == "backward" and t.micro < 4)
    assert first_of_next < last_of_this, "the next mini-batch enters before this one drains"


def test_an_asynchronous_plan_is_solved_for_its_steady_state_even_with_one_micro_batch():
    """Without a flush every stage works on a different micro-batch at once, even at M = 1: the
    objective is M × the slowest stage, so the solver balances the stages (the flushed closed form
    at M = 1 is the sum of the stages, which one stage minimises)."""
    import torch
    import torch.nn as nn

    import autosplit

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    for schedule in ("pipedream", "xpipe"):
        plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=(torch.randn(64, 256),), schedule=schedule,
                              micro_batches=1, time_limit=5)
        assert [len(st.modules) for st in plan.stages] == [4, 4], plan.stages
        assert plan.solver.bound <= plan.solver.objective * (1 + 1e-9)
        assert plan.solver.objective == pytest.approx(max(st.time for st in plan.stages), rel=1e-6)
