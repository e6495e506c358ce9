"""The plan: which device runs each node, what that is predicted to cost, and how it was found.

Plans are small versioned JSON (never pickle): schema version, library versions, graph
fingerprint, devices, assignment, per-stage predictions and solver provenance. A manual
split is a plan too, so comparing the two is comparing two files. ``save`` is atomic (a
temporary file in the same folder, renamed over the target); ``load`` reads every field as its
annotated type, then checks its range, and names the first field that is wrong.

Usage::

    print(plan)                  # the partition report
    plan.save("plan.json")
    plan = Plan.load("plan.json")
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import reprlib
import secrets
import shutil
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autosplit.devices import DeviceSpec
from autosplit.errors import PlanFileError, PlanMismatchError, advice
from autosplit.units import format_ms as _ms

__all__ = ["Plan", "StageReport", "SolverInfo", "SharedParam", "StepTerms", "PartialRecompute", "SCHEMA_VERSION"]

SCHEMA_VERSION = 3
"""Version 3 added :attr:`Plan.objective`; a version-2 file is read with it derived from its schedule."""


@dataclass(frozen=True)
class PartialRecompute:
    """A recomputed block that keeps the activations of some of its stage's micro-batches.

    A flushed schedule runs each stage's forwards and backwards in micro-batch order, so the
    micro-batches a stage holds at once are consecutive, at most ``window`` of them (its in-flight
    count at the peak). Micro-batch ``i`` keeps its activations iff ``i mod window < keep``: any
    ``window`` consecutive micro-batches hold exactly ``keep`` kept, and the rest recompute — the
    "partial activation checkpointing" of NeMo and torchtitan, chosen by the plan."""

    block: str
    keep: int
    window: int

    def recomputes(self, micro_batch: int) -> bool:
        """Whether micro-batch ``micro_batch`` of a step recomputes the block in its backward."""
        return micro_batch % self.window >= self.keep

    def recomputed(self, micro_batches: int) -> int:
        """How many of a step's ``micro_batches`` recompute the block."""
        return sum(self.recomputes(i) for i in range(micro_batches))


@dataclass(frozen=True)
class StageReport:
    """Predicted figures of one stage (seconds, bytes)."""

    device: str
    nodes: int
    params: int
    modules: tuple[str, ...]
    """Modules (two levels deep, e.g. ``blocks.3``) whose parameters the stage holds, in order."""
    compute: float
    """Forward + backward seconds for the whole batch, and the optimizer step of the stage's parameters."""
    transfer: float
    """Seconds spent at the stage's boundaries (activations forward, gradients back)."""
    time: float
    memory_state: int
    """Parameters + gradients + optimizer state + buffers."""
    memory_activations: int
    memory_received: int
    memory_transient: int
    """Room kept for the largest tensor one op produces."""
    capacity: int
    memory_sent: int = 0
    """Outputs sent to later stages, held until their gradients return."""
    memory_buffers: int = 0
    """Buffers torch's stage keeps all step for the gradients of the outputs it sends, one per micro-batch
    (:attr:`memory_received` holds the receiving side's: a buffer per micro-batch and its gradient)."""
    forward: float = 0.0
    """Forward seconds of the whole batch (part of :attr:`compute`)."""
    backward: float = 0.0
    """Backward seconds of the whole batch (part of :attr:`compute`; the rest is the optimizer step)."""
    backward_weight: float = 0.0
    """Of :attr:`backward`, the seconds of the gradient to the weights (W, which zero-bubble schedules run apart)."""
    param_bytes: int = 0
    """Bytes of the parameters the stage owns (what its gradient all-reduce moves)."""
    sparse_param_bytes: int = 0
    """Of :attr:`param_bytes`, embedding tables whose gradient is non-zero only in the rows looked up."""
    row_grad_bytes: int = 0
    """Bytes of those rows (with their indices) per step: what each replica contributes when the
    tables' gradients are all-gathered as rows instead of all-reduced whole."""
    recompute: tuple[str, ...] = ()
    """Blocks (module paths) the stage recomputes in its backward (part of :attr:`backward`)."""
    recompute_saves: int = 0
    """Bytes of activations the stage does not hold because it recomputes :attr:`recompute`."""

    @property
    def memory(self) -> int:
        return (
            self.memory_state + self.memory_activations + self.memory_received + self.memory_sent + self.memory_buffers
            + self.memory_transient
        )


