"""The distributed runtime: a plan's stages as ``torch.distributed.pipelining`` stages, one per
process, replicated data-parallel over a ``("pp", "dp")`` device mesh (Pal et al.'s hybrid:
each data-parallel worker is a group of devices across which the model is split).

Every rank of an initialised process group calls :func:`distribute` with the same model,
example batch and options. World size = ``data_parallel × stages``; on the mesh, ``pp`` is the
outer dimension (as in torchtitan), so rank ``r`` runs stage ``r // data_parallel`` of replica
``r % data_parallel``.

1. Every rank captures and annotates the model; rank 0 solves (or every rank loads the plan
   file) and the plan is broadcast; every rank checks the graph fingerprint against its own
   capture, so all ranks run the same split of the same model.
2. Codegen's chain form (:func:`~autosplit.passes.codegen.generate_chain`) gives each stage
   a module that receives only from its predecessor and sends only to its successor, tensors
   only, contiguous, with static per-micro-batch metadata — so ``PipelineStage`` needs no
   shape-inference round trip. Each stage posts all of a step's receives when the step begins
   (:class:`~autosplit.runtime.stage.EarlyReceivingStage`).
3. With ``data_parallel > 1`` each stage's module is wrapped in FSDP2's ``replicate`` (or
   ``fully_shard``), as ``distribute(replicate=...)`` names it, over the mesh's ``dp`` group; the pipelining schedule synchronises
   gradients once per step, on the last micro-batch's backward.
4. A tied parameter read by several stages (GPT's embedding and head) is either sent with the
   activations every micro-batch, or replicated on each stage that reads it with its
   gradient summed across them once per step (DeepSpeed's TiedLayerSpec) — whichever the
   cost model finds cheaper; the plan records which.
5. Every step begins with one small ``all_gather`` of each rank's batch rows and a digest of its
   input and target shapes, so every rank refuses a disagreement before any stage computes. A
   batch of other rows than the example's (a data loader's last batch) runs with stages whose
   static metadata is rebuilt for its micro-batch shape — same module, same parameters — if
   the stages' code does not fix the rows; it is cut into the plan's ``M`` micro-batches, or
   the most below ``M`` that divide it and that the schedule runs, and refused otherwise.
6. Entries of the model's ``state_dict`` that no stage reads (a parameter ``forward`` never
   uses) are kept by stage 0, so state dicts and :meth:`~DistributedModel.parameters` hold the
   whole model.
7. Every rank runs its stages in the plan's precision (:mod:`autosplit.runtime.precision`): each
   stage's forward and the loss under ``torch.autocast`` for the mixed ones (the static metadata
   carry the dtypes autocast gives the crossings), or bf16 parameters and inputs for ``"bf16"``;
   ``"fp16-mixed"`` scales the loss and skips, on every rank, a step with an inf or NaN gradient
   (:attr:`DistributedModel.scaler`).
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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autosplit import schedules
from autosplit.compat import forward_only_order, forward_only_step, replicate_chunk_spec, set_kwargs_chunk_spec
from autosplit.errors import AutosplitError, DistributedError, advice
from autosplit.microbatch import batch_size, is_batched
from autosplit.passes.codegen import Chain
from autosplit.plans import Plan
from autosplit.runtime.batches import check_batches, code_change, describe, digest, shapes
from autosplit.runtime.checkpoint import StageState
from autosplit.runtime.compiled import CompileOptions, compile_stages
from autosplit.runtime.loop import TrainingLoop
from autosplit.runtime.materialise import StageNames
from autosplit.runtime.placement import Layout, reduce_sparse_gradients, replicate_stage
from autosplit.runtime.precision import LossScaler, autocast, cast_inputs, hold
from autosplit.runtime.stage import Span

__all__ = ["DistributedModel"]

log = logging.getLogger(__name__)


@dataclass
class _Run:
    """The schedule that runs batches of one size, over a stage whose static metadata is that
    size's micro-batch shape."""

    schedule: Any
    micro_batches: int
    stages: list[Any]
    started: bool = False
    forward_only: bool = False


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


