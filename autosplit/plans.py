"""The plan: which device runs each node, what that is predicted to cost, and how it was found.

Plans are small versioned JSON (never pickle): schema version, library versions, graph
fingerprint, devices, assignment, per-stage predictions and solver provenance. A manual
split is a plan too, so comparing the two is comparing two files. ``save`` is atomic (a
temporary file in the same folder, renamed over the target); ``load`` reads every field as its
annotated type (:mod:`autosplit.plan_json`), then checks its range, and names the first field that
is wrong. The records a plan holds (stage reports, solver provenance, step terms, tasks) are
defined in :mod:`autosplit.plan_records` and imported from here.

Usage::

    print(plan)                  # the partition report
    plan.save("plan.json")
    plan = Plan.load("plan.json")
"""


from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import reprlib
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autosplit.devices import DeviceSpec
from autosplit.errors import PlanFileError, PlanMismatchError, advice
from autosplit.plan_json import JSON_KINDS, read_record
from autosplit.plan_records import (
    Alternative,
    PartialRecompute,
    PlannedTask,
    SharedParam,
    SolverInfo,
    StageReport,
    StepTerms,
)
from autosplit.units import format_ms as _ms

if TYPE_CHECKING:
    from autosplit.plan_export import Names

__all__ = [
    "LOSS_COSTED", "SCHEMA_VERSION", "Alternative", "PartialRecompute", "Plan", "PlannedTask", "SharedParam", "SolverInfo", "StageReport",
    "StepTerms", "write_atomically",
]

