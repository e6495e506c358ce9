"""Plan files: versioned JSON, saved atomically, read field by field with each field's type."""

from __future__ import annotations

import dataclasses
import errno
import json
import os

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit import errors
from autosplit.plans import Plan
from tests.helpers import ADVICE_SHAPE, small_gpt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.layers(x))


@pytest.fixture(scope="module")
def plan() -> Plan:
    torch.manual_seed(0)
    return autosplit.plan(Net(), ["cpu"] * 2, example_inputs=(torch.randn(4, 8),), time_limit=2.0)


def test_a_saved_plan_loads_back_equal(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["schema_version"] == 3
    assert Plan.load(path) == plan
    assert Plan.from_dict(plan.to_dict()) == plan  # the in-memory form (tuples, not lists) reads too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


class _FullDisk:
    """A file whose write stores half the text, then fails as a full disk does."""

    def __init__(self, f):
        self.f, self.written = f, 0

    def write(self, text: str) -> int:
        self.written = self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _fail(where: str, monkeypatch, seen: list) -> None:
    if where == "write":
        real = os.fdopen

        def fdopen(*args, **kwargs):
            seen.append(_FullDisk(real(*args, **kwargs)))
            return seen[-1]

        monkeypatch.setattr(os, "fdopen", fdopen)
        return
    exc = KeyboardInterrupt() if where == "interrupt" else OSError(errno.EIO, "Input/output error")

    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr(os, {"fsync": "fsync", "interrupt": "fsync", "replace": "replace"}[where], boom)


@pytest.mark.parametrize("where", ["write", "fsync", "replace", "interrupt"])
def test_a_save_that_fails_part_way_leaves_the_old_file_and_no_temporary(plan, tmp_path, monkeypatch, where):
    path = tmp_path / "plan.json"
    dataclasses.replace(plan, micro_batches=2).save(path)
    before = path.read_bytes()
    seen: list = []
    _fail(where, monkeypatch, seen)
    with pytest.raises(KeyboardInterrupt if where == "interrupt" else errors.PlanFileError) as e:
        plan.save(path)
    monkeypatch.undo()
    if where == "write":
        assert seen and seen[0].written > 100, "the failure should come after some bytes were written"
    if where != "interrupt":
        assert str(path) in str(e.value)
        assert e.match(ADVICE_SHAPE)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"], "the temporary file was left behind"
    assert Plan.load(path).micro_batches == 2


def test_a_plan_that_cannot_be_encoded_touches_no_file(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    before = path.read_bytes()
    with pytest.raises(TypeError):
        dataclasses.replace(plan, timings={"trace": object()}).save(path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_saving_into_a_missing_folder_or_onto_a_folder_names_the_path_and_the_fix(plan, tmp_path):
    missing = tmp_path / "no" / "such" / "plan.json"
    with pytest.raises(errors.PlanFileError, match=ADVICE_SHAPE) as e:
        plan.save(missing)
    assert str(missing) in str(e.value) and f"mkdir -p {missing.parent}" in str(e.value)
    with pytest.raises(errors.PlanFileError, match="is a folder") as e:
        plan.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_saving_into_a_read_only_folder_is_a_typed_error(plan, tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: refuse as the file system would

        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(os, "open", refuse)
    try:
        with pytest.raises(errors.PlanFileError, match=ADVICE_SHAPE) as e:
            plan.save(folder / "plan.json")
    finally:
        folder.chmod(0o700)
    assert f"cannot save the plan to {folder / 'plan.json'}: PermissionError" in str(e.value)
    assert "may not write" in str(e.value)


def test_a_replaced_file_keeps_its_permissions_and_a_new_one_follows_the_umask(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    path.chmod(0o600)
    plan.save(path)
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda d: d.update(micro_batches="8"), "field micro_batches = '8' is a string, expected an integer"),
        (lambda d: d.update(micro_batches=2.5), "field micro_batches = 2.5 is a number, expected an integer"),
        (lambda d: d.update(assignment=[]), "field assignment = [] is a list of 0, expected an object"),
        (lambda d: d.update(stage_devices="0,1"), "field stage_devices = '0,1' is a string, expected a list"),
        (lambda d: d.update(step_time=None), "field step_time = None is null, expected a number"),
        (lambda d: d.update(solver=[1]), "field solver = [1] is a list of 1, expected an object"),
        (lambda d: d.update(made_with=["analytic"]), "field made_with = ['analytic'] is a list of 1, expected a list of 2 or null"),
        (lambda d: d.update(terms="fast"), "field terms = 'fast' is a string, expected an object or null"),
        (lambda d: d["stages"][0].update(compute="1"), "field stages[0].compute = '1' is a string, expected a number"),
        (lambda d: d["stages"][1].update(modules="layers"), "field stages[1].modules = 'layers' is a string, expected a list"),
        (lambda d: d["devices"][0].update(memory="16GiB"), "field devices[0].memory = '16GiB' is a string, expected an integer"),
        (lambda d: d["solver"].update(seed=None), "field solver.seed = None is null, expected an integer"),
        (lambda d: d["assignment"].update(x="0"), "field assignment['x'] = '0' is a string, expected an integer"),
        (lambda d: d.update(module_stages={"": [0, "1"]}), "field module_stages[''][1] = '1' is a string, expected an integer"),
        (lambda d: d.update(data_parallel=True), "field data_parallel = True is a boolean, expected an integer"),
        (lambda d: d.update(surprise=1), "unknown field 'surprise'"),
        (lambda d: d.update(precision="fp8"), "field precision = 'fp8' is not one of"),
        (lambda d: d.update(recompute=["h.0", "h.0"]), "field recompute = ['h.0', 'h.0'] does not name distinct blocks"),
        (lambda d: d["solver"].pop("gap"), "required field 'solver.gap' is missing"),
    ],
)
def test_every_field_is_read_with_its_type(plan, tmp_path, edit, named):
    data = json.loads(json.dumps(plan.to_dict()))
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(errors.PlanFileError, match=ADVICE_SHAPE) as e:
        Plan.load(path)
    assert str(path) in str(e.value) and named in str(e.value), str(e.value)


def test_a_file_that_is_not_an_object_and_counts_written_as_floats(plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("[1, 2]")
    with pytest.raises(errors.PlanFileError, match=r"the plan is a list \(\[1, 2\]\), expected an object"):
        Plan.load(path)
    data = json.loads(json.dumps(plan.to_dict()))
    data["micro_batches"] = 4.0
    data["devices"][0]["memory"] = float(data["devices"][0]["memory"])
    loaded = Plan.from_dict(data)
    assert loaded.micro_batches == 4 and isinstance(loaded.micro_batches, int)
    assert isinstance(loaded.devices[0].memory, int)


def test_plan_round_trips_through_json(tmp_path):
    model, inputs = small_gpt()
    plan = autosplit.plan(model, ["cpu", "A100-80GB"], example_inputs=inputs, time_limit=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 3 and data["objective"] == "pipeline" and data["fingerprint"] == plan.fingerprint
    assert {"torch", "ortools"} <= set(data["versions"])
    loaded = autosplit.Plan.load(path)
    assert loaded == plan


def test_unknown_schema_version_is_rejected(tmp_path):
    model, inputs = small_gpt()
    plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2)
    data = plan.to_dict() | {"schema_version": 99}
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(autosplit.errors.PlanFileError, match="schema version 99"):
        autosplit.Plan.load(tmp_path / "p.json")
