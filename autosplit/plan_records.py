"""The records a :class:`~autosplit.plans.Plan` holds: stage reports, solver provenance, step terms, tasks.

Plain frozen dataclasses, torch-free, read back from JSON field by field
(:mod:`autosplit.plan_json`). Import them from :mod:`autosplit.plans`, their public home.

Usage::

    from autosplit.plans import StageReport
    plan.stages[0].memory, plan.terms.total
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FP8_SHAPES", "Alternative", "PartialRecompute", "PlannedTask", "SharedParam", "SolverInfo", "StageReport", "StepTerms"]

FP8_SHAPES = "FP8 GEMMs take dimensions that are multiples of 16"
"""Why a linear of another shape stays bf16 (:attr:`~autosplit.plans.Plan.float8_kept`): the engines skip it themselves."""


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
        whole, rest = divmod(micro_batches, self.window)  # each whole window recomputes all but its first keep
        return whole * max(0, self.window - self.keep) + max(0, rest - self.keep)


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
    is a proven lower bound on :attr:`~autosplit.plans.Plan.step_time` itself over every split of the plan's schedule,
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
    """What the predicted step is made of (seconds); :attr:`~autosplit.plans.Plan.step_time` is their sum."""

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
    data_parallel: int = 1
    """Data-parallel copies of the configuration (:attr:`~autosplit.plans.Plan.data_parallel`)."""
    dp_shard: int = 1
    """Of them, the degree that shards (:attr:`~autosplit.plans.Plan.dp_shard`)."""
    tensor_parallel: int = 1
    """Devices each stage's tensors are split over (:attr:`~autosplit.plans.Plan.tensor_parallel`)."""
    expert_parallel: int = 1
    """Of ``dp_shard × tp``, the ranks each MoE layer's experts are spread over (:attr:`~autosplit.plans.Plan.expert_parallel`)."""
    context_parallel: int = 1
    """Devices each sequence is split over (:attr:`~autosplit.plans.Plan.context_parallel`)."""
    bound: float | None = None
    """The least step any split of the configuration can reach, where the search proved one (seconds)."""
    selective: bool = False
    """Its recomputed blocks keep their matmuls' outputs (``selective="auto"`` tries both)."""

    @property
    def fits(self) -> bool:
        return math.isfinite(self.step_time)