@dataclass(frozen=True)
class PlannedTask:
    """One task of a makespan plan (DLPlacer): a node's forward or backward on a device, timed."""

    node: str
    kind: str
    """``"forward"`` or ``"backward"`` (with the node's share of the optimizer step)."""
    device: int
    start: float
    end: float


@dataclass(frozen=True)
class SolverInfo:
    name: str
    status: str
    objective: float
    """The plan's value under the solver's model (the schedule over stage times, each stage's
    optimizer step inside its compute), seconds: what :attr:`bound` bounds."""
    bound: float
    """Proven lower bound on the step time of any plan, seconds."""
    gap: float
    wall_time: float
    time_limit: float
    seed: int
    baseline: float | None = None
    """Predicted step time of the dynamic program's plan (contiguous split of one order), seconds."""
    units: int = 0
    """Units the solver placed: graph nodes, or blocks after coarsening."""
    step_bound: float | None = None
    """Where the step is replayed from torch's action lists (several stages per rank, or a split
    backward), :attr:`objective` and :attr:`bound` are the schedule's closed form, a surrogate; this
    is a proven lower bound on :attr:`Plan.step_time` itself over every split of the plan's schedule,
    micro-batches and stages per rank (``autosplit.compiler.prediction.step_bound``: all the work
    spread evenly over the ranks). ``None`` where :attr:`bound` bounds the step's own model."""


@dataclass(frozen=True)
class SharedParam:
    """A parameter read on several stages (a tied weight) and how the runtime shares it."""

    name: str
    """Its qualified name, e.g. ``wte.weight``."""
    stages: tuple[int, ...]
    """The stages that read it (the first one owns it in the cost table)."""
    policy: str
    """``"replicate"`` (a copy per stage, gradients summed once per step) or ``"send"`` (with every micro-batch)."""
    send: float
    """Seconds per step it would cost sent with every micro-batch (and its gradient back)."""
    replicate: float
    """Seconds per step it would cost replicated (one all-reduce of its gradient)."""


@dataclass(frozen=True)
class StepTerms:
    """What the predicted step is made of (seconds); :attr:`Plan.step_time` is their sum."""

    pipeline: float
    """The schedule over stage times, compute and transfers: ``Σ_s τ_s + (M − 1)·max_s τ_s`` (GPipe)."""
    overhead: float = 0.0
    """The runtime's fixed cost per micro-batch and stage, over the ``S + M − 1`` slots of the schedule."""
    optimizer: float = 0.0
    """The slowest stage's optimizer step (stages step in parallel after the last backward)."""
    tied_sync: float = 0.0
    """All-reduce of replicated tied parameters' gradients."""
    data_parallel: float = 0.0
    """The part of each stage's gradient all-reduce over the replicas not hidden behind the last backward."""

    @property
    def total(self) -> float:
        return self.pipeline + self.overhead + self.optimizer + self.tied_sync + self.data_parallel


@dataclass(frozen=True)
class Alternative:
    """One configuration the planner's search tried (``schedule="auto"`` and the like), split by the DP."""

    schedule: str
    stages_per_rank: int
    micro_batches: int
    step_time: float
    """Predicted (replayed) seconds per step; infinite when no split fits."""
    rank_memory: tuple[int, ...] = ()
    """[device] peak bytes of its stages together."""
    note: str = ""
    """Why no split fits, when none does."""

    @property
    def fits(self) -> bool:
        return math.isfinite(self.step_time)


