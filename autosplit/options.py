"""Planning options, written once (torchtitan's config style: a frozen dataclass, a docstring per field).

Every entry point (:class:`~autosplit.api.planner.Planner`, :func:`autosplit.plan`,
:func:`autosplit.autosplit`, :func:`autosplit.distribute`, the CLI) takes these fields as
keyword arguments and builds one :class:`PlanOptions`; adding an option is one edit here.
Values are checked when the options are made, so a bad one fails before any work.

Usage::

    options = PlanOptions(schedule="1f1b", micro_batches=8, memory={"cuda:0": "20GiB"})
    faster = options.replace(time_limit=2.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias, get_args

from autosplit import schedules
from autosplit.costtable import OPTIMIZER_STATE_BYTES, CostTable
from autosplit.errors import ConstraintError, advice
from autosplit.option_checks import bad as _bad
from autosplit.option_checks import check_costs_and_mappings
from autosplit.option_checks import is_int as _is_int
from autosplit.option_records import ProfileOptions, SolverLimits
from autosplit.schedules import OBJECTIVES, SCHEDULES, Objective, ScheduleName

AUTO = "auto"
"""What ``schedule``, ``stages_per_rank`` and ``micro_batches`` say to let the planner choose."""
AUTO_MOST_STAGES_PER_RANK = 2
"""The most stages per rank ``stages_per_rank="auto"`` tries (each more adds a transfer per boundary)."""

__all__ = ["AUTO", "AUTO_MOST_STAGES_PER_RANK",
           "PlanOptions", "SolverLimits", "ProfileOptions", "SCHEDULES", "OBJECTIVES", "OPTIMIZERS", "CAPTURE_METHODS", "CostsLike",
           "ScheduleName", "Objective", "Optimizer", "CaptureMethod", "Precision", "PRECISIONS",
           "Float8", "FLOAT8", "Checkpointing", "CHECKPOINTINGS", "CpComm", "CP_COMMS",
           "Replicate", "REPLICATES"]

Optimizer: TypeAlias = Literal["adam", "adamw", "adagrad", "sgd_momentum", "sgd", "none"]
OPTIMIZERS = tuple(OPTIMIZER_STATE_BYTES)
"""Optimizers whose state and step temporaries the memory model counts (the names of :data:`Optimizer`)."""
CaptureMethod: TypeAlias = Literal["auto", "symbolic_trace", "export"]
CAPTURE_METHODS: tuple[str, ...] = get_args(CaptureMethod)
Precision: TypeAlias = Literal["fp32", "bf16", "fp16-mixed", "bf16-mixed", "bf16-fsdp"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
Float8: TypeAlias = Literal["tensorwise", "rowwise", "mxfp8"]
FLOAT8: tuple[str, ...] = get_args(Float8)
Checkpointing: TypeAlias = Literal["none", "full", "auto"]
CpComm: TypeAlias = Literal["p2p", "a2a"]
CP_COMMS: tuple[str, ...] = get_args(CpComm)
Replicate: TypeAlias = Literal["replicate", "fully_shard"]
REPLICATES: tuple[str, ...] = get_args(Replicate)
CHECKPOINTINGS: tuple[str, ...] = get_args(Checkpointing)


CostsLike: TypeAlias = str | ProfileOptions | CostTable | Path


@dataclass(frozen=True)
class PlanOptions:
    """How to plan: the schedule the plan is optimised for, costs, limits and user constraints."""

    objective: Objective = "pipeline"
    """``"pipeline"`` (contiguous stages, micro-batched; the step of the schedule) or
    ``"makespan"`` (Pal et al.'s DLPlacer: any node on any device, forward and backward tasks
    timed so that parallel branches run at once; one micro-batch; built into a
    :class:`~autosplit.runtime.makespan.MakespanRunner` on CPU devices)."""
    micro_batches: int | Literal["auto"] | None = None
    """Micro-batches per step; must divide the batch. ``None``: the largest count ≤ 4 × the number of
    stages that divides the batch and that the schedule runs (GPipe, Huang et al. 2019 §2.2: with
    M ≥ 4·S the bubble is small); always 1 for ``schedule="sequential"``. ``"auto"``: the planner
    tries every such count from the number of devices up."""
    schedule: ScheduleName | Literal["auto"] = "gpipe"
    """``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (PipeDream-Flush: each stage
    holds at most S − s micro-batches), ``"sequential"`` (one batch, stages in turn), or an
    asynchronous schedule that never flushes — ``"xpipe"`` (weight prediction), ``"async"``,
    ``"pipedream"`` (weight stashing) — run by :meth:`~autosplit.runtime.distributed.DistributedModel.run`. Any case, and torch's
    class names (``"Schedule1F1B"``), are read as autosplit's name (:mod:`autosplit.schedules`);
    torch's multi-stage schedules (``"interleaved1f1b"``, ``"loopedbfs"``, ``"interleavedzerobubble"``,
    ``"zbvzerobubble"``, ``"dualpipev"``) with :attr:`stages_per_rank`; ``"auto"``: the planner tries
    every flushed schedule torch runs (``compiler/search.py``)."""
    stages_per_rank: int | Literal["auto"] | None = None
    """Stages each rank (device) runs: 1 for GPipe and 1F1B; torch's interleaved schedules loop over
    ``v`` of them (stage s on rank s mod pp), ZBV and DualPipeV take exactly 2 in a V. ``None``: the
    fewest the schedule runs (:attr:`autosplit.schedules.Schedule.stages_per_rank`); ``"auto"``: the
    planner tries 1 to :data:`AUTO_MOST_STAGES_PER_RANK` (as the schedule allows)."""
    optimizer: Optimizer = "adam"
    """The optimizer whose state (Adam: two fp32 moments) and step temporaries memory counts."""
    memory: Mapping[int | str, int | str] | None = None
    """Memory caps by device index or name, e.g. ``{"cuda:0": "20GiB", 3: 8 * 2**30}``."""
    time_limit: float = 10.0
    """Seconds the solver may search (the exact DP always finishes; CP-SAT stops here); over a whole
    mesh, also the search's budget: once a plan is found, configurations left after it are passed over
    (:mod:`autosplit.compiler.mesh`)."""
    gap: float = 0.01
    """The certified gap the planner settles for (pipeline objective): a plan proven within this
    fraction of the optimum — ``(objective − bound) / objective ≤ gap`` against a proven lower
    bound — is returned at once. The dynamic program's plan is returned without any CP-SAT search
    when the bound certifies it (``autosplit demo``, a 345-node GPT onto 4 CPUs: 0.52%, solved in
    0.1 s instead of 5.5 s proving the same plan optimal), and CP-SAT, when it runs, stops once it
    certifies its own. The report shows the gap reached. ``0``: search until the plan is proven
    optimal or ``time_limit`` ends."""
    seed: int = 0
    """Solver seed: the same model, devices, options and seed give the same plan on every rank."""
    capture: CaptureMethod = "auto"
    """``"auto"`` (fx symbolic trace, torch.export when that fails), ``"symbolic_trace"`` or ``"export"``."""
    costs: CostsLike = "analytic"
    """``"analytic"`` (roofline), ``"measured"`` (profile every node, cached on disk), a
    :class:`ProfileOptions`, a :class:`~autosplit.costtable.CostTable`
    or the path of a saved one."""
    cost_overrides: Mapping[str, Mapping[str, float]] | None = None
    """A node's or module's cost in seconds for the whole batch: ``{"blocks.3": {"fwd": 2e-3, "bwd": 4e-3}}``."""
    pin: Mapping[str, int | str] | None = None
    """Module → device it must run on: ``{"blocks.0": 0}``."""
    avoid: Mapping[str, int | str | Sequence[int | str]] | None = None
    """Module → devices it must not run on: ``{"head": ["cuda:0"]}``."""
    together: Sequence[Sequence[str]] | None = None
    """Groups of modules that must share a device: ``[("wte", "head")]``."""
    expressible_in: str | None = None
    """``"torchtitan"`` or ``"megatron"``: plan only splits that engine runs — whole layers, and for
    Megatron the final norm with the output (:mod:`autosplit.plan_export`); the report says what it costs."""
    names: Mapping[str, str] | None = None
    """Where torchtitan's llama3 modules are in the model, for ``expressible_in``, exports and engine configs read
    as plans: ``{"tok_embeddings": ..., "layers": ..., "norm": ..., "output": ...}``; found by itself for a
    transformers Llama (Qwen, Mistral) and torchtitan 0.3's and 0.2's own models."""
    precision: Precision = "fp32"
    """What the stages compute and keep in: ``"fp32"`` (the model's own dtype), ``"bf16"`` (parameters,
    gradients, optimizer state and activations in bfloat16), ``"bf16-mixed"`` / ``"fp16-mixed"``
    (``torch.autocast`` around every stage's forward, fp32 master weights and optimizer state; fp16
    with a loss scaler), ``"bf16-fsdp"`` (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``, torchtitan's default: every parameter cast to bf16 once per step, so the
    activations are bf16 too; fp32 master weights, gradients reduced and accumulated in fp32, fp32
    optimizer state; distributed runs only). Costs charge each op at the device's peak for the dtype it computes in."""
    float8: Float8 | Literal["auto"] | None = None
    """Linears in FP8 (:mod:`autosplit.passes.float8`), on top of ``"bf16-mixed"`` or ``"bf16-fsdp"``. A recipe —
    ``"tensorwise"`` (one scale per tensor, current scaling: torchao's ``tensorwise``, Transformer Engine's
    FP8-CS), ``"rowwise"`` (torchao), ``"mxfp8"`` (a scale per 32 values; costed, not run) — converts every
    linear whose dimensions are multiples of 16 and that :attr:`float8_exclude` does not keep, as the
    engines do. ``"auto"`` decides each linear by its cost: tensorwise where its GEMMs at the FP8 peak and
    its casts take less than in bf16 on every device (torchao's rule), bf16 where not, and nothing on
    devices without FP8 tensor cores (CPUs, A100, V100). On a CPU an explicit recipe runs torchao's
    emulation, for its numerics. The plan lists the linears converted and why the others are not
    (:attr:`~autosplit.plans.Plan.float8_linears`); stages run them with torchao's ``convert_to_float8_training``."""
    float8_exclude: tuple[str, ...] | None = None
    """Linears kept in bf16 under :attr:`float8`: each whose module path contains one of these strings
    (torchtitan's ``filter_fqns`` rule, e.g. ``("lm_head", "router")``). ``None``: the model's output
    layer — its last linear — as torchtitan's default ``["output"]`` and Transformer Engine leave it."""
    checkpointing: Checkpointing = "none"
    """Activation checkpointing per block (a repeated layer: the units coarsening finds): ``"none"``
    (keep every activation), ``"full"`` (recompute every block in the backward, as torchtitan's
    ``full`` mode), ``"auto"`` (the solver chooses, per stage, which blocks recompute, minimising the
    step under each device's memory cap). Recomputed blocks run under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``."""
    recompute: Mapping[str, bool] | None = None
    """Per block, the user's decision that ``checkpointing="auto"`` keeps: ``{"layers.0": True,
    "layers.31": False}`` (True: recompute it; a module path names every block inside it)."""
    selective: bool | str = False
    """Recompute blocks *selectively*: a recomputed block keeps the outputs of its matmuls and
    attention and recomputes only the ops between them (norms, activations, rotary embeddings:
    torchtitan's selective op checkpointing, :mod:`autosplit.passes.selective`) — most of the memory
    for a fraction of the rerun. ``False``: a recomputed block keeps its inputs only. ``"auto"``: the
    search plans both and keeps the faster."""
    cut_margin: float = 0.03
    """How much faster, by the replay, a split that cuts inside a repeated layer must be than the
    fastest split at layer boundaries for the refine step to choose it (0.03: 3 %). A split chosen
    as the fastest of many is predicted further ahead than it is: over the 92 replayed
    configurations of ``benchmarks/schedules.py``'s runs 6 to 9 (two CPU processes), the replay
    overstated autosplit's advantage over torchtitan's layer-aligned splits by 1.1 % on average and
    by 2.9 % at the 90th percentile (``benchmarks/investigations/schedules_analysis.py overstatement``).
    ``0``: the fastest split by the replay, wherever it cuts."""
    data_parallel: int | Literal["auto"] = 1
    """Data-parallel copies of the split model (hybrid data × pipeline parallelism); the predicted
    step adds the data-parallel collectives backward does not hide. The devices are the whole mesh and
    the example batch the global one, whatever the degrees: ``pp × data_parallel × tp = len(devices)``,
    each copy planned on ``1/data_parallel`` of the batch (:mod:`autosplit.compiler.mesh`). ``"auto"``: the
    planner chooses the degree with the split; the plan lists every configuration it tried."""
    replicate: Replicate | Literal["auto"] = "replicate"
    """How the :attr:`data_parallel` copies of each stage keep in step, under torch's names:
    ``"replicate"`` (FSDP2's ``replicate``: whole parameters on every copy, gradients all-reduced;
    the mesh's ``dp_replicate``) or ``"fully_shard"`` (FSDP2's ``fully_shard``: parameters,
    gradients and optimizer state sharded over the copies; the mesh's ``dp_shard``); ``"auto"``:
    the planner chooses, over the whole mesh as ``data_parallel="auto"`` does."""
    tensor_parallel: int | Literal["auto"] = 1
    """Devices each stage's tensors are split over (the mesh's ``tp``, innermost: inside a node), by
    the rules the graph gives (:mod:`autosplit.passes.tensor_parallel`): column- then row-parallel
    linear pairs, the vocabulary-parallel embedding and head. The devices are the whole mesh, as for
    :attr:`data_parallel`; ``"auto"``: the planner chooses it with the split and the data-parallel degrees."""
    expert_parallel: int | Literal["auto"] = 1
    """Devices each mixture-of-experts layer's experts are spread over (the mesh's ``ep``), borrowed from its
    ``dp_shard × tp`` as torchtitan borrows them: each holds ``E / ep`` whole experts, and the tokens reach them by
    all-to-all (:mod:`autosplit.passes.ep_costs`). ``"auto"``: chosen with the other degrees (1 for a dense model)."""
    context_parallel: int | Literal["auto"] = 1
    """Devices each stage's sequence is split over (the mesh's ``cp``, between dp_shard and tp), attention's keys and
    values passed round their ring (:mod:`autosplit.passes.cp_costs`); FSDP shards over ``dp_shard × cp``. Costed and
    exported, not run. ``"auto"``: chosen with the other degrees."""
    cp_comm: CpComm = "p2p"
    """How the cp ranks exchange attention's inputs (Megatron's ``--cp-comm-type``): ``"p2p"``, the keys and values
    passed round a ring, overlapped with the attention blocks they feed (torch's ``context_parallel``, torchtitan,
    Megatron's default); ``"a2a"``, all-to-alls that give each rank the whole sequence of ``heads / cp`` heads before
    attention and its own tokens back after (DeepSpeed-Ulysses), on the critical path, every head count over tp a
    multiple of cp (:mod:`autosplit.passes.cp_costs`)."""
    sequence_parallel: bool | str = AUTO
    """Under tensor parallelism, the activations between the split layers (norms, residuals, dropout)
    split along the tokens, as torchtitan's ``SequenceParallel`` runs them: each all-reduce a
    reduce-scatter and an all-gather of the same bytes, and the work and memory between them ÷ tp.
    ``"auto"``: wherever the graph's rules split every linear (it then costs no more, and holds and
    computes less); ``True``: refused where a linear stays whole; ``False``: never."""
    async_tp: bool = False
    """Under tensor parallelism, each collective overlapped with the GEMM beside it, as torchtitan's
    ``enable_async_tensor_parallel`` and Megatron's ``--tp-comm-overlap`` run them: costed with the share the
    engine hides (:attr:`~autosplit.device_spec.DeviceSpec.tp_overlap`, an engine profile's fitted figure).
    autosplit's runtime runs the collectives in turn (gloo has no symmetric memory): such a plan trains the
    same, slower than predicted, and its run logs so."""
    ep_overlap: bool = False
    """Under expert parallelism, each layer's all-to-alls overlapped with another micro-batch's compute of the layer, as
    Megatron's ``--overlap-moe-expert-parallel-comm`` runs them: costed with the share the engine hides
    (:attr:`~autosplit.device_spec.DeviceSpec.ep_overlap`, an engine profile's fitted figure). autosplit's runtime
    runs them in turn: such a plan trains the same, slower than predicted, and its run logs so."""
    limits: SolverLimits = SolverLimits()
    """How much work the solver may do beyond ``time_limit``: the graph sizes past which it
    coarsens, skips CP-SAT or narrows its bound, e.g. ``SolverLimits(cpsat_vars=40_000)``; each
    field and its default: :class:`~autosplit.options.SolverLimits`."""

    def __post_init__(self) -> None:
        if isinstance(self.float8_exclude, list):  # a list reads as the tuple it lists
            object.__setattr__(self, "float8_exclude", tuple(self.float8_exclude))
        entry = self._check_schedule()
        self._check_values()
        self._check_checkpointing(entry)
        check_costs_and_mappings(self)

    def _check_schedule(self) -> Any:
        """``micro_batches``, ``schedule`` (read as autosplit's name) and ``stages_per_rank``; returns
        the schedule's registry entry, None for ``"auto"``."""
        if self.micro_batches not in (None, AUTO) and not (_is_int(self.micro_batches) and int(self.micro_batches) >= 1):
            raise _bad("micro_batches", self.micro_batches, "an integer ≥ 1, 'auto', or None (≤ 4 × stages, dividing the batch)")
        if isinstance(self.schedule, str) and self.schedule.lower() == AUTO:
            object.__setattr__(self, "schedule", AUTO)
            entry = None
        else:
            try:
                entry = schedules.lookup(self.schedule)
            except ConstraintError as e:
                raise _bad("schedule", self.schedule, f"one of {SCHEDULES} or 'auto'") from e
            entry.require_runnable(f"option schedule={self.schedule!r}")
            object.__setattr__(self, "schedule", entry.name)  # "Schedule1F1B", "1F1B" → "1f1b"
        low, high = entry.stages_per_rank if entry is not None else (1, None)
        v = self.stages_per_rank
        if v not in (None, AUTO) and not (_is_int(v) and low <= int(v) <= (high or int(v))):
            allowed = f"{low}" if low == high else f"an integer ≥ {low}" if high is None else f"{low} to {high}"
            raise _bad("stages_per_rank", v, f"{allowed} for schedule {self.schedule!r}, or 'auto' or None")
        return entry

    def _check_values(self) -> None:
        """The options with one legal value or range each: objective, optimizer, time limit, seed, margins,
        replicas, limits, precision, checkpointing, recompute."""
        if self.objective not in OBJECTIVES:
            raise _bad("objective", self.objective, f"one of {OBJECTIVES}")
        if self.optimizer not in OPTIMIZERS:
            raise _bad("optimizer", self.optimizer, f"one of {OPTIMIZERS}")
        if not isinstance(self.time_limit, (int, float)) or isinstance(self.time_limit, bool) or not 0 < self.time_limit < math.inf:
            raise _bad("time_limit", self.time_limit, "a finite number of seconds > 0")
        if not isinstance(self.gap, (int, float)) or isinstance(self.gap, bool) or not 0 <= self.gap < 1:
            raise _bad("gap", self.gap, "a fraction ≥ 0 and < 1, e.g. 0.01")
        if not _is_int(self.seed):
            raise _bad("seed", self.seed, "an integer")
        if not isinstance(self.cut_margin, (int, float)) or isinstance(self.cut_margin, bool) or not 0 <= self.cut_margin < 1:
            raise _bad("cut_margin", self.cut_margin, "a fraction ≥ 0 and < 1, e.g. 0.03")
        if not (self.data_parallel == AUTO or (_is_int(self.data_parallel) and int(self.data_parallel) >= 1)):
            raise _bad("data_parallel", self.data_parallel, "an integer ≥ 1 or 'auto'")
        if self.replicate not in (*REPLICATES, AUTO):
            raise _bad("replicate", self.replicate, f"one of {REPLICATES} or 'auto'")
        if not (self.tensor_parallel == AUTO or (_is_int(self.tensor_parallel) and int(self.tensor_parallel) >= 1)):
            raise _bad("tensor_parallel", self.tensor_parallel, "an integer ≥ 1 or 'auto'")
        for name in ("expert_parallel", "context_parallel"):
            if not ((value := getattr(self, name)) == AUTO or (_is_int(value) and int(value) >= 1)):
                raise _bad(name, value, "an integer ≥ 1 or 'auto'")
        if self.cp_comm not in CP_COMMS:
            raise _bad("cp_comm", self.cp_comm, f"one of {CP_COMMS}")
        if not isinstance(self.async_tp, bool):
            raise _bad("async_tp", self.async_tp, "True or False")
        if not isinstance(self.ep_overlap, bool):
            raise _bad("ep_overlap", self.ep_overlap, "True or False")
        if not isinstance(self.sequence_parallel, bool) and self.sequence_parallel != AUTO:
            raise _bad("sequence_parallel", self.sequence_parallel, "True, False or 'auto'")
        if not isinstance(self.limits, SolverLimits):
            raise _bad("limits", self.limits, "a SolverLimits(...), e.g. SolverLimits(cpsat_vars=40_000)")
        if self.precision not in PRECISIONS:
            raise _bad("precision", self.precision, f"one of {PRECISIONS}")
        if self.float8 is not None and (self.float8 not in (*FLOAT8, AUTO) or self.precision not in ("bf16-mixed", "bf16-fsdp")):
            raise _bad("float8", self.float8, f"None, 'auto' or one of {FLOAT8} on top of precision 'bf16-mixed' or 'bf16-fsdp'")
        if self.float8_exclude is not None and not (
                isinstance(self.float8_exclude, tuple) and all(isinstance(f, str) and f for f in self.float8_exclude)):
            raise _bad("float8_exclude", self.float8_exclude, "None or a tuple of module-path substrings, e.g. ('lm_head', 'router')")
        if self.checkpointing not in CHECKPOINTINGS:
            raise _bad("checkpointing", self.checkpointing, f"one of {CHECKPOINTINGS}")
        if self.expressible_in not in (None, "torchtitan", "megatron"):
            raise _bad("expressible_in", self.expressible_in, "None, 'torchtitan' or 'megatron'")
        if self.names is not None and not (isinstance(self.names, Mapping) and all(isinstance(v, str) for v in self.names.values())):
            raise _bad("names", self.names, "a mapping of torchtitan's names (tok_embeddings, layers, norm, output) to module paths")
        if self.recompute is not None and not (
            isinstance(self.recompute, Mapping) and all(isinstance(k, str) and isinstance(v, bool) for k, v in self.recompute.items())
        ):
            raise _bad("recompute", self.recompute, "a mapping of module path to True (recompute) or False (keep)")
        if not isinstance(self.selective, bool) and self.selective != AUTO:
            raise _bad("selective", self.selective, "True, False or 'auto'")
        if self.capture not in CAPTURE_METHODS:
            raise _bad("capture", self.capture, f"one of {CAPTURE_METHODS}")

    def _check_checkpointing(self, entry: Any) -> None:
        """Recomputation planned only where it runs: pipeline stages with a whole backward."""
        if self.selective is True and not self.checkpoints:
            raise ConstraintError(advice(
                "option selective=True says how recomputed blocks recompute, and checkpointing='none' recomputes none",
                "selective keeps a recomputed block's matmul outputs; which blocks recompute is checkpointing's choice",
                "add checkpointing='full' (every block, as torchtitan's selective op mode) or 'auto' (the solver chooses)",
            ))
        if self.checkpoints and self.objective == "makespan":
            raise ConstraintError(advice(
                f"option checkpointing={self.checkpointing!r} (or recompute=) is planned for pipeline stages, and "
                "objective='makespan' has none", "the makespan objective schedules single nodes, not checkpointed blocks",
                "use objective='pipeline', or checkpointing='none'",
            ))
        if self.checkpoints and entry is not None and entry.split_backward:
            raise ConstraintError(advice(
                f"option checkpointing={self.checkpointing!r} (or recompute=) with schedule={self.schedule!r}, whose backward "
                "is split into input and weight passes", "a checkpointed block's recomputation across torch's split "
                "backward is not tested here, and a split that trains differently is worse than none",
                "use a schedule with a whole backward (gpipe, 1f1b, interleaved1f1b, loopedbfs), or checkpointing='none'",
            ))

    def replace(self, **changes: Any) -> PlanOptions:
        """These options with ``changes`` (checked like new ones)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConstraintError(advice(
                f"unknown option(s) {unknown}", "a misspelt or removed option name", f"use one of {self.option_names()}"
            ))
        return dataclasses.replace(self, **changes)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @property
    def searches(self) -> bool:
        """Some of schedule, stages per rank, micro-batches and selective recomputation are ``"auto"``: the planner chooses them."""
        return AUTO in (self.schedule, self.stages_per_rank, self.micro_batches) or (self.selective == AUTO and self.checkpoints)

    @property
    def meshes(self) -> bool:
        """The devices hold more than one pipeline: the planner lays the mesh's degrees over them (a degree or
        :attr:`replicate` is ``"auto"``, or a degree is above 1)."""
        degrees = (self.data_parallel, self.tensor_parallel, self.expert_parallel, self.context_parallel)
        return AUTO in (*degrees, self.replicate) or any(d != 1 for d in degrees)

    # The degrees as counts, 1 while one is "auto" (not chosen yet): tp, cp, ep, and replicas (data_parallel's)
    tp = property(lambda self: _count(self.tensor_parallel))
    cp = property(lambda self: _count(self.context_parallel))
    ep = property(lambda self: _count(self.expert_parallel))
    replicas = property(lambda self: _count(self.data_parallel))

    @property
    def dp_shard(self) -> int:
        """The mesh's ``dp_shard`` degree these options give: :attr:`replicas` when
        :attr:`replicate` is ``"fully_shard"``, else 1."""
        return self.replicas if self.replicate == "fully_shard" else 1

    @property
    def checkpoints(self) -> bool:
        """Some block may be recomputed: :attr:`checkpointing` is not ``"none"``, or :attr:`recompute` asks for one."""
        return self.checkpointing != "none" or any((self.recompute or {}).values())

    @property
    def rank_stages(self) -> int:
        """Stages per rank: :attr:`stages_per_rank`, or the fewest the schedule runs."""
        if isinstance(self.stages_per_rank, int):
            return self.stages_per_rank
        return schedules.lookup(self.schedule).stages_per_rank[0]

    def micro_batches_for(self, ranks: int | None, batch: int | None = None) -> int:
        """The number of micro-batches for ``ranks`` devices (None: not known yet, only the batch is
        checked) and a batch of ``batch`` rows: 1 when sequential and for the makespan objective (one
        whole batch); by default the largest count ≤ 4 × stages that divides the batch and that the
        schedule runs; an explicit count that does not divide the batch, or that the schedule cannot
        run, is refused. Still ``"auto"`` (the planner's search decides): 1."""
        if isinstance(self.micro_batches, int) and batch is not None and batch % self.micro_batches:
            divisors = [m for m in range(1, batch + 1) if batch % m == 0]
            raise ConstraintError(advice(
                f"micro_batches={self.micro_batches} does not divide the batch of {batch} rows",
                "every micro-batch of a pipeline has the same shape",
                f"pass micro_batches= one of {divisors}, or None for the default",
            ))
        if AUTO in (self.schedule, self.stages_per_rank, self.micro_batches):  # the count is the search's
            return 1
        entry = schedules.lookup(self.schedule)
        if not entry.micro_batched or self.objective == "makespan":
            return 1
        known = ranks is not None and entry.torch_class is not None
        ranks = ranks or 1
        stages = ranks * self.rank_stages
        if isinstance(self.micro_batches, int):
            if known:
                entry.check(ranks=ranks, stages=stages, micro_batches=self.micro_batches)
            return self.micro_batches
        want = 4 * stages
        counts = range(1, want + 1) if batch is None else [m for m in range(1, min(want, batch) + 1) if batch % m == 0]
        runs = [m for m in counts if not known or entry.refusal(ranks=ranks, stages=stages, micro_batches=m) is None]
        if known and batch is not None and not runs:  # no count of this batch runs: say so before any work
            raise ConstraintError(advice(
                f"schedule {entry.name!r} with {stages} stages on {ranks} ranks and a batch of {batch} rows",
                f"no micro-batch count that divides the batch runs: {entry.refusal(ranks=ranks, stages=stages, micro_batches=max(counts))}",
                "a larger batch, fewer devices, or another schedule (gpipe runs any count)",
            ))
        return max(runs or counts)


def _count(degree: int | str) -> int:
    return 1 if isinstance(degree, str) else int(degree)
