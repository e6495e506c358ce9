"""The distributed runtime: a plan's stages as ``torch.distributed.pipelining`` stages, one per
process, with data-parallel copies on a ``("pp", "dp_replicate", "dp_shard", "tp")`` device mesh
(torchtitan's; Pal et al.'s hybrid: each data-parallel worker is a group of devices across which the
model is split).

Every rank of an initialised process group calls :func:`~autosplit.api.distributed.distribute` with the same model,
example batch and options. World size = pp × dp_replicate × dp_shard × tp (the plan's
:attr:`~autosplit.plans.Plan.mesh`: ``data_parallel × stages × tensor_parallel``); pp is the outermost
dimension and tp the innermost, so rank ``r`` runs stage ``r // (data_parallel · tp)`` of the copy
``(r // tp) % data_parallel`` at place ``r % tp`` along tp (:mod:`autosplit.runtime.placement`). Under a
plan's :attr:`~autosplit.plans.Plan.tensor_parallel` each stage's parameters are DTensors on the mesh's
tp, split as its :attr:`~autosplit.plans.Plan.tp_shards` says (:mod:`autosplit.runtime.tensor_parallel`).

1. Every rank captures and annotates the model; rank 0 solves (or every rank loads the plan
   file) and the plan is broadcast; every rank checks the graph fingerprint against its own
   capture, so all ranks run the same split of the same model.
2. Codegen's chain form (:func:`~autosplit.passes.chain.generate_chain`) gives each stage
   a module that receives only from its predecessor and sends only to its successor, tensors
   only, contiguous, with static per-micro-batch metadata — so ``PipelineStage`` needs no
   shape-inference round trip. Each stage posts all of a step's receives when the step begins
   (:class:`~autosplit.runtime.stage.EarlyReceivingStage`).
3. With ``data_parallel > 1`` each stage's module is wrapped in FSDP2's ``replicate`` over the
   mesh's ``dp_replicate`` dimension or ``fully_shard`` over its ``dp_shard`` one (HSDP over both, from
   a given plan), as ``distribute(replicate=...)`` names it, without resharding after forward
   (torchtitan's choice under pipelining: one all-gather per stage and step; each stage is one unit; FSDP
   alone in one pass: each repeated block outlined as a module of its own and resharded after forward). The
   pipelining schedule synchronises gradients once per step, on the last micro-batch's backward. One
   stage (``distribute(model, ["cpu"] * N, data_parallel=N, replicate="fully_shard")``) is a pipeline too.
4. A tied parameter read by several stages (GPT's embedding and head) is either sent with the
   activations every micro-batch, or replicated on each stage that reads it with its
   gradient summed across them once per step (DeepSpeed's TiedLayerSpec) — whichever the
   cost model finds cheaper; the plan records which.
5. Every step begins with one small ``all_gather`` of each rank's batch rows and a digest of its
   input and target shapes, so every rank refuses a disagreement before any stage computes. A
   batch of other rows than the example's (a data loader's last batch) runs with stages whose
   static metadata is rebuilt for its micro-batch shape — same module, same parameters — if
   the stages' code does not fix the rows; it is cut into the plan's ``M`` micro-batches, or
   the most below ``M`` that divide it and that the schedule runs, and refused otherwise
   (:mod:`autosplit.runtime.runs`; the step itself: :mod:`autosplit.runtime.flushed`).
6. Entries of the model's ``state_dict`` that no stage reads (a parameter ``forward`` never
   uses) are kept by stage 0, so state dicts and :meth:`~DistributedModel.parameters` hold the
   whole model.
7. Every rank runs its stages in the plan's precision (:mod:`autosplit.runtime.precision`): each
   stage's forward and the loss under ``torch.autocast`` for the mixed ones (the static metadata
   carry the dtypes autocast gives the crossings; each weight cast once per step, the copy shared
   by every micro-batch: :func:`~autosplit.runtime.precision.cast_once`), or bf16 parameters and
   inputs for ``"bf16"``; ``"fp16-mixed"`` scales the loss and skips, on every rank, a step with
   an inf or NaN gradient (:attr:`DistributedModel.scaler`).
8. :meth:`DistributedModel.close` lets go of the stages and the process groups they run on, which
   reference cycles would otherwise keep (with gloo's threads) past ``destroy_process_group()``;
   every pipeline still open is closed when the interpreter begins to exit.

Usage (``torchrun --nproc-per-node 2 train.py``)::

    dist.init_process_group("gloo")
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(tokens,), loss_fn=loss_fn)
    opt = torch.optim.Adam(pipe.parameters())
    for tokens, targets in data:
        loss = pipe.step(tokens, target=targets)     # the loss on the last stage, None elsewhere
        opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autosplit import schedules
from autosplit.errors import DistributedError, advice
from autosplit.microbatch import batch_size, is_batched
from autosplit.passes.chain import Chain
from autosplit.passes.float8_stages import to_float8
from autosplit.passes.outline import outline_blocks
from autosplit.passes.param_dtype import PARAM_CAST
from autosplit.passes.sharding import sharded_alone
from autosplit.plans import Plan
from autosplit.runtime.asynchronous import AsynchronousRun
from autosplit.runtime.batches import shapes
from autosplit.runtime.checkpoint import StageState
from autosplit.runtime.compiled import CompileOptions, compile_stages
from autosplit.runtime.flushed import FlushedStep
from autosplit.runtime.loop import TrainingLoop
from autosplit.runtime.materialise import StageNames
from autosplit.runtime.placement import Layout, replicate_stage
from autosplit.runtime.precision import LossScaler, autocast, hold
from autosplit.runtime.runs import Run
from autosplit.runtime.stage import Span
from autosplit.runtime.tensor_parallel import Reductions, parallelize_stage

__all__ = ["DistributedModel"]

log = logging.getLogger(__name__)


_open: weakref.WeakSet[DistributedModel] = weakref.WeakSet()
"""The pipelines of this process not yet closed."""


@atexit.register
def _close_all() -> None:
    """Close every open pipeline, and collect those already dropped, before the interpreter tears
    itself down (atexit runs first): a process group that outlives it can abort the process in
    gloo's teardown (:meth:`DistributedModel.close`)."""
    for pipe in list(_open):
        pipe._release()
    gc.collect()