@dataclass(frozen=True)
class Plan:
    """A placement of every graph node on a device, with its predicted costs."""

    assignment: Mapping[str, int]
    """Graph node name → device index (into :attr:`devices`); with several stages per rank, → stage."""
    devices: tuple[DeviceSpec, ...]
    stage_devices: tuple[int, ...]
    """Device index of each pipeline stage, in execution order (stage 0 takes the inputs); with
    several stages per rank each device appears once per stage it runs (torch's loop or V)."""
    stages: tuple[StageReport, ...]
    step_time: float
    """Predicted seconds per training step (all micro-batches, forward and backward)."""
    micro_batches: int
    schedule: str
    """The schedule the plan was made for (:mod:`autosplit.schedules`); a makespan plan writes ``"makespan"``."""
    objective: str = field(kw_only=True)
    """What the solver minimised: ``"pipeline"`` (the schedule's step) or ``"makespan"`` (one step's
    tasks on any device, DLPlacer); read this, not :attr:`schedule`, to tell them apart."""
    solver: SolverInfo
    fingerprint: str
    capture: str
    costs: str = "analytic"
    """Where the costs came from: ``analytic``, ``measured``, a given table, and overrides."""
    versions: Mapping[str, str] = field(default_factory=dict)
    timings: Mapping[str, float] = field(default_factory=dict)
    """Seconds each pass took while planning."""
    terms: StepTerms | None = None
    """What :attr:`step_time` is made of."""
    shared_params: tuple[SharedParam, ...] = ()
    """Parameters read on several stages and how each is shared (chosen by cost)."""
    data_parallel: int = 1
    """Replicas of the split model the prediction counts (hybrid data × pipeline parallelism)."""
    crossings: tuple[tuple[str, ...], ...] = ()
    """[boundary k − 1] the tensors stage k − 1 sends stage k, in order (the distributed runtime's
    positional interface; recorded when the plan is run distributed)."""
    module_stages: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Module path (every level; ``""`` the root) → the stages its nodes run on: the module tree by stage."""
    tasks: tuple[PlannedTask, ...] = ()
    """Makespan plans (``objective="makespan"``): every node's forward and backward task, timed;
    each device runs its tasks in start order, as soon as their inputs arrive."""
    stages_per_rank: int = 1
    """Stages each device runs (:attr:`PlanOptions.stages_per_rank`); its stages' ranks are :attr:`stage_devices`."""
    rank_memory: tuple[int, ...] = ()
    """[device] peak bytes of its stages together, from the replayed schedule (empty: the stage rows')."""
    alternatives: tuple[Alternative, ...] = ()
    """The configurations a search tried (options left ``"auto"``), fastest first; empty without a search."""
    precision: str = "fp32"
    """The precision the plan was costed for and its stages run in (:attr:`PlanOptions.precision`)."""
    recompute: tuple[str, ...] = ()
    """Blocks (module paths) whose activations the stages recompute in the backward instead of keeping."""
    recompute_partial: tuple[PartialRecompute, ...] = ()
    """Of :attr:`recompute`, the blocks that keep some micro-batches' activations (the rest recompute
    all of theirs)."""
    made_with: tuple[str, float] | None = None
    """For a saved plan re-costed on load: (the costs it was made with, the step it predicted then)."""
    schema_version: int = SCHEMA_VERSION

    @property
    def step_gap(self) -> float | None:
        """How far :attr:`step_time` may be above the best split's, at most: (step − :attr:`SolverInfo.step_bound`) / step."""
        bound = self.solver.step_bound
        return None if bound is None or not self.step_time > 0 else max(0.0, (self.step_time - bound) / self.step_time)

    @property
    def stage_of(self) -> dict[str, int]:
        """Graph node name → pipeline stage."""
        if self.stages_per_rank > 1:
            return dict(self.assignment)
        stage = {d: s for s, d in enumerate(self.stage_devices)}
        return {name: stage[d] for name, d in self.assignment.items()}

    @property
    def bottleneck(self) -> int:
        return max(range(len(self.stages)), key=lambda s: self.stages[s].time)

    def check_fingerprint(self, fingerprint: str, nodes: set[str]) -> None:
        """Raise :class:`PlanMismatchError` unless the plan was made for this graph (and
        :class:`PlanFileError` when it claims to be but names other nodes: an edited file)."""
        planned = set(self.assignment)
        extra, gone = sorted(nodes - planned), sorted(planned - nodes)
        if fingerprint == self.fingerprint:
            if extra or gone:
                raise PlanFileError(advice(
                    f"the plan's field assignment does not name this graph's nodes: {len(extra)} missing "
                    f"(first: {extra[:3]}), {len(gone)} unknown (first: {gone[:3]})",
                    "the file was edited after planning (its fingerprint matches the model)",
                    "re-plan the model, or restore the file from where it was saved",
                ))
            return
        detail = (
            f"{len(extra)} nodes not in the plan (first: {extra[:3]}), {len(gone)} planned nodes absent (first: {gone[:3]})"
            if extra or gone
            else "the same node names, but different ops, edges or parameter shapes"
        )
        raise PlanMismatchError(advice(
            f"this plan was made for graph {self.fingerprint}, but the model captures as graph {fingerprint}: {detail}",
            "the plan belongs to another model or another version of it",
            "re-plan with autosplit.plan(model, devices, ...), or load the plan made for this model",
        ))

    # -- files ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["assignment"] = dict(self.assignment)
        data["module_stages"] = {k: list(v) for k, v in self.module_stages.items()}
        return data

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, atomically: a temporary file in the same folder, flushed to disk,
        then renamed over ``path``, so a failure part-way leaves the old file as it was."""
        target = Path(path)
        text = json.dumps(self.to_dict(), indent=1, sort_keys=False)  # a plan that cannot be encoded touches no file
        name, tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp"), None
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            tmp = name
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            if target.is_file():
                shutil.copymode(target, tmp)  # a replaced file keeps its permissions
            os.replace(tmp, target)
            tmp = None
        except OSError as e:
            folder = target.parent
            if not folder.is_dir():
                why, fix = f"the folder {folder} does not exist", f"create it first (mkdir -p {folder}), or save elsewhere"
            elif target.is_dir():
                why, fix = f"{target} is a folder", f"name a file in it, e.g. {target / 'plan.json'}"
            elif isinstance(e, PermissionError):
                why, fix = f"this user may not write {target} in {folder}", "save to a writable path, or change the permissions"
            else:
                why, fix = "the file system refused the write (a full disk?)", "free some space, or save elsewhere"
            raise PlanFileError(advice(f"cannot save the plan to {target}: {type(e).__name__}: {e.strerror or e}", why, fix)) from e
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    @classmethod
    def from_dict(cls, data: Mapping, *, source: str = "plan data") -> Plan:
        """A plan from its :meth:`to_dict` form, every field checked for its type, then for its range."""
        if not isinstance(data, Mapping):
            raise PlanFileError(advice(
                f"{source}: the plan is {_JSON_KINDS.get(type(data), type(data).__name__)} ({reprlib.repr(data)}), expected an object",
                "the file holds other JSON than a saved plan", "load a file written by Plan.save, or re-plan the model",
            ))
        version = data.get("schema_version")
        if version == 2:  # version 2 had no objective: a makespan plan said so in its schedule
            objective = "makespan" if data.get("schedule") == "makespan" else "pipeline"
            data = {**data, "objective": objective, "schema_version": SCHEMA_VERSION}
        elif version != SCHEMA_VERSION:
            raise PlanFileError(
                advice(
                    f"{source}: plan schema version {version} is not supported (this autosplit reads versions 2 and {SCHEMA_VERSION})",
                    "the plan was written by another version of autosplit",
                    "re-plan the model with this version",
                )
            )
        plan = _record(cls, data, "", source)
        plan._check_fields(source)
        return plan

    def _check_fields(self, source: str) -> None:
        """Each field of a loaded plan within its range; a :class:`PlanFileError` naming the first that is not."""
        from autosplit import schedules
        from autosplit.errors import ConstraintError
        from autosplit.options import PRECISIONS

        def bad(name: str, value: object, rule: str) -> PlanFileError:
            return PlanFileError(advice(
                f"{source}: field {name} = {value!r} {rule}", "the file was edited, or written by hand",
                "re-plan the model, or restore the file from where it was saved",
            ))

        D = len(self.devices)
        if D == 0:
            raise bad("devices", [], "is empty: a plan places nodes on at least one device")
        for i, spec in enumerate(self.devices):
            if not spec.memory > 0:
                raise bad(f"devices[{i}].memory", spec.memory, "is not a positive number of bytes")
        v = self.stages_per_rank
        if not (isinstance(v, int) and v >= 1):
            raise bad("stages_per_rank", v, "is not an integer ≥ 1")
        seen: set[int] = set()
        for s, index in enumerate(self.stage_devices):
            if not 0 <= index < D or (index in seen and v == 1):
                raise bad(f"stage_devices[{s}]", index, f"is not a distinct device index in 0..{D - 1}")
            seen.add(index)
        if not self.stage_devices:
            raise bad("stage_devices", [], "is empty: a plan has at least one stage")
        if v > 1 and any(self.stage_devices.count(d) != v for d in seen):
            raise bad("stage_devices", list(self.stage_devices), f"does not run {v} stages on each of its devices")
        if len(self.stages) != len(self.stage_devices):
            raise bad("stages", f"{len(self.stages)} rows", f"does not match the {len(self.stage_devices)} stage devices")
        if not self.assignment:
            raise bad("assignment", {}, "is empty: a plan places every graph node")
        targets = set(range(len(self.stage_devices))) if v > 1 else seen
        for node, index in self.assignment.items():
            if not node:
                raise bad("assignment", node, "has an empty node name")
            if index not in targets:
                if v > 1:
                    raise bad(f"assignment[{node!r}]", index, f"is not a stage in 0..{len(self.stage_devices) - 1}")
                rule = f"is not one of the plan's {D} devices" if not 0 <= index < D else "is a device no stage runs on"
                raise bad(f"assignment[{node!r}]", index, f"{rule} (stage devices: {list(self.stage_devices)})")
        if not 0 <= self.step_time < math.inf:
            raise bad("step_time", self.step_time, "is not a finite number of seconds ≥ 0")
        if self.micro_batches < 1:
            raise bad("micro_batches", self.micro_batches, "is not an integer ≥ 1")
        if self.objective not in schedules.OBJECTIVES:
            raise bad("objective", self.objective, f"is not one of {schedules.OBJECTIVES}")
        if not (self.objective == "makespan" and self.schedule == "makespan"):  # a makespan plan writes "makespan"
            try:
                schedules.runnable(self.schedule)
            except ConstraintError as e:
                raise bad("schedule", self.schedule, f"is not one of {schedules.SCHEDULES}"
                          + " or 'makespan'" * (self.objective == "makespan") + f": {e}") from e
            low, high = schedules.lookup(self.schedule).stages_per_rank
            if v < low or (high is not None and v > high):
                raise bad("stages_per_rank", v, f"is outside what schedule {self.schedule!r} runs ({low} to {high or 'any'})")
        for t in self.tasks:
            if t.node not in self.assignment or t.device != self.assignment[t.node] or t.kind not in ("forward", "backward"):
                raise bad("tasks", t, "does not match the assignment (a node's device) or is not a forward or backward")
        if self.data_parallel < 1:
            raise bad("data_parallel", self.data_parallel, "is not an integer ≥ 1")
        if self.precision not in PRECISIONS:
            raise bad("precision", self.precision, f"is not one of {PRECISIONS}")
        if len(set(self.recompute)) != len(self.recompute) or not all(isinstance(b, str) and b for b in self.recompute):
            raise bad("recompute", list(self.recompute), "does not name distinct blocks (module paths)")
        for some in self.recompute_partial:
            if some.block not in self.recompute or not 0 < some.keep < some.window:
                raise bad("recompute_partial", some, "names a block not in recompute, or does not keep 1 to window − 1 micro-batches")
        if not self.fingerprint:
            raise bad("fingerprint", self.fingerprint, "is empty")
        if self.crossings and len(self.crossings) != len(self.stage_devices) - 1:
            raise bad("crossings", f"{len(self.crossings)} boundaries", f"does not match {len(self.stage_devices)} stages")
        for k, names in enumerate(self.crossings):
            for name in names:
                if name not in self.assignment and name.rsplit(".", 1)[0] not in self.assignment:
                    raise bad(f"crossings[{k}]", name, "names no node of the plan")
        for p in self.shared_params:
            if any(not 0 <= s < len(self.stage_devices) for s in p.stages):
                raise bad(f"shared_params[{p.name!r}].stages", list(p.stages), "names a stage the plan does not have")
            if p.policy not in ("replicate", "send"):
                raise bad(f"shared_params[{p.name!r}].policy", p.policy, "is not 'replicate' or 'send'")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlanFileError(advice(
                f"cannot read plan file {path}: {e}", "the path is wrong, or the file is not JSON",
                "check the path, or re-plan and save the plan again",
            )) from e
        return cls.from_dict(data, source=str(path))

    def __str__(self) -> str:
        """One line; :func:`autosplit.report.plan_report` gives the partition report."""
        return (
            f"Plan({self.objective}: {len(self.assignment)} nodes on {len(self.stage_devices)} of {len(self.devices)} devices, "
            f"{self.schedule}, {self.micro_batches} micro-batches, predicted step {_ms(self.step_time)}, "
            f"solver {self.solver.name} {self.solver.status})"
        )


# -- reading plan files: each field as its annotated type -------------------------------------------
_JSON_KINDS = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "a list", tuple: "a list", dict: "an object"}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _wrong_type(source: str, path: str, value: object, expected: str) -> PlanFileError:
    found = f"a list of {len(value)}" if isinstance(value, (list, tuple)) else _JSON_KINDS.get(type(value), type(value).__name__)
    return PlanFileError(advice(
        f"{source}: field {path} = {reprlib.repr(value)} is {found}, expected {expected}",
        "the file was edited, or written by hand", "re-plan the model, or restore the file from where it was saved",
    ))


def _expected(hint: Any) -> str:
    """What a field of type ``hint`` looks like in JSON, in words."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_expected(a) for a in args)
    if origin is tuple:
        return "a list" if args[-1] is Ellipsis else f"a list of {len(args)}"
    return "an object" if origin is Mapping or dataclasses.is_dataclass(hint) else _JSON_KINDS[hint]


