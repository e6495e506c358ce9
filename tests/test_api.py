"""The API surface: options written once and checked up front, the Planner tier, a clean library."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autosplit
from autosplit.examples import GPT

ROOT = Path(__file__).resolve().parents[1]


def _gpt():
    return GPT(vocab=30, d_model=16, n_layers=3, n_heads=2, max_len=8), (torch.randint(0, 30, (4, 8)),)


@pytest.mark.parametrize(
    ("field", "value", "legal"),
    [
        ("time_limit", -1, "> 0"),
        ("micro_batches", 0, "≥ 1"),
        ("schedule", "zigzag", "gpipe"),
        ("optimizer", "lamb", "adam"),
        ("capture", "jit", "symbolic_trace"),
        ("costs", "guessed", "analytic"),
    ],
)
def test_bad_options_fail_before_any_work_naming_the_option(field, value, legal):
    with pytest.raises(autosplit.errors.ConstraintError, match=f"option {field}=") as err:
        autosplit.PlanOptions(**{field: value})
    assert legal in str(err.value)
    model, inputs = _gpt()
    with pytest.raises(autosplit.errors.ConstraintError, match=f"option {field}="):
        autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, **{field: value})


def test_unknown_option_names_the_legal_ones():
    model, inputs = _gpt()
    with pytest.raises(autosplit.errors.ConstraintError, match="unknown option.*'shedule'.*schedule"):
        autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, shedule="1f1b")


def test_planner_captures_once_and_answers_what_if():
    model, inputs = _gpt()
    reference = copy.deepcopy(model)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2)
    first = planner.plan()
    traced = planner.traced
    wider = planner.what_if(devices=["cpu"] * 3, schedule="1f1b")
    assert planner.traced is traced, "what_if reuses the captured, annotated graph"
    assert len(wider.stages) == 3 and wider.schedule == "1f1b" and wider.micro_batches == 4, "the most ≤ 4 × 3 dividing 4 rows"
    assert first.schedule == "gpipe" and len(first.stages) == 2
    split = planner.build(first)
    assert split.plan.assignment == first.assignment
    torch.testing.assert_close(split(*inputs), reference(*inputs))


def test_solver_never_imports_passes_or_torch():
    code = (
        "import sys, autosplit.solver, autosplit.solver.makespan, autosplit.solver.hybrid; "
        "bad = sorted(m for m in sys.modules if m.startswith(('autosplit.passes', 'torch'))); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    # Import the solver package alone, without the autosplit package's own __init__ pulling torch in.
    env_path = ROOT / "autosplit"
    result = subprocess.run(
        [sys.executable, "-c", "import importlib.util, sys, types; "
         f"pkg = types.ModuleType('autosplit'); pkg.__path__ = [{str(env_path)!r}]; sys.modules['autosplit'] = pkg; "
         + code],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_library_is_clean_under_ruff_and_mypy(tool):
    exe = shutil.which(tool, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[test]')")
    args = [exe, "check", "autosplit"] if tool == "ruff" else [exe]
    result = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_default_micro_batches_divide_the_batch_and_an_explicit_count_must():
    model, (tokens,) = _gpt()
    six = torch.randint(0, 30, (6, 8))
    assert autosplit.plan(model, ["cpu"] * 2, example_inputs=(six,), time_limit=1).micro_batches == 6  # ≤ 8, divides 6
    assert autosplit.plan(model, ["cpu"] * 3, example_inputs=(tokens,), time_limit=1).micro_batches == 4
    with pytest.raises(autosplit.errors.ConstraintError, match=r"micro_batches=4 does not divide the batch of 6 rows.*\[1, 2, 3, 6\]"):
        autosplit.Planner(model, ["cpu"] * 2, example_inputs=(six,), micro_batches=4)