SCHEMA_VERSION = 3
"""Version 3 added :attr:`Plan.objective`; a version-2 file is read with it derived from its schedule."""
LOSS_COSTED = "loss costed on the output's stage"
"""What :attr:`Plan.costs` says when the plan costed the loss (planned with ``loss_fn`` and ``example_target``)."""


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
    """Data-parallel copies of the split model the prediction counts (hybrid data × pipeline
    parallelism): ``dp_replicate × dp_shard`` of :attr:`mesh`."""
    dp_shard: int = 1
    """Of :attr:`data_parallel`, the degree over which each stage's parameters, gradients and optimizer
    state are sharded (FSDP2's ``fully_shard``); the rest (:attr:`dp_replicate`) hold whole copies."""
    tensor_parallel: int = 1
    """Devices each stage's tensors are split over: the mesh's ``tp`` (innermost, inside a node)."""
    tp_shards: Mapping[str, int] = field(default_factory=dict)
    """Parameter name → the dimension its tensor is split along over the :attr:`tensor_parallel`
    devices, as torch's tensor parallelism splits it: 0 for a column-parallel ``Linear``'s weight and
    bias and a vocabulary-parallel embedding (``ColwiseParallel``, ``RowwiseParallel`` of an
    ``Embedding``), 1 for a row-parallel ``Linear``'s weight (``RowwiseParallel``). A parameter not
    named is replicated over them."""
    tp_whole: Mapping[str, str] = field(default_factory=dict)
    """Under :attr:`tensor_parallel`, each module whose parameters stay whole on every tp rank → why
    (a fused projection split along its output, a norm, a lookup of computed indices)."""
    sequence_parallel: bool = False
    """Under :attr:`tensor_parallel`, the activations between the split layers (norms, residuals) are
    split along the sequence (torch's ``SequenceParallel``): reduce-scatter and all-gather where
    otherwise an all-reduce."""
    async_tp: bool = False
    """Costed with the tensor-parallel collectives overlapped with their GEMMs (:attr:`~autosplit.options.PlanOptions.async_tp`)."""
    expert_parallel: int = 1
    """Ranks each mixture-of-experts layer's experts are spread over (``ep``), borrowed from ``dp_shard × tp``
    (:mod:`autosplit.passes.ep_costs`): each holds ``E / ep`` whole experts."""
    ep_overlap: bool = False
    """Costed with each layer's expert all-to-alls overlapped with another micro-batch
    (:attr:`~autosplit.options.PlanOptions.ep_overlap`)."""
    context_parallel: int = 1
    """Devices each stage's sequence is split over: the mesh's ``cp``, between dp_shard and tp (:mod:`autosplit.passes.cp_costs`)."""
    cp_comm: str = "p2p"
    """How the cp ranks exchange attention's inputs: ``"p2p"`` or ``"a2a"`` (:attr:`~autosplit.options.PlanOptions.cp_comm`)."""
    crossings: tuple[tuple[str, ...], ...] = ()
    """[boundary k − 1] the tensors stage k − 1 sends stage k, in order (the distributed runtime's
    positional interface; recorded when the plan is run distributed)."""
    module_stages: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Module path (every level; ``""`` the root) → the stages its nodes run on: the module tree by stage."""
    tasks: tuple[PlannedTask, ...] = ()
    """Makespan plans (``objective="makespan"``): every node's forward and backward task, timed;
    each device runs its tasks in start order, as soon as their inputs arrive."""
    stages_per_rank: int = 1
    """Stages each device runs (:attr:`~autosplit.options.PlanOptions.stages_per_rank`); its stages' ranks are :attr:`stage_devices`."""
    rank_memory: tuple[int, ...] = ()
    """[device] peak bytes of its stages together, from the replayed schedule (empty: the stage rows')."""
    alternatives: tuple[Alternative, ...] = ()
    """The configurations a search tried (options left ``"auto"``), fastest first; empty without a search."""
    precision: str = "fp32"
    """The precision the plan was costed for and its stages run in (:attr:`~autosplit.options.PlanOptions.precision`)."""
    float8: str | None = None
    """The FP8 recipe the linears in :attr:`float8_linears` run in (:attr:`~autosplit.options.PlanOptions.float8`,
    ``"auto"`` resolved); ``None``: none."""
    float8_linears: tuple[str, ...] = ()
    """Module paths of the linears the stages run in FP8 (torchao's ``convert_to_float8_training``)."""
    float8_kept: tuple[tuple[str, str], ...] = ()
    """(module path, why) of each linear kept in bf16 under a float8 option: filtered, its shape, or FP8 not paying."""
    recompute: tuple[str, ...] = ()
    """Blocks (module paths) whose activations the stages recompute in the backward instead of keeping."""
    recompute_partial: tuple[PartialRecompute, ...] = ()
    """Of :attr:`recompute`, the blocks that keep some micro-batches' activations (the rest recompute
    all of theirs)."""
    recompute_selective: bool = False
    """The :attr:`recompute` blocks keep their matmuls' and attention's outputs and recompute the ops
    between them (:attr:`~autosplit.options.PlanOptions.selective`)."""
    made_with: tuple[str, float] | None = None
    """For a saved plan re-costed on load: (the costs it was made with, the step it predicted then)."""
    batch: int = 0
    """Rows of the global batch the plan steps on (all data-parallel copies together); 0: not recorded."""
    engine_gap: tuple[str, float] | None = None
    """Planned ``expressible_in`` an engine: (the engine, the predicted step of the best plan without that restriction)."""
    parameters: tuple[str, ...] = ()
    """Every parameter's qualified name in the model planned (a tied one under each of its names): what an
    engine's export must place, each exactly once (:mod:`autosplit.plan_export`); ``()``: not recorded."""
    schema_version: int = SCHEMA_VERSION

    @property
    def step_gap(self) -> float | None:
        """How far :attr:`step_time` may be above the best split's, at most: (step − :attr:`SolverInfo.step_bound`) / step."""
        bound = self.solver.step_bound
        return None if bound is None or not self.step_time > 0 else max(0.0, (self.step_time - bound) / self.step_time)

    @property
    def dp_replicate(self) -> int:
        """Of :attr:`data_parallel`, the degree that holds whole copies (FSDP2's ``replicate``)."""
        return self.data_parallel // self.dp_shard

    @property
    def mesh(self) -> dict[str, int]:
        """The degrees of the device mesh the plan runs on, pp outermost, tp innermost (as torchtitan
        builds it): ``{"pp": ranks, "dp_replicate": …, "dp_shard": …, "tp": …}``, with ``"cp"`` before tp where the plan splits
        the sequence; world size = their product."""
        return {"pp": len(self.devices), "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
                **({"cp": self.context_parallel} if self.context_parallel > 1 else {}), "tp": self.tensor_parallel}

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

    def export(self, engine: str, *, names: Names | Mapping[str, str] | None = None, form: str = "toml", model: Any = None) -> str:
        """This plan as ``engine`` reads it: ``"torchtitan"`` (its config: ``form`` ``"python"`` for torchtitan
        0.3, ``"toml"`` for 0.2) or ``"megatron"`` (Megatron-LM's flags, the layout among them); ``names``: where
        torchtitan's llama3 modules are in the model (:class:`~autosplit.plan_export.Names`), found by
        itself for a transformers Llama and for torchtitan's own; every parameter of ``model`` (default: the
        plan's :attr:`parameters`) checked to be placed once. See :mod:`autosplit.plan_export`."""
        from autosplit.plan_export import export

        return export(self, engine, names=names, form=form, model=model)

    # -- files ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["assignment"] = dict(self.assignment)
        data["module_stages"] = {k: list(v) for k, v in self.module_stages.items()}
        return data

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, atomically (:func:`write_atomically`): a failure part-way leaves the old file as it was."""
        text = json.dumps(self.to_dict(), indent=1, sort_keys=False)  # a plan that cannot be encoded touches no file
        write_atomically(path, text, "the plan")

    @classmethod
    def from_dict(cls, data: Mapping, *, source: str = "plan data") -> Plan:
        """A plan from its :meth:`to_dict` form, every field checked for its type, then for its range."""
        if not isinstance(data, Mapping):
            raise PlanFileError(advice(
                f"{source}: the plan is {JSON_KINDS.get(type(data), type(data).__name__)} ({reprlib.repr(data)}), expected an object",
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
        if data.get("float8") and "float8_linears" not in data:
            raise PlanFileError(advice(
                f"{source}: the plan was costed with linears in FP8 ({data['float8']}) by an autosplit that did not record which",
                "this version runs the linears a plan names (float8_linears), and costed-only FP8 plans named none",
                "re-plan the model with this version",
            ))
        plan = read_record(cls, data, "", source)
        plan._check_fields(source)
        return plan

    def _check_fields(self, source: str) -> None:
        """Each field of a loaded plan within its range; a :class:`PlanFileError` naming the first that is not."""
        self._check_placement(source)
        self._check_run(source)
        self._check_sharing(source)

    def _check_placement(self, source: str) -> None:
        """Devices, stages and the assignment: every node on a stage some device runs."""
        D = len(self.devices)
        if D == 0:
            raise _bad(source, "devices", [], "is empty: a plan places nodes on at least one device")
        for i, spec in enumerate(self.devices):
            if not spec.memory > 0:
                raise _bad(source, f"devices[{i}].memory", spec.memory, "is not a positive number of bytes")
        v = self.stages_per_rank
        if not (isinstance(v, int) and v >= 1):
            raise _bad(source, "stages_per_rank", v, "is not an integer ≥ 1")
        seen: set[int] = set()
        for s, index in enumerate(self.stage_devices):
            if not 0 <= index < D or (index in seen and v == 1):
                raise _bad(source, f"stage_devices[{s}]", index, f"is not a distinct device index in 0..{D - 1}")
            seen.add(index)
        if not self.stage_devices:
            raise _bad(source, "stage_devices", [], "is empty: a plan has at least one stage")
        if v > 1 and any(self.stage_devices.count(d) != v for d in seen):
            raise _bad(source, "stage_devices", list(self.stage_devices), f"does not run {v} stages on each of its devices")
        if len(self.stages) != len(self.stage_devices):
            raise _bad(source, "stages", f"{len(self.stages)} rows", f"does not match the {len(self.stage_devices)} stage devices")
        if not self.assignment:
            raise _bad(source, "assignment", {}, "is empty: a plan places every graph node")
        targets = set(range(len(self.stage_devices))) if v > 1 else seen
        for node, index in self.assignment.items():
            if not node:
                raise _bad(source, "assignment", node, "has an empty node name")
            if index not in targets:
                if v > 1:
                    raise _bad(source, f"assignment[{node!r}]", index, f"is not a stage in 0..{len(self.stage_devices) - 1}")
                rule = f"is not one of the plan's {D} devices" if not 0 <= index < D else "is a device no stage runs on"
                raise _bad(source, f"assignment[{node!r}]", index, f"{rule} (stage devices: {list(self.stage_devices)})")

    def _check_run(self, source: str) -> None:
        """How the plan runs: step, micro-batches, objective, schedule, tasks, replicas, precision, recompute."""
        from autosplit import schedules
        from autosplit.errors import ConstraintError
        from autosplit.options import FLOAT8, PRECISIONS

        v = self.stages_per_rank
        if not 0 <= self.step_time < math.inf:
            raise _bad(source, "step_time", self.step_time, "is not a finite number of seconds ≥ 0")
        if self.micro_batches < 1:
            raise _bad(source, "micro_batches", self.micro_batches, "is not an integer ≥ 1")
        if self.objective not in schedules.OBJECTIVES:
            raise _bad(source, "objective", self.objective, f"is not one of {schedules.OBJECTIVES}")
        if not (self.objective == "makespan" and self.schedule == "makespan"):  # a makespan plan writes "makespan"
            try:
                schedules.runnable(self.schedule)
            except ConstraintError as e:
                raise _bad(source, "schedule", self.schedule, f"is not one of {schedules.SCHEDULES}"
                          + " or 'makespan'" * (self.objective == "makespan") + f": {e}") from e
            low, high = schedules.lookup(self.schedule).stages_per_rank
            if v < low or (high is not None and v > high):
                raise _bad(source, "stages_per_rank", v, f"is outside what schedule {self.schedule!r} runs ({low} to {high or 'any'})")
        for t in self.tasks:
            if t.node not in self.assignment or t.device != self.assignment[t.node] or t.kind not in ("forward", "backward"):
                raise _bad(source, "tasks", t, "does not match the assignment (a node's device) or is not a forward or backward")
        if self.data_parallel < 1:
            raise _bad(source, "data_parallel", self.data_parallel, "is not an integer ≥ 1")
        if self.dp_shard < 1 or self.data_parallel % self.dp_shard:
            raise _bad(source, "dp_shard", self.dp_shard, f"is not an integer ≥ 1 dividing data_parallel={self.data_parallel}")
        if self.tensor_parallel < 1 or (self.tensor_parallel == 1 and (self.tp_shards or self.tp_whole or self.sequence_parallel)):
            raise _bad(source, "tensor_parallel", self.tensor_parallel,
                       "is not an integer ≥ 1, or is 1 with tp_shards or sequence_parallel")
        if self.context_parallel < 1:
            raise _bad(source, "context_parallel", self.context_parallel, "is not an integer ≥ 1")
        if self.cp_comm not in ("p2p", "a2a"):
            raise _bad(source, "cp_comm", self.cp_comm, "is not 'p2p' or 'a2a'")
        if self.expert_parallel < 1 or (self.dp_shard * self.tensor_parallel) % self.expert_parallel:
            raise _bad(source, "expert_parallel", self.expert_parallel,
                       f"is not an integer ≥ 1 dividing dp_shard × tensor_parallel = {self.dp_shard * self.tensor_parallel}")
        if any(d not in (0, 1) for d in self.tp_shards.values()):
            raise _bad(source, "tp_shards", dict(self.tp_shards), "splits a parameter along a dimension other than 0 or 1")
        if self.precision not in PRECISIONS:
            raise _bad(source, "precision", self.precision, f"is not one of {PRECISIONS}")
        if self.float8 not in (None, *FLOAT8) or (self.float8 is None) != (not self.float8_linears):
            raise _bad(source, "float8", self.float8, f"is not None or one of {FLOAT8}, or disagrees with float8_linears")
        if len(set(self.recompute)) != len(self.recompute) or not all(isinstance(b, str) and b for b in self.recompute):
            raise _bad(source, "recompute", list(self.recompute), "does not name distinct blocks (module paths)")
        for some in self.recompute_partial:
            if some.block not in self.recompute or not 0 < some.keep < some.window:
                raise _bad(source, "recompute_partial", some,
                           "names a block not in recompute, or does not keep 1 to window − 1 micro-batches")

    def _check_sharing(self, source: str) -> None:
        """What names the graph: its fingerprint, the crossings' nodes, the shared parameters' stages."""
        if not self.fingerprint:
            raise _bad(source, "fingerprint", self.fingerprint, "is empty")
        if self.crossings and len(self.crossings) != len(self.stage_devices) - 1:
            raise _bad(source, "crossings", f"{len(self.crossings)} boundaries", f"does not match {len(self.stage_devices)} stages")
        for k, names in enumerate(self.crossings):
            for name in names:
                if name not in self.assignment and name.rsplit(".", 1)[0] not in self.assignment:
                    raise _bad(source, f"crossings[{k}]", name, "names no node of the plan")
        for p in self.shared_params:
            if any(not 0 <= s < len(self.stage_devices) for s in p.stages):
                raise _bad(source, f"shared_params[{p.name!r}].stages", list(p.stages), "names a stage the plan does not have")
            if p.policy not in ("replicate", "send"):
                raise _bad(source, f"shared_params[{p.name!r}].policy", p.policy, "is not 'replicate' or 'send'")

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


def write_atomically(path: str | Path, text: str, what: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file in the same folder, flushed to disk, then
    renamed over ``path``, so a failure part-way leaves the old file as it was; ``what`` names the
    contents in the error (a :class:`~autosplit.errors.PlanFileError` saying why and what to try)."""
    target = Path(path)
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
        raise PlanFileError(advice(f"cannot save {what} to {target}: {type(e).__name__}: {e.strerror or e}", why, fix)) from e
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _bad(source: str, name: str, value: object, rule: str) -> PlanFileError:
    """The error for field ``name`` of a loaded plan, whose ``value`` breaks ``rule``."""
    return PlanFileError(advice(
        f"{source}: field {name} = {value!r} {rule}", "the file was edited, or written by hand",
        "re-plan the model, or restore the file from where it was saved",
    ))