def _field(value: Any, hint: Any, path: str, source: str, expected: str | None = None) -> Any:
    """``value`` read as a field of type ``hint``, or a :class:`PlanFileError` naming ``path``, the type and the value."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):  # X | None
        if value is None:
            return None
        return _field(value, next(a for a in args if a is not type(None)), path, source, _expected(hint))
    if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
        return _record(typing.cast(type, hint), value, path, source)
    if origin is tuple and isinstance(value, (list, tuple)):
        items = args[:1] * len(value) if args[-1] is Ellipsis else args
        if len(items) == len(value):
            return tuple(_field(v, h, f"{path}[{i}]", source) for i, (v, h) in enumerate(zip(value, items)))
    elif origin is Mapping and isinstance(value, Mapping):
        return {_field(k, args[0], f"{path} key", source): _field(v, args[1], f"{path}[{k!r}]", source) for k, v in value.items()}
    elif isinstance(value, bool):
        if hint is bool:
            return value
    elif hint is float and isinstance(value, (int, float)):
        return float(value)
    elif hint is int and (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        return int(value)  # a count written as 8.0 is still 8
    elif hint is str and isinstance(value, str):
        return value
    raise _wrong_type(source, path, value, expected or _expected(hint))


def _record(cls: type, data: Mapping, path: str, source: str) -> Any:
    """An instance of the dataclass ``cls`` from the JSON object ``data``: no unknown fields, no required field missing."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = f"{path}." if path else ""
    unknown = sorted(str(k) for k in data if k not in fields)
    missing = [n for n, f in fields.items()
               if n not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if unknown or missing:
        what = f"unknown field {where + unknown[0]!r}" if unknown else f"required field {where + missing[0]!r} is missing"
        raise PlanFileError(advice(
            f"{source}: {what} ({cls.__name__} has fields {list(fields)})",
            "the file was edited, truncated or written by hand",
            "re-plan the model, or restore the file from where it was saved",
        ))
    hints = _hints(cls)
    return cls(**{name: _field(value, hints[name], f"{where}{name}", source) for name, value in data.items()})
