"""Errors name the real cause.

Every ``raise`` in the library is walked (AST) and must build its message with
``advice(what, why, fix)``, all three given; then typical mistakes are made for real and each
message is checked for that shape and for the field, option or constraint it must name.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit import errors
from autosplit.plans import Plan

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "autosplit").rglob("*.py"))
SHAPE = re.compile(r".+\. Likely cause: .+\. Try: .+\.", re.DOTALL)


def _advice_call(node: ast.AST) -> bool:
    """``advice(what, why, fix)`` with all three given and none of them ``None``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "advice"):
        return False
    args = [*node.args, *(k.value for k in node.keywords)]
    return len(args) == 3 and not any(isinstance(a, ast.Constant) and a.value is None for a in args)


def _message_helpers(trees: list[ast.Module]) -> set[str]:
    """Functions of the library (nested ones too) whose every ``return`` is a full ``advice(...)``,
    a call of another such function, or an error built from one (``ConstraintError(advice(...))``)."""
    functions = [fn for tree in trees for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)]
    helpers: set[str] = set()

    def builds_message(value: ast.AST) -> bool:
        if _advice_call(value):
            return True
        if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Name):
            return False
        return value.func.id in helpers or (bool(value.args) and builds_message(value.args[0]))

    grown = True
    while grown:  # a fixed point: helpers may call helpers
        grown = False
        for fn in functions:
            returns = [r.value for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value is not None]
            if fn.name not in helpers and returns and all(builds_message(r) for r in returns):
                helpers.add(fn.name)
                grown = True
    return helpers


def _internal(tree: ast.Module) -> set[str]:
    """Private exception classes a module defines and catches itself: control flow that never reaches a user."""
    defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("_")}
    caught = {ast.unparse(h.type) for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler) and h.type is not None}
    return defined & caught


def _raises():
    trees = {path: ast.parse(path.read_text()) for path in LIBRARY}
    helpers = _message_helpers(list(trees.values()))
    for path, tree in trees.items():
        internal = _internal(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and not (
                isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name) and node.exc.func.id in internal
            ):
                yield path.relative_to(ROOT), node, helpers


def test_every_raise_says_what_why_and_what_to_try():
    bad = []
    for path, node, helpers in _raises():
        exc = node.exc
        if exc is None or isinstance(exc, ast.Name):  # re-raising what was caught
            continue
        if isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) and exc.func.id in helpers:
            continue  # a local helper that builds the whole error with advice()
        ok = (
            isinstance(exc, ast.Call)
            and isinstance(exc.func, ast.Name)
            and issubclass(getattr(errors, exc.func.id, Exception), errors.AutosplitError)
            and exc.args
            and (
                _advice_call(exc.args[0])
                or (isinstance(exc.args[0], ast.Call) and getattr(exc.args[0].func, "id", None) in helpers)
            )
        )
        if not ok:
            bad.append(f"{path}:{node.lineno}: {ast.unparse(exc)[:100]}")
    assert not bad, "raises without a typed AutosplitError and advice(what, why, fix):\n" + "\n".join(bad)


def test_the_walk_sees_the_library():
    found = list(_raises())
    assert len(found) > 50, "the AST walk found too few raises: is LIBRARY right?"


# -- the messages, for real ---------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.layers(x))


def _plan(**options):
    return autosplit.plan(Net(), ["cpu"] * 2, example_inputs=(torch.randn(4, 8),), time_limit=2.0, **options)


def _says(excinfo, *names):
    text = str(excinfo.value)
    assert SHAPE.fullmatch(text), f"message without what → why → try: {text!r}"
    for name in names:
        assert name in text, f"{name!r} not named in: {text}"


@pytest.mark.parametrize(
    "option, value",
    [
        ("time_limit", -1), ("time_limit", float("inf")), ("micro_batches", 0), ("micro_batches", 2.5),
        ("schedule", "zigzag"), ("optimizer", "lion"), ("capture", "jit"), ("costs", "guessed"),
        ("seed", "0"), ("data_parallel", 0), ("memory", {0: "lots"}), ("memory", {-1: "8GiB"}),
        ("pin", ["layers.0"]), ("avoid", {"head": [1.5]}), ("together", "head"), ("cost_overrides", {1: {}}),
        ("limits", {"dp_work": 1}), ("cut_margin", -0.01), ("cut_margin", 1.0), ("cut_margin", True),
        ("gap", -0.01), ("gap", 1.0), ("gap", True), ("gap", "1%"),
    ],
)
def test_bad_options_are_refused_up_front(option, value):
    with pytest.raises((errors.ConstraintError, errors.DeviceError)) as e:
        autosplit.PlanOptions(**{option: value})
    _says(e, option if option != "memory" or value != {0: "lots"} else "lots")


@pytest.mark.parametrize("field, value", [("dp_work", 0), ("cpsat_vars", -1), ("max_blocks", 2.5), ("free_span", True),
                                          ("makespan_units", "150")])
def test_bad_solver_limits_are_refused_up_front(field, value):
    with pytest.raises(errors.ConstraintError) as e:
        autosplit.options.SolverLimits(**{field: value})
    _says(e, field, "≥ 1")


def test_unknown_option_lists_the_legal_ones():
    with pytest.raises(errors.ConstraintError) as e:
        _plan(time_limt=1.0)
    _says(e, "time_limt", "time_limit")


@pytest.mark.parametrize("devices, memory, named", [([], None, "no devices"), (["tpu:0"], None, "tpu"),
                                                   (["cpu"] * 2, {5: "1GiB"}, "5"), (["cpu"] * 2, {"cuda:3": "1GiB"}, "cuda:3")])
