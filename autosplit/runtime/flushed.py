"""The flushed step of :class:`~autosplit.runtime.distributed.DistributedModel`: one batch, forward
and backward of every micro-batch through torch's schedule, the pipeline drained at its end.

A step's gradients add up as ``backward()`` calls do: what earlier steps left that this step's own
handling would touch is set aside first (:meth:`FlushedStep._set_aside_gradients`) and added back
after; replicated tied weights' copies are summed once per step, sparse-gradient tables averaged
over the replicas apart from FSDP2, and under ``"fp16-mixed"`` the loss scaler unscales and may skip
the step. Under a mixed precision each weight is cast once per step, the copy shared by every
micro-batch (:func:`~autosplit.runtime.precision.cast_once`), in training and forward-only runs.
Forward-only runs (``pipe(...)``, ``eval_step``) go through the same begin: every rank agrees on
the batch, then finds the run for its rows (:mod:`autosplit.runtime.runs`). Any error inside a step
is a :class:`~autosplit.errors.DistributedError` naming the rank, and fails the pipeline.

Usage (every rank)::

    loss = pipe.step(tokens, target=targets)     # the loss on the last stage, None elsewhere
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autosplit.compat import forward_only_step
from autosplit.errors import DistributedError, advice, causes
from autosplit.passes.float8_stages import precompute_scales
from autosplit.runtime.placement import reduce_sparse_gradients
from autosplit.runtime.precision import cast_inputs, cast_once
from autosplit.runtime.runs import BatchRuns, Run
from autosplit.runtime.stage import Span
from autosplit.runtime.tensor_parallel import place_gradients, tp_scope

__all__ = ["FlushedStep"]


class FlushedStep(BatchRuns):
    """The flushed step and forward-only runs of :class:`~autosplit.runtime.distributed.DistributedModel`."""

    module: torch.nn.Module
    device: torch.device
    asynchronous: str | None
    precision: str
    scaler: Any
    _to_flat: Callable[..., list[Any]]
    _sparse_tables: list[torch.nn.Parameter]
    _dp_mesh: Any
    _tied: list[tuple[str, Any]]
    _aliases: dict[str, tuple[str, ...]]
    _step_losses: list[torch.Tensor]
    _step_micro_batches: int
    _timeline: list[Span] | None
    _fp8_all_gather: bool

    if TYPE_CHECKING:  # DistributedModel's

        @property
        def is_last(self) -> bool: ...

        def _usable(self) -> None: ...

        def _held_text(self) -> str: ...

    def step(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor | None:
        """One training step (forward and backward of every micro-batch) on this replica's batch.

        Call it on every rank with the same batch arguments as the model's ``forward`` takes
        (each stage reads the inputs it uses; ``target`` is read by the last stage). Gradients
        accumulate into :meth:`~autosplit.runtime.distributed.DistributedModel.parameters`, averaged over micro-batches as the full batch's
        mean loss would give; then step your optimizer. Returns the batch's loss (the mean of
        the micro-batch losses) on the last stage's ranks, ``None`` elsewhere.

        Every rank must pass a batch of the same shape; it may have other rows than the example
        (a data loader's last batch): see :mod:`autosplit.runtime.runs`. A disagreement, or
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
        # One outer autocast scope for the whole step: each weight is cast once, every micro-batch shares the copy.
        with self._failing("a pipelined step"), cast_once(self.precision, self.device.type), tp_scope(self.layout.tp):
            run.schedule.step(  # the last stage's outputs are not returned: kept, they would hold M of them to the end
                target=target if self.is_last else None, return_outputs=False,
                **dict(zip(self._input_names, cast_inputs(flat, self.precision))),
            )
        if self.layout.tp > 1:
            place_gradients(self.module.parameters())
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

    def _begin(self, inputs: Sequence[Any], kwargs: Mapping[str, Any], target: Any, kind: str) -> tuple[list[Any], Run]:
        """A step's inputs, flat, and the run of ``kind`` for their rows, once every rank agrees on them."""
        self._usable()
        if self._failed is not None:
            raise DistributedError(advice(
                f"this pipeline failed in an earlier step ({self._failed})",
                "a failed step leaves the stages and the process group in an unknown state",
                "re-create it with autosplit.distribute after fixing the cause (and a new process group if it was torn down)",
            ))
        flat = self._to_flat(tuple(inputs), dict(kwargs))
        if self._fp8_all_gather:  # the weights may have changed since the last step (the optimizer, a load)
            precompute_scales([self.module])
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
            self._failed = causes(e)
            raise DistributedError(advice(
                f"rank {self._rank} ({self._held_text()} of {self.layout.stages}, replica {self.layout.replica}) "
                f"failed during {what}: {causes(e)}",
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
            with (torch.no_grad(), self._failing("a forward-only step"), cast_once(self.precision, self.device.type),
                  tp_scope(self.layout.tp)):
                out = forward_only_step(
                    run.schedule, return_outputs=target is None, target=target if self.is_last else None,
                    **dict(zip(self._input_names, cast_inputs(flat, self.precision))),
                )
        finally:
            for p, g in grads:
                p.grad = g
        run.started = True
        return out if self.is_last else None


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


    def _set_aside_gradients(self, run: Run) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
