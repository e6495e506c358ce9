"""The schedule registry (autosplit/schedules.py): every entry's rules, name lookup, torch's
schedules autosplit cannot run yet refused by name, and ``Plan.objective`` in plan files."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing

import pytest
import torch

import autosplit
from autosplit import schedules
from autosplit.errors import ConstraintError, PlanFileError
from autosplit.options import PlanOptions
from autosplit.plans import SCHEMA_VERSION, Plan
from autosplit.report.timeline import stage_order
from autosplit.solver.build import in_flight, weight_copies
from tests.helpers import GOLDEN, ROOT, LinearStack

ONE_PER_RANK = ("sequential", "gpipe", "1f1b", "xpipe", "async", "pipedream")
MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


# -- the formulas as they were written before the registry ------------------------------------------
def old_in_flight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    if schedule == "sequential":
        return 1
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, stages - stage)
    assert schedule in ("xpipe", "async", "pipedream")
    return stages - stage


def old_stage_order(schedule: str, stage: int, stages: int, M: int) -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("forward", m) for m in range(M)] + [("backward", m) for m in range(M)]
    if schedule == "1f1b":
        warmup = min(stages - stage - 1, M)
        order = [("forward", m) for m in range(warmup)]
        for m in range(M - warmup):
            order += [("forward", warmup + m), ("backward", m)]
        return order + [("backward", m) for m in range(M - warmup, M)]
    assert schedule == "sequential"
    return [(kind, m) for m in range(M) for kind in ("forward", "backward")]


def _plan(**options) -> Plan:
    torch.manual_seed(0)
    return autosplit.plan(LinearStack(), ["cpu"] * 2, example_inputs=(torch.randn(4, 8),), time_limit=2.0, **options)


# -- the entries -----------------------------------------------------------------------------------
def test_the_runnable_schedules_are_the_option_literal_in_the_old_order():
    assert schedules.SCHEDULES == (*ONE_PER_RANK, *(name.lower() for name in MULTI))
    assert typing.get_args(schedules.ScheduleName) == schedules.SCHEDULES
    assert schedules.ASYNCHRONOUS == ("xpipe", "async", "pipedream")
    hint = typing.get_args(typing.get_type_hints(PlanOptions)["schedule"])  # ScheduleName | Literal["auto"]
    assert typing.get_args(hint[0]) == schedules.SCHEDULES and typing.get_args(hint[1]) == ("auto",)


@pytest.mark.parametrize("name", ONE_PER_RANK)
def test_every_one_stage_entry_holds_the_old_in_flight_rule(name):
    entry = schedules.REGISTRY[name]
    for S in range(1, 7):
        for M in range(1, 11):
            want = [old_in_flight(name, s, S, M) for s in range(S)]
            assert [entry.in_flight(s, S, M) for s in range(S)] == want, (name, S, M)
            assert [in_flight(name, s, S, M) for s in range(S)] == want


@pytest.mark.parametrize("name", ["sequential", "gpipe", "1f1b"])
def test_every_flushed_entry_keeps_the_old_stage_order(name):
    for S in range(1, 6):
        for M in range(1, 9):
            for s in range(S):
                assert stage_order(name, s, S, M) == old_stage_order(name, s, S, M), (name, S, M, s)


def test_entries_say_what_the_code_used_to_ask_by_name():
    R = schedules.REGISTRY
    assert {n for n in schedules.SCHEDULES if R[n].asynchronous} == {"xpipe", "async", "pipedream"}
    assert all(R[n].flushes != R[n].asynchronous for n in schedules.SCHEDULES)
    # the torch class that runs it: the old SCHEDULE_CLASSES, nothing for the rest
    assert {n: R[n].torch_class for n in ONE_PER_RANK} == {
        "sequential": None, "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "xpipe": None, "async": None, "pipedream": None,
    }
    assert [n for n in ONE_PER_RANK if R[n].distributed] == ["gpipe", "1f1b", "xpipe", "async", "pipedream"]
    assert [n for n in schedules.SCHEDULES if R[n].forwards_first] == ["gpipe"]
    assert [n for n in schedules.SCHEDULES if not R[n].micro_batched] == ["sequential"]
    assert [R[n].fewest_micro_batches(4) for n in ("gpipe", "1f1b")] == [1, 4]
    assert R["dualpipev"].fewest_micro_batches(4, ranks=2) == 4
    assert {n: R[n].weights for n in schedules.ASYNCHRONOUS} == {"xpipe": "predicted", "async": "current", "pipedream": "stashed"}
    for n in ONE_PER_RANK:
        assert R[n].stages_per_rank == (1, 1) and R[n].placement == "linear" and not R[n].split_backward and R[n].runnable
    for name in MULTI:
        entry = schedules.lookup(name)
        assert entry.runnable and entry.distributed and entry.flushes and entry.order == "torch"
    # the closed form is exact for torch's one-stage-per-rank, whole-backward schedules only
    assert [n for n in schedules.SCHEDULES if R[n].replayed(1)] == ["interleavedzerobubble", "zbvzerobubble", "dualpipev"]
    assert all(R[n.lower()].replayed(2) for n in MULTI) and not R["xpipe"].replayed(2), "torch runs it, several stages a rank"


@pytest.mark.parametrize("name", schedules.SCHEDULES)
def test_weight_copies_follow_the_weights_a_forward_reads(name):
    for S, M in ((4, 1), (4, 2), (3, 4)):
        copies = weight_copies(name, S, M)
        if name not in ("pipedream", "xpipe"):  # the old rule: no copies but for these two
            assert copies == (0,) * S
        else:
            assert any(copies) and copies[-1] == 0, "the last stage updates right after its backward"


def test_torch_schedule_classes_are_all_known_and_exist():
    import torch.distributed.pipelining as pipelining

    public = {n for n in dir(pipelining) if n.startswith("Schedule")}
    assert public <= {e.torch_class for e in schedules.REGISTRY.values()}, "a torch schedule the registry does not know"
    for entry in schedules.REGISTRY.values():
        if entry.torch_class is not None:
            assert hasattr(pipelining, entry.torch_class), entry.torch_class
    for name in MULTI:
        assert schedules.lookup(name).torch_class == f"Schedule{name}"
    assert schedules.lookup("ZBVZeroBubble").placement == "v" and schedules.lookup("DualPipeV").stages_per_rank == (2, 2)
    assert schedules.lookup("InterleavedZeroBubble").split_backward and schedules.lookup("Interleaved1F1B").placement == "loop"


def test_the_registry_imports_no_torch():
    code = ("import sys, types; pkg = types.ModuleType('autosplit'); "
            f"pkg.__path__ = [{str(ROOT / 'autosplit')!r}]; sys.modules['autosplit'] = pkg; "
            "import autosplit.schedules; sys.exit(1 if any(m.startswith('torch') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# -- names -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, canonical", [
    ("1f1b", "1f1b"), ("1F1B", "1f1b"), ("Schedule1F1B", "1f1b"), ("schedule1f1b", "1f1b"),
    ("gpipe", "gpipe"), ("GPipe", "gpipe"), ("ScheduleGPipe", "gpipe"), ("XPipe", "xpipe"), ("Sequential", "sequential"),
    ("ScheduleInterleaved1F1B", "interleaved1f1b"), ("zbvzerobubble", "zbvzerobubble"), ("DualPipeV", "dualpipev"),
])
def test_lookup_ignores_case_and_reads_torch_class_names(name, canonical):
    assert schedules.lookup(name).name == canonical


@pytest.mark.parametrize("name", ["zigzag", "", None, 3, "Schedule"])
def test_an_unknown_schedule_is_a_typed_error_naming_the_known_ones(name):
    with pytest.raises(ConstraintError) as e:
        schedules.lookup(name)
    text = str(e.value)
    assert f"unknown schedule {name!r}" in text
    for known in schedules.REGISTRY:
        assert repr(known) in text


def test_makespan_is_named_an_objective():
    with pytest.raises(ConstraintError, match=r"'makespan' is an objective, not a schedule.*objective='makespan'"):
        schedules.lookup("makespan")


def test_options_store_the_registry_name():
    assert PlanOptions(schedule="Schedule1F1B").schedule == "1f1b"
    assert PlanOptions(schedule="GPipe").schedule == "gpipe"
    assert _plan(schedule="1F1B", micro_batches=2).schedule == "1f1b"


# -- several stages per rank ----------------------------------------------------------------------
@pytest.mark.parametrize("name, v", [("ZBVZeroBubble", 3), ("DualPipeV", 1), ("gpipe", 2), ("Interleaved1F1B", 0)])
def test_stages_per_rank_a_schedule_cannot_run_are_refused_at_plan_time(name, v):
    with pytest.raises(ConstraintError, match=r"option stages_per_rank=.* is out of range"):
        PlanOptions(schedule=name, stages_per_rank=v)


def test_a_v_schedule_takes_two_stages_per_rank_by_default():
    assert PlanOptions(schedule="zbvzerobubble").rank_stages == 2 and PlanOptions(schedule="interleaved1f1b").rank_stages == 1
    plan = _plan(schedule="ZBVZeroBubble", micro_batches=4)
    assert plan.stages_per_rank == 2 and plan.stage_devices == (0, 1, 1, 0) and len(plan.rank_memory) == 2


# -- Plan.objective in plan files -----------------------------------------------------------------
def test_objective_round_trips(tmp_path):
    plan = _plan()
    assert plan.objective == "pipeline" and plan.schema_version == SCHEMA_VERSION == 3
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["objective"] == "pipeline" and data["schema_version"] == 3
    assert Plan.load(tmp_path / "plan.json") == plan

    torch.manual_seed(0)
    planner = autosplit.Planner(LinearStack(), ["cpu"] * 2, example_inputs=(torch.randn(4, 8),), objective="makespan", time_limit=2)
    makespan = planner.plan()
    assert makespan.objective == "makespan" and makespan.schedule == "makespan", "the schedule string stays as it was"
    makespan.save(tmp_path / "makespan.json")
    loaded = Plan.load(tmp_path / "makespan.json")
    assert loaded == makespan
    assert planner.plan(loaded).objective == "makespan"


def test_a_version_2_file_still_loads():
    v2 = json.loads((GOLDEN / "gpt_a100x2_gpipe.v2.plan.json").read_text())
    assert v2["schema_version"] == 2 and "objective" not in v2
    old = Plan.load(GOLDEN / "gpt_a100x2_gpipe.v2.plan.json")
    assert old.objective == "pipeline" and old.schedule == "gpipe" and old.schema_version == SCHEMA_VERSION
    new = Plan.load(GOLDEN / "gpt_a100x2_gpipe.plan.json")
    assert old.rank_memory == () and old.stages_per_rank == 1 and old.batch == 0 and old.parameters == (), "written before these existed"
    assert all(st.sparse_param_bytes == st.row_grad_bytes == 0 for st in old.stages), "nor did the rows of sparse gradients"
    stages = tuple(dataclasses.replace(o, sparse_param_bytes=n.sparse_param_bytes, row_grad_bytes=n.row_grad_bytes)
                   for o, n in zip(old.stages, new.stages))
    assert dataclasses.replace(old, rank_memory=new.rank_memory, stages=stages, batch=new.batch, parameters=new.parameters) == new, \
        "version 3 adds the objective, nothing else"


def test_a_version_2_makespan_plan_reads_its_objective_from_its_schedule(tmp_path):
    torch.manual_seed(0)
    plan = autosplit.plan(LinearStack(), ["cpu"] * 2, example_inputs=(torch.randn(4, 8),), objective="makespan", time_limit=2)
    data = plan.to_dict()
    del data["objective"]
    data["schema_version"] = 2
    old = Plan.from_dict(data)
    assert old.objective == "makespan" and old == plan


@pytest.mark.parametrize("edit, named", [
    (lambda d: d.pop("objective"), "'objective'"),
    (lambda d: d.update(objective="fastest"), "objective"),
    (lambda d: d.update(schedule="makespan"), "schedule"),
    (lambda d: d.update(schedule="ZBVZeroBubble"), "stages_per_rank"),
    (lambda d: d.update(schema_version=1), "schema version 1"),
])
def test_version_3_files_are_checked(edit, named):
    data = _plan().to_dict()
    edit(data)
    with pytest.raises(PlanFileError) as e:
        Plan.from_dict(data, source="plan.json")
    assert named in str(e.value)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev"])
def test_the_registrys_rules_are_torchs(name):
    """refusal() says no exactly where torch's class refuses to be built (its schedule visualizer
    builds the class over stand-in stages)."""
    import warnings

    from torch.distributed.pipelining import _schedule_visualizer

    entry = schedules.lookup(name)
    multi = entry.order == "torch"
    for pp in (2, 4):
        for v in ((2, 3) if multi else (1,)):
            for M in range(1, 10):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        _schedule_visualizer.get_schedule_ops(entry.torch_class.removeprefix("Schedule"), pp, M, v)
                        torch_runs = True
                    except ValueError:
                        torch_runs = False
                assert (entry.refusal(ranks=pp, stages=pp * v, micro_batches=M) is None) == torch_runs, (pp, v, M)


def test_placement_is_torchs_stage_to_rank_map():
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    for name, style in (("interleaved1f1b", "loop"), ("zbvzerobubble", "v"), ("dualpipev", "v")):
        entry = schedules.lookup(name)
        for pp in (2, 3, 4):
            S = 2 * pp
            assert {s: entry.rank_of(s, S, pp) for s in range(S)} == generate_stage_to_rank_mapping(pp, S, style=style)


def test_a_broken_rule_is_a_typed_error_naming_it():
    with pytest.raises(ConstraintError, match=r"at least as many micro-batches as stages \(8\), not 4.*micro_batches in \[8"):
        schedules.lookup("DualPipeV").check(ranks=4, stages=8, micro_batches=4)
    with pytest.raises(ConstraintError, match=r"exactly 2 stage\(s\) per rank, not 3"):
        schedules.lookup("ZBVZeroBubble").check(ranks=2, stages=6, micro_batches=4)
    with pytest.raises(ConstraintError, match=r"rounds of max\(1, M // pp\) = 2, which must divide M = 5"):
        schedules.lookup("Interleaved1F1B").check(ranks=2, stages=4, micro_batches=5)