def test_bad_devices_and_caps(devices, memory, named):
    with pytest.raises(errors.DeviceError) as e:
        autosplit.plan(Net(), devices, example_inputs=(torch.randn(4, 8),), memory=memory)
    _says(e, named)


def test_a_batch_too_small_for_the_schedule_is_refused_before_capture(monkeypatch):
    """1F1B needs as many micro-batches as stages: 4 rows cannot feed 8 stages, said when the Planner is made."""
    import autosplit.api.planner as planner

    monkeypatch.setattr(planner, "trace", lambda *a, **k: pytest.fail("captured before refusing"))
    with pytest.raises(errors.ConstraintError) as e:
        autosplit.Planner(Net(), ["cpu"] * 8, example_inputs=(torch.randn(4, 8),), schedule="1f1b")
    _says(e, "1f1b", "8 stages", "4 rows", "at least as many micro-batches as stages")


def test_conflicting_constraints_lead_when_memory_is_ample():
    with pytest.raises(errors.InfeasiblePlanError) as e:
        _plan(pin={"layers.0": 0, "head": 1}, together=[("layers.0", "head")])
    text = str(e.value)
    _says(e, "layers.0", "head")
    assert text.startswith("these placement constraints cannot all hold"), text
    assert "memory caps" not in text.split("Likely cause")[0]


def test_short_memory_names_the_device_cap_and_least_need():
    with pytest.raises(errors.InfeasiblePlanError) as e:
        _plan(memory={"cpu": "6KiB"})
    _says(e, "no plan fits the memory caps of stage", "(cap 6.00 KiB)", "least memory any plan needs")


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "plan.json"
    _plan().save(path)
    return path


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d["assignment"].update({next(iter(d["assignment"])): 7}), "assignment["),
        (lambda d: d.update(stage_devices=[0, 0]), "stage_devices[1]"),
        (lambda d: d.update(stages=d["stages"][:1]), "stages"),
        (lambda d: d.update(micro_batches=0), "micro_batches"),
        (lambda d: d.update(schedule="zigzag"), "schedule"),
        (lambda d: d.update(step_time=-1.0), "step_time"),
        (lambda d: d.update(assignment={}), "assignment"),
        (lambda d: d.update(crossings=[["no_such_node"]]), "crossings[0]"),
        (lambda d: d.update(schema_version=1), "schema version 1"),
        (lambda d: d.pop("devices"), "'devices'"),
    ],
)
def test_plan_files_are_checked_field_by_field(saved, edit, field):
    data = json.loads(saved.read_text())
    edit(data)
    saved.write_text(json.dumps(data))
    with pytest.raises(errors.PlanFileError) as e:
        Plan.load(saved)
    _says(e, str(saved), field)


def test_edited_node_names_are_named(saved):
    data = json.loads(saved.read_text())
    name = next(iter(data["assignment"]))
    data["assignment"]["renamed"] = data["assignment"].pop(name)
    saved.write_text(json.dumps(data))
    with pytest.raises(errors.PlanFileError) as e:
        autosplit.autosplit(Net(), ["cpu"] * 2, example_inputs=(torch.randn(4, 8),), plan=str(saved))
    _says(e, "assignment", name, "renamed")


def test_unreadable_plan_file(tmp_path):
    with pytest.raises(errors.PlanFileError) as e:
        Plan.load(tmp_path / "missing.json")
    _says(e, "missing.json")


class SharedTwice(nn.Module):
    """``mul`` sits between two calls of ``shared``, so it shares their stage: two parts, not three."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)

    def forward(self, x, bias, scale: float = 1.0):
        h = self.shared(x)
        _ = x + bias
        return self.shared(h * scale)


def test_too_few_parts_for_the_devices_is_not_blamed_on_memory():
    x, kwargs = torch.randn(3, 4), {"bias": torch.randn(4), "scale": 0.5}
    autosplit.plan(SharedTwice(), ["cpu"] * 2, example_inputs=(x,), example_kwargs=kwargs, time_limit=2.0)
    with pytest.raises(errors.InfeasiblePlanError) as e:
        autosplit.plan(SharedTwice(), ["cpu"] * 3, example_inputs=(x,), example_kwargs=kwargs, time_limit=2.0)
    _says(e, "3 devices cannot each get a non-empty stage", "fewer devices")
    assert "memory caps" not in str(e.value)


@pytest.mark.parametrize("former, new", [("ddp", "replicate"), ("fsdp", "fully_shard"), ("DDP", "replicate")])
def test_former_replicate_names_are_refused_naming_torchs(former, new):
    """``distribute(replicate=...)`` takes torch's names; ``"ddp"`` / ``"fsdp"`` are refused before any
    work (no process group needed), naming the one that replaced each."""
    with pytest.raises(errors.ConstraintError) as e:
        autosplit.distribute(Net(), ["cpu"] * 2, example_inputs=(torch.randn(4, 8),), loss_fn=torch.nn.functional.mse_loss,
                             replicate=former)
    _says(e, f"replicate={former!r}", repr(new))


def test_an_unknown_replicate_names_both_of_torchs():
    with pytest.raises(errors.ConstraintError) as e:
        autosplit.distribute(Net(), ["cpu"] * 2, example_inputs=(torch.randn(4, 8),), loss_fn=torch.nn.functional.mse_loss,
                             replicate="zero3")
    _says(e, "zero3", "'replicate'", "'fully_shard'")