class DistributedModel(StageState, TrainingLoop):
    """This rank's stage of a pipelined, data-parallel model. Made by :func:`distribute`."""

    def __init__(
        self, *, modules: Mapping[int, torch.nn.Module], names: StageNames, plan: Plan, chain: Chain, layout: Layout,
        device: torch.device, loss_fn: Callable[[Any, Any], torch.Tensor],
        pp_group: Any, dp_mesh: Any, replication: str, input_names: Sequence[str], to_flat: Callable[..., list[Any]],
        micro_batches: int, example: Sequence[Any], chain_at: Callable[[int], Chain],
        tied_groups: Sequence[tuple[str, Any]] = (), asynchronous: str | None = None, aliases: Mapping[str, Sequence[str]] = {},
        compiled: CompileOptions | None = None,
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
        self.precision = plan.precision
        """The plan's precision, which every stage of every rank runs in (:mod:`autosplit.runtime.precision`)."""
        for stage_module in modules.values():
            hold(stage_module, plan.precision)
        self.scaler = LossScaler(device) if plan.precision == "fp16-mixed" else None
        """The fp16 loss scaler :meth:`step` uses (``"fp16-mixed"`` only; its ``state_dict`` is GradScaler's)."""
        self._sparse_tables: list[torch.nn.Parameter] = []
        """Tables replicated apart from FSDP2, their sparse gradients averaged after each step."""
        self._dp_mesh = dp_mesh
        self.compiled: dict[int, str] = {}
        """Stage → ``"compiled"`` or ``"eager: <cause>"`` under ``compile=``; empty when eager."""
        if compiled is not None:  # before FSDP2 wraps the stages, as torchtitan orders them
            options = {f.name: getattr(compiled, f.name) for f in dataclasses.fields(compiled)}
            self.compiled = compile_stages(modules, **options, device_types={device.type})
        if layout.replicas > 1:
            for stage_module in modules.values():
                self._sparse_tables += replicate_stage(stage_module, replication, dp_mesh)
        self._pp_group = pp_group
        # static metadata: no dry-run forward (it would touch BatchNorm statistics)
        self._stages = self._new_stages(chain.inputs_meta, chain.outputs_meta)
        # The example fixes every input's shape but the batch rows (dimension 0 of the batched ones).
        self._rows = batch_size(example)
        self._batched = [is_batched(v, self._rows) for v in example]
        self._shapes = shapes(example)
        self._chain_at = chain_at
        self._runs: dict[tuple[int | None, str], _Run] = {}
        """(batch rows, kind: "train", "loss" or "output") → the schedule that runs such batches."""
        self._unrunnable: dict[int, str] = {}
        """Micro-batch rows the stages cannot run → why."""

        def loss(out: Any, target: Any) -> torch.Tensor:
            start = time.perf_counter()
            with autocast(plan.precision, device.type):  # the loss too, as PyTorch's autocast recipe has it
                value = loss_fn(chain.output(out if isinstance(out, (tuple, list)) else (out,)), target)
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

        self._loss = loss
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
        self._pp_group = self._dp_mesh = None
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

    def _make_schedule(self, stages: list[Any], micro_batches: int, kind: str = "train") -> Any:
        """The torch schedule over ``stages``: the plan's class (``ScheduleGPipe`` for the forward-only
        runs of an asynchronous plan), with the loss unless ``kind`` is ``"output"`` (forward only)."""
        from torch.distributed import pipelining
        from torch.distributed.pipelining.microbatch import TensorChunkSpec

        # Inputs are cut as the example was (runtime/microbatch.py's rule, applied to the example,
        # so an unbatched input is never cut because its dimension 0 happens to match a batch's
        # rows); the rest are given whole to every micro-batch.
        specs = {k: TensorChunkSpec(0) if cut else replicate_chunk_spec() for k, cut in zip(self._input_names, self._batched)}
        cls: Any = self._schedule_cls or pipelining.ScheduleGPipe
        given = stages if self._entry.order == "torch" else stages[0]  # torch's multi-stage classes take a list
        loss = None if kind == "output" else self._loss
        if cls.__name__ == "ScheduleLoopedBFS":
            # Its constructor takes no chunk specs (torch 2.13) and would cut every input tensor on
            # dimension 0; the base class keeps them in this attribute, so the specs go there.
            schedule = cls(given, n_microbatches=micro_batches, loss_fn=loss, scale_grads=False)
            set_kwargs_chunk_spec(schedule, specs)
        else:
            schedule = cls(given, n_microbatches=micro_batches, loss_fn=loss, kwargs_chunk_spec=specs, scale_grads=False)
        if kind != "train" and self._entry.order == "torch":
            layout = self.layout
            ranks = {s: self._entry.rank_of(s, layout.stages, layout.pp) for s in range(layout.stages)}
            forward_only_order(schedule, ranks, micro_batches)
        return schedule

    def step(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor | None:
        """One training step (forward and backward of every micro-batch) on this replica's batch.

        Call it on every rank with the same batch arguments as the model's ``forward`` takes
        (each stage reads the inputs it uses; ``target`` is read by the last stage). Gradients
        accumulate into :meth:`parameters`, averaged over micro-batches as the full batch's
        mean loss would give; then step your optimizer. Returns the batch's loss (the mean of
        the micro-batch losses) on the last stage's ranks, ``None`` elsewhere.

        Every rank must pass a batch of the same shape; it may have other rows than the example
        (a data loader's last batch): see item 5 of this module's docstring. A disagreement, or
        a batch no stage can run, raises :class:`DistributedError` on every rank before any
        stage computes, and the pipeline stays usable.
        """
        self._usable()
        if self.asynchronous is not None:
            raise DistributedError(advice(
                f"step() runs one flushed step, and this pipeline runs the asynchronous {self.asynchronous!r} schedule",
                "an asynchronous pipeline overlaps mini-batches, so it takes them all at once",
                "call pipe.run(batches, optimizer=opt), or distribute with schedule='gpipe' or '1f1b'",
            ))
        flat, run = self._begin(inputs, kwargs, target, "train")
        kept = self._set_aside_gradients(run)
        run.started = True
        with self._failing("a pipelined step"):
            run.schedule.step(  # the last stage's outputs are not returned: kept, they would hold M of them to the end
                target=target if self.is_last else None, return_outputs=False,
                **dict(zip(self._input_names, cast_inputs(flat, self.precision))),
            )
        if self._sparse_tables:
            reduce_sparse_gradients(self._sparse_tables, self._dp_mesh)
        self._sum_tied_gradients()
        if self.scaler is not None and self.scaler.unscale_and_update(self.module.parameters()):
            kept = []  # the optimizer's step is skipped, as GradScaler.step skips it
        with torch.no_grad():
            for p, earlier in kept:
                p.grad = earlier if p.grad is None else p.grad + earlier
        if not self.is_last:
            return None
        return torch.stack(self._step_losses).mean()

    def _begin(self, inputs: Sequence[Any], kwargs: Mapping[str, Any], target: Any, kind: str) -> tuple[list[Any], _Run]:
        """A step's inputs, flat, and the run of ``kind`` for their rows, once every rank agrees on them."""
        self._usable()
        if self._failed is not None:
            raise DistributedError(advice(
                f"this pipeline failed in an earlier step ({self._failed})",
                "a failed step leaves the stages and the process group in an unknown state",
                "re-create it with autosplit.distribute after fixing the cause (and a new process group if it was torn down)",
            ))
        flat = self._to_flat(tuple(inputs), dict(kwargs))
        rows = self._agree_on_batch(flat, target, targeted=kind != "output")
        run = self._run_for(rows, flat, kind)
        self._step_losses = []
        self._step_micro_batches = run.micro_batches
        for stage in run.stages:
            stage.timeline = self._timeline
        return flat, run

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """Any error inside as a :class:`DistributedError` naming this rank; the pipeline is failed."""
        try:
            yield
        except Exception as e:
            # A peer blocked on this rank fails when this process exits (gloo: "connection closed
            # by peer", at once) or at the process group's timeout, whichever comes first.
            self._failed = _causes(e)
            raise DistributedError(advice(
                f"rank {self._rank} ({self._held_text()} of {self.layout.stages}, replica {self.layout.replica}) "
                f"failed during {what}: {_causes(e)}",
                "an error in this stage's forward/backward, or a peer rank that failed or exited",
                "look for the first rank that failed (its error names the node); run the model unsplit on one batch to reproduce",
            )) from e

    def _forward_only(self, inputs: Sequence[Any], kwargs: Mapping[str, Any], *, target: Any) -> Any:
        """Run the batch forward only (torch's ``eval`` of the schedule, under ``no_grad``), with the
        loss when ``target`` is given; returns the last stage's merged outputs (``target`` None) on
        the last stage's ranks. Every ``.grad`` is put back as it was (torch's pipelining clears
        FSDP2's gradients when it first prepares a schedule's stages)."""
        flat, run = self._begin(inputs, kwargs, target, "output" if target is None else "loss")
        grads = [(p, p.grad) for p in self.module.parameters()]
        try:
            with torch.no_grad(), self._failing("a forward-only step"):
                out = forward_only_step(
                    run.schedule, return_outputs=target is None, target=target if self.is_last else None,
                    **dict(zip(self._input_names, cast_inputs(flat, self.precision))),
                )
        finally:
            for p, g in grads:
                p.grad = g
        run.started = True
        return out if self.is_last else None

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

    def _sum_tied_gradients(self) -> None:
        """A replicated tied weight: its copies' gradients summed — this rank's (a V's two arms hold
        one each), then over the other ranks that hold one (its group) — into every copy, once per step."""
        own = dict(self.module.named_parameters(remove_duplicate=False))

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        for name, group in self._tied:
            copies = [own[n] for n in (name, *self._aliases.get(name, ()))]
            grads = [local(p.grad) for p in copies if p.grad is not None]
            if not grads:
                continue
            total = grads[0]
            for g in grads[1:]:
                total.add_(g)
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads[1:]:
                g.copy_(total)

    # -- batches of another size -----------------------------------------------------------------
    def _agree_on_batch(self, flat: Sequence[Any], target: Any, *, targeted: bool = True) -> int | None:
        """This batch's rows, once every rank has seen every rank's rows and shape digests (one
        ``all_gather`` of four int64 per rank); raises the same error on every rank unless they agree
        (on a target of the batch's rows on the last stage's ranks too, when ``targeted``)."""
        rows = batch_size(flat)
        cut = isinstance(target, torch.Tensor) and target.dim() > 0
        mine = torch.tensor(
            [-1 if rows is None else rows, digest(shapes(flat)),
             int(target.shape[0]) if cut else -1, digest(shapes([target])) if cut else 0],
            dtype=torch.int64, device=self.device,
        )
        table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        try:
            dist.all_gather(table, mine)
        except Exception as e:
            self._failed = _causes(e)
            raise DistributedError(advice(
                f"rank {self._rank} could not compare its batch with the other ranks': {_causes(e)}",
                "a peer rank failed, exited, or did not call step() (the process group's timeout)",
                "look for the first rank that failed; call step() on every rank with a batch of the same shape",
            )) from e
        last = [self.layout.rank(self.layout.stages - 1, r) for r in range(self.layout.replicas)] if targeted else []
        check_batches(torch.stack(table).tolist(), last)
        return rows

    def _run_for(self, rows: int | None, flat: Sequence[Any], kind: str = "train") -> _Run:
        """The schedule for a batch of ``rows`` rows (every rank has the same, so every rank finds
        the same, or raises the same error): ``kind`` ``"train"``, or forward only with the loss
        (``"loss"``) or the output (``"output"``), on stages of their own."""
        expected = [((rows, *sig[0][1:]), sig[1]) if cut else sig for sig, cut in zip(self._shapes, self._batched)]
        got = shapes(flat)
        if got != expected:
            i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), 0)
            raise DistributedError(advice(
                f"input {self._input_names[i]!r} is {describe(got[i])} where a batch of {rows} rows like the example "
                f"({self._rows} rows) has {describe(expected[i])}" if len(got) == len(expected) else
                f"the batch has {len(got)} input values where the example has {len(expected)}",
                "the stages' code and receive buffers keep the example's shapes except the batch rows "
                "(dimension 0 of the batched inputs): sequence lengths, features and dtypes are fixed",
                "pad inputs to the example's shape (masking the padding), or distribute with an example of this shape",
            ))
        if (rows, kind) not in self._runs:
            self._runs[rows, kind] = self._new_run(rows, kind)
        return self._runs[rows, kind]

    def _new_run(self, rows: int | None, kind: str) -> _Run:
        M = self.micro_batches
        if rows is None or self._rows is None or rows == self._rows:
            stages = self._stages if kind == "train" else self._new_stages(self.chain.inputs_meta, self.chain.outputs_meta)
            return _Run(self._make_schedule(stages, M, kind), M, stages)
        layout = self.layout
        fewest = self._entry.fewest_micro_batches(layout.stages, layout.pp)
        counts = [m for m in range(M, fewest - 1, -1)
                  if rows % m == 0 and self._entry.refusal(ranks=layout.pp, stages=layout.stages, micro_batches=m) is None]
        for m in counts:
            metadata = self._metadata(rows // m)
            if metadata is not None:
                log.info("a batch of %d rows runs as %d micro-batches of %d rows (planned: %d of %d)",
                         rows, m, rows // m, M, self._rows // M)
                stages = self._new_stages(*metadata)
                return _Run(self._make_schedule(stages, m, kind), m, stages)
        why = "; ".join(f"micro-batches of {rows // m} rows: {self._unrunnable[rows // m]}" for m in counts)
        raise DistributedError(advice(
            f"a batch of {rows} rows cannot run on this pipeline (planned: {self._rows} rows in {M} micro-batches); "
            + (why or f"no micro-batch count from {fewest} to {M} divides {rows}"),
            f"every micro-batch must have the same shape, and the {self.plan.schedule} schedule on "
            f"{self.layout.stages} stages runs {fewest} to {M} micro-batches here",
            f"drop the last partial batch (DataLoader(drop_last=True)), pad it to {self._rows} rows (masking the "
            f"padding out of the loss), or distribute with micro_batches= dividing every batch size",
        ))

    def _metadata(self, micro: int) -> tuple[Sequence[Sequence[torch.Tensor]], Sequence[Sequence[torch.Tensor]]] | None:
        """Every stage's static input and output metadata for micro-batches of ``micro`` rows, or
        None (the reason in ``_unrunnable``) when the stages' code fixes the plan's rows."""
        planned = (self._rows or 0) // self.micro_batches
        if micro == planned:
            return self.chain.inputs_meta, self.chain.outputs_meta
        if micro not in self._unrunnable:
            try:
                base, other = self._chain_at(planned), self._chain_at(micro)
            except Exception as e:  # noqa: BLE001 -- any failure to capture at this shape refuses it, with its cause
                self._unrunnable[micro] = f"the model could not be captured at this shape ({_causes(e)})"
            else:
                changed = code_change(base, other)
                if changed is None and other.crossings == self.chain.crossings:
                    return other.inputs_meta, other.outputs_meta
                self._unrunnable[micro] = changed or "other values cross the stages at this shape"
        return None

    def _set_aside_gradients(self, run: _Run) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The gradients earlier steps left that this step's own handling would touch, taken out
        (``grad`` set to None) to add back after the step, so that several steps add up as several
        ``backward()`` calls do:

        - every gradient under fp16 loss scaling (only this step's are scaled, checked and unscaled);
        - the copies of a replicated tied weight (this step's parts are summed across the copies);
        - FSDP2-managed gradients when a schedule first prepares its stages, which torch's pipelining
          sets to None then (``_post_metadata_inference_cleanup``): a new batch size, a first step."""
        if self.scaler is not None:
            params: list[torch.Tensor] = list(self.module.parameters())
        else:
            params = self._tied_copies() + ([] if run.started else self._fsdp_parameters())
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in {id(p): p for p in params}.values():
            if p.grad is not None:
                kept.append((p, p.grad))
                p.grad = None
        return kept

    def _tied_copies(self) -> list[torch.Tensor]:
        own = dict(self.module.named_parameters(remove_duplicate=False))
        return [own[n] for name, _ in self._tied for n in (name, *self._aliases.get(name, ()))]

    def _fsdp_parameters(self) -> list[torch.Tensor]:
        from torch.distributed.fsdp import FSDPModule

        return [p for m in self.module.modules() if isinstance(m, FSDPModule) for p in m.parameters()]

    def run(self, batches: Sequence[Any], *, optimizer: torch.optim.Optimizer) -> list[torch.Tensor | None]:
        """Train on ``batches`` — each ``(inputs, target)`` or ``(inputs, kwargs, target)``, one
        mini-batch of the example's shape — with this pipeline's asynchronous schedule (no flush
        between mini-batches; see :mod:`autosplit.runtime.asynchronous`). Call it on every rank
        with the same batches. The runtime steps ``optimizer`` (over :meth:`parameters`) after
        each mini-batch's last backward and zeroes its gradients. Returns each mini-batch's loss
        on the last stage's rank, ``None`` elsewhere; :attr:`last_run` says what the run kept."""
        from autosplit.runtime.asynchronous import check_optimizer, run_asynchronous

        self._usable()
        if self.asynchronous is None:
            raise DistributedError(advice(
                "run() trains with asynchronous schedules, and this pipeline flushes every step",
                f"its plan's schedule is {self.plan.schedule!r}",
                "call step() per batch, or distribute with schedule='xpipe', 'async' or 'pipedream'",
            ))
        check_optimizer(self.asynchronous, optimizer)
        flat_batches = []
        for i, item in enumerate(batches):
            inputs, kwargs, target = item if len(item) == 3 else (item[0], {}, item[1])
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
            flat = self._to_flat(inputs, dict(kwargs))
            # Every rank is given the same batches, so every rank refuses the same one, before any compute.
            rows = int(target.shape[0]) if isinstance(target, torch.Tensor) and target.dim() > 0 else None
            if shapes(flat) != self._shapes or (self._rows is not None and rows != self._rows):
                got = [f"{n}: {describe(v)}" for n, v in zip(self._input_names, shapes(flat))]
                want = [f"{n}: {describe(v)}" for n, v in zip(self._input_names, self._shapes)]
                raise DistributedError(advice(
                    f"mini-batch {i} of {len(batches)} has inputs {got} and a target of {rows} rows, where the "
                    f"example has {want} and {self._rows} rows",
                    "an asynchronous pipeline runs every mini-batch with the example's shapes: its receive "
                    "buffers and its simulated schedule are fixed when it starts",
                    "give run() mini-batches of the example's shape (DataLoader(drop_last=True)); train a last "
                    "partial batch with a flushed pipeline (schedule='gpipe' or '1f1b'), or drop it",
                ))
            flat_batches.append((flat, target))
        stage, stages = self.layout.stage, self.layout.stages
        peers = (self.layout.rank(stage - 1) if stage > 0 else None, self.layout.rank(stage + 1) if stage < stages - 1 else None)
        try:
            losses, self.last_run = run_asynchronous(
                schedule=self.asynchronous, chain=self.chain, stage=stage, stages=stages, module=self.module,
                device=self.device, batches=flat_batches, micro_batches=self.micro_batches, optimizer=optimizer,
                loss_fn=self._loss_of_output, peers=peers,
            )
        except AutosplitError:
            raise
        except Exception as e:
            self._failed = _causes(e)
            raise DistributedError(advice(
                f"rank {self._rank} (stage {stage} of {stages}) failed during asynchronous training: {_causes(e)}",
                "an error in this stage's forward/backward, or a peer rank that failed or exited",
                "look for the first rank that failed; run the model unsplit on one batch to reproduce",
            )) from e
        return losses

    def __repr__(self) -> str:
        return (
            f"DistributedModel({self._held_text()} of {self.layout.stages}, "
            f"replica {self.layout.replica} of "
            f"{self.layout.replicas}, {self.plan.schedule} × {self.micro_batches} micro-batches, device {self.device})"
        )


def _causes(e: BaseException | None) -> str:
    """The first line of each exception in the chain: ``RuntimeError: … ← ValueError: …``."""
    lines: list[str] = []
    while e is not None and len(lines) < 4:
        text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        lines.append(f"{type(e).__name__}: {text[:300]}")
        e = e.__cause__ or e.__context__
    return " ← ".join(lines)