class DistributedModel(StageState, TrainingLoop, FlushedStep, AsynchronousRun):
    """This rank's stage of a pipelined, data-parallel model. Made by :func:`~autosplit.api.distributed.distribute`.

    Its parts: the flushed step (:mod:`autosplit.runtime.flushed`), the runs per batch size
    (:mod:`autosplit.runtime.runs`), asynchronous training (:mod:`autosplit.runtime.asynchronous`),
    the training loop's verbs (:mod:`autosplit.runtime.loop`), weights and checkpoints
    (:mod:`autosplit.runtime.checkpoint`).
    """

    def __init__(
        self, *, modules: Mapping[int, torch.nn.Module], names: StageNames, plan: Plan, chain: Chain, layout: Layout,
        device: torch.device, loss_fn: Callable[[Any, Any], torch.Tensor],
        pp_group: Any, dp_mesh: Any, replication: str, input_names: Sequence[str], to_flat: Callable[..., list[Any]],
        micro_batches: int, example: Sequence[Any], chain_at: Callable[[int], Chain],
        tied_groups: Sequence[tuple[str, Any]] = (), asynchronous: str | None = None, aliases: Mapping[str, Sequence[str]] = {},
        compiled: CompileOptions | None = None, mesh: Any = None, tp_shards: Mapping[int, Mapping[str, int]] = {},
        reductions: Reductions | None = None,
    ) -> None:
        from torch.distributed import pipelining

        self.plan = plan
        self._entry = schedules.lookup(plan.schedule)
        self.chain = chain
        self.layout = layout
        self.device = device
        self.micro_batches = micro_batches
        self._to_flat = to_flat
        self._input_names = tuple(input_names)
        self.stage_modules = dict(modules)
        """Stage index → its module, for every stage this rank runs."""
        # One stage: its module; several: a container keyed by stage index (names.merged's prefixes).
        self.module = (next(iter(modules.values())) if len(modules) == 1
                       else torch.nn.ModuleDict({str(s): m for s, m in modules.items()}))
        # The model's own names for this stage's tensors (a tied weight under each of its names;
        # non-persistent buffers left out, as the model's state_dict does), fixed before
        # replication swaps the tensors for DTensors.
        self._state_names = dict(names.state)
        self._param_names = dict(names.params)
        self._aliases = {local: tuple(copies) for local, copies in aliases.items()}
        self.mesh = mesh
        """The ``("pp", "dp_replicate", "dp_shard", "tp")`` device mesh the ranks run on
        (:func:`~autosplit.runtime.placement.make_mesh`; degrees: the plan's :attr:`~autosplit.plans.Plan.mesh`)."""
        self.precision = plan.precision
        """The plan's precision, which every stage of every rank runs in (:mod:`autosplit.runtime.precision`)."""
        self._prepare_stages(modules, compiled, replication, dp_mesh, tp_shards, reductions)
        self._pp_group = pp_group
        # static metadata: no dry-run forward (it would touch BatchNorm statistics)
        self._stages = self._new_stages(chain.inputs_meta, chain.outputs_meta)
        # The example fixes every input's shape but the batch rows (dimension 0 of the batched ones).
        self._rows = batch_size(example)
        self._batched = [is_batched(v, self._rows) for v in example]
        self._shapes = shapes(example)
        self._chain_at = chain_at
        self._runs: dict[tuple[int | None, str], Run] = {}
        """(batch rows, kind: "train", "loss" or "output") → the schedule that runs such batches."""
        self._unrunnable: dict[int, str] = {}
        """Micro-batch rows the stages cannot run → why."""
        self._loss = self._micro_batch_loss
        self._timeline: list[Span] | None = None
        self._step_losses: list[torch.Tensor] = []
        self._step_micro_batches = micro_batches
        self._loss_of_output = loss_fn
        self.last_run: dict[str, Any] = {}
        torch_class = self._entry.torch_class
        # None: an asynchronous schedule, run by autosplit's own loop (train), never by a torch class
        self._schedule_cls: Any = getattr(pipelining, torch_class) if torch_class is not None else None
        self._rank = dist.get_rank()
        self._tied = [(self._state_names[name], group) for name, group in tied_groups]
        self._failed: str | None = None
        self.asynchronous = asynchronous
        """The plan's schedule when it is asynchronous (``"xpipe"``, ``"async"``, ``"pipedream"``:
        trained with :meth:`run`); None for :meth:`step`."""
        self.training = all(m.training for m in modules.values())
        """Whether the stages are in training mode (:meth:`train`, :meth:`eval`)."""
        self._closed = False
        _open.add(self)

    def _prepare_stages(
        self, modules: Mapping[int, torch.nn.Module], compiled: CompileOptions | None, replication: str, dp_mesh: Any,
        tp_shards: Mapping[int, Mapping[str, int]], reductions: Reductions | None = None,
    ) -> None:
        """Each stage module held in the plan's precision, its parameters split over the mesh's ``tp``
        (``tp_shards``: stage → local name → dimension; :mod:`autosplit.runtime.tensor_parallel`), its FP8 linears
        converted first (:mod:`autosplit.passes.float8_stages`), compiled
        under ``compile=`` and kept in step over the mesh's data-parallel sub-mesh (``dp_mesh``): torchtitan's
        order (tensor parallelism, then compile, then FSDP2)."""
        device, layout = self.device, self.layout
        for stage_module in modules.values():
            hold(stage_module, self.precision)
        self.scaler = LossScaler(device) if self.precision == "fp16-mixed" else None
        """The fp16 loss scaler :meth:`step` uses (``"fp16-mixed"`` only; its ``state_dict`` is GradScaler's)."""
        self._sparse_tables: list[torch.nn.Parameter] = []
        """Tables replicated apart from FSDP2, their sparse gradients averaged after each step."""
        self._dp_mesh = dp_mesh
        self.compiled: dict[int, str] = {}
        """Stage → ``"compiled"`` or ``"eager: <cause>"`` under ``compile=``; empty when eager."""
        # FSDP alone in one pass: a unit per block and per leaf, resharded after forward; else gathered for the step
        alone = (layout.replicas > 1 and len(modules) == 1 and replication == "fully_shard"
                 and sharded_alone(layout.stages, self.plan.micro_batches, self.plan.dp_shard))
        for stage_module in modules.values() if alone else ():  # each block a module of its own, FSDP2's hooks around it
            if isinstance(stage_module, torch.fx.GraphModule):  # before compile, as torchtitan wraps blocks (AC → compile → FSDP)
                log.debug("blocks outlined as FSDP units: %s", outline_blocks(stage_module))
        # FP8 all-gathers cast the fp32 shards: under FSDP2's bf16 policy that skips its cast, unlike the unsplit model's;
        # tp DTensor weights FSDP2 gathers as they are (torchao's FP8 all-gather of them is not run here)
        all_gather = self.plan.dp_shard > 1 and layout.replicas > 1 and self.precision not in PARAM_CAST and layout.tp == 1
        for stage_module in modules.values():  # FP8 linears before tensor parallelism, compile and FSDP2 (torchtitan's order)
            to_float8(stage_module, self.plan.float8, self.plan.float8_linears, all_gather=all_gather)
        self._fp8_all_gather = all_gather and self.plan.float8 == "tensorwise" and bool(self.plan.float8_linears)
        """FSDP2 all-gathers FP8 weights: their scales are computed before each step
        (:func:`~autosplit.passes.float8_stages.precompute_scales`)."""
        if layout.tp > 1:  # before compile and FSDP2, as torchtitan orders them
            for s, stage_module in modules.items():
                parallelize_stage(stage_module, self.mesh["tp"], tp_shards.get(s, {}), reductions)
        if compiled is not None:  # before FSDP2 wraps the stages, as torchtitan orders them
            options = {f.name: getattr(compiled, f.name) for f in dataclasses.fields(compiled)}
            self.compiled = compile_stages(modules, **options, device_types={device.type})
        if layout.replicas > 1 or self.precision in PARAM_CAST:  # the policy runs in FSDP2, on a mesh of one without copies
            experts_mesh = self.mesh["efsdp"] if "efsdp" in (getattr(self.mesh, "mesh_dim_names", None) or ()) else None
            for stage_module in modules.values():
                self._sparse_tables += replicate_stage(stage_module, replication if layout.replicas > 1 else "fully_shard", dp_mesh,
                                                       reshard_after_forward=alone, precision=self.precision, experts_mesh=experts_mesh)

    def _micro_batch_loss(self, out: Any, target: Any) -> torch.Tensor:
        """The loss torch's schedules call on the last stage's output of one micro-batch: its share of
        the batch's mean loss (scaled under ``"fp16-mixed"``); the unscaled value is kept for :meth:`step`."""
        start = time.perf_counter()
        with autocast(self.precision, self.device.type):  # the loss too, as PyTorch's autocast recipe has it
            value = self._loss_of_output(self.chain.output(out if isinstance(out, (tuple, list)) else (out,)), target)
        if self._timeline is not None:  # torch's schedules compute the micro-batches' losses in order
            self._timeline.append(Span("L", self.layout.stages - 1, len(self._step_losses), start, time.perf_counter()))
        self._step_losses.append(value.detach())
        if not torch.is_grad_enabled():  # a forward-only run: nothing flows back
            return value
        # Each micro-batch's share of the batch's mean loss: its backward adds exactly this step's
        # part to .grad, as backward() of the batch's mean would, and the schedules never rescale
        # .grad (scale_grads=False), which would divide what earlier steps accumulated too.
        share = value / self._step_micro_batches
        return share if self.scaler is None else self.scaler.scale(share)

    def close(self) -> None:
        """Let go of this rank's stages, schedules and the process groups they run on; the modules,
        parameters and state dicts stay. Afterwards :meth:`step` and :meth:`run` refuse.

        The stages sit in reference cycles (their fx graphs), so dropping the pipeline leaves its
        process groups, and gloo's threads, alive until a garbage collection: a process that exits
        with a gloo process group never destructed can abort in its teardown ("terminate called
        without an active exception", pytorch/pytorch#65513), after ``destroy_process_group()``
        too. ``close()`` collects them at once; every pipeline still open is closed when the
        interpreter begins to exit."""
        if not self._closed:
            self._release()
            gc.collect()

    def _release(self) -> None:
        self._closed = True
        _open.discard(self)
        self._runs.clear()
        self._stages = []
        self._pp_group = self._dp_mesh = self.mesh = None
        self._tied = []

    def _usable(self) -> None:
        if self._closed:
            raise DistributedError(advice(
                "this pipeline was closed", "close() let go of its stages and process groups",
                "make a new one with autosplit.distribute (its weights: pipe.state_dict())",
            ))

    # -- training ------------------------------------------------------------------------------
    @property
    def stage_index(self) -> int:
        """This rank's (first) stage."""
        return self.layout.held[0]

    @property
    def is_last(self) -> bool:
        """This rank runs the last stage (in a V, the first rank does), so it computes the loss."""
        return self.layout.stages - 1 in self.layout.held

    def _new_stages(self, inputs_meta: Sequence[Sequence[torch.Tensor]], outputs_meta: Sequence[Sequence[torch.Tensor]]) -> list[Any]:
        """This rank's ``PipelineStage`` of each stage it runs, posting a step's receives when it
        begins (:class:`~autosplit.runtime.stage.EarlyReceivingStage`). Under torch's multi-stage
        runtime, which passes tensors between a rank's stages in memory, a neighbour rank sends
        several streams (one stage's activations, another's gradients): posted early, their
        receives are matched by tag, which gloo honours and NCCL does not, so on NCCL the runtime
        posts them in its own order (:class:`~autosplit.runtime.stage.ContiguousGradStage`)."""
        from autosplit.runtime.stage import ContiguousGradStage, EarlyReceivingStage

        tagged = dist.get_backend(self._pp_group) == "gloo"
        kind = ContiguousGradStage if self._entry.order == "torch" and not tagged else EarlyReceivingStage
        return [
            kind(module, s, self.layout.stages, self.device, input_args=tuple(inputs_meta[s]),
                 output_args=tuple(outputs_meta[s]), group=self._pp_group, precision=(self.precision, self.device.type))
            for s, module in self.stage_modules.items()
        ]

    @contextlib.contextmanager
    def tracing(self) -> Iterator[list[Span]]:
        """Record when this rank's actions run in the steps taken inside: yields the list their
        :class:`~autosplit.runtime.stage.Span` are appended to, in the order they ran — each
        forward, backward (or input and weight pass) and loss of each micro-batch of each stage
        this rank runs, waits for received tensors left out. Every rank's spans share one clock
        on a host, so the ranks' lists together are the measured timeline of a step, to set beside
        the plan's replay (:func:`~autosplit.solver.replay.replay` takes measured durations)."""
        timeline: list[Span] = []
        self._timeline = timeline  # each step hands it to its stages
        try:
            yield timeline
        finally:
            self._timeline = None

    def _held_text(self) -> str:
        held = self.layout.held
        return f"stage {held[0]}" if len(held) == 1 else f"stages {list(held)}"

    def __repr__(self) -> str:
        return (
            f"DistributedModel({self._held_text()} of {self.layout.stages}, "
            f"replica {self.layout.replica} of "
            f"{self.layout.replicas}, {self.plan.schedule} × {self.micro_batches} micro-batches, device {self.device})"
        )
