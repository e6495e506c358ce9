"""Per-batch-size runs of :class:`~autosplit.runtime.distributed.DistributedModel`: the schedule
that runs batches of one size, over stages whose static metadata is that size's micro-batch shape.

Every step begins with one small ``all_gather`` of each rank's batch rows and a digest of its
input and target shapes, so every rank refuses a disagreement before any stage computes
(:meth:`BatchRuns._agree_on_batch`). A batch of other rows than the example's (a data loader's last
batch) runs with stages whose static metadata is rebuilt for its micro-batch shape — same module,
same parameters — if the stages' code does not fix the rows; it is cut into the plan's ``M``
micro-batches, or the most below ``M`` that divide it and that the schedule runs, and refused
otherwise. Each (rows, kind) gets its :class:`Run` once, kept for the batches that follow; the
forward-only kinds (``"loss"``, ``"output"``) run on stages of their own.

Usage (inside the pipeline)::

    rows = self._agree_on_batch(flat, target)
    run = self._run_for(rows, flat, "train")
    run.schedule.step(...)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autosplit.compat import forward_only_order, replicate_chunk_spec, set_kwargs_chunk_spec
from autosplit.errors import DistributedError, advice, causes
from autosplit.microbatch import batch_size
from autosplit.runtime.batches import check_batches, code_change, describe, digest, shapes

__all__ = ["BatchRuns", "Run"]

log = logging.getLogger(__name__)


@dataclass
class Run:
    """The schedule that runs batches of one size, over a stage whose static metadata is that
    size's micro-batch shape."""

    schedule: Any
    micro_batches: int
    stages: list[Any]
    started: bool = False
    forward_only: bool = False



class BatchRuns:
    """The per-batch-size runs of :class:`~autosplit.runtime.distributed.DistributedModel`."""

    plan: Any
    chain: Any
    layout: Any
    device: torch.device
    micro_batches: int
    _entry: Any
    _input_names: tuple[str, ...]
    _batched: list[bool]
    _rows: int | None
    _shapes: Any
    _stages: list[Any]
    _runs: dict[tuple[int | None, str], Run]
    _unrunnable: dict[int, str]
    _chain_at: Callable[[int], Any]
    _schedule_cls: Any
    _loss: Callable[[Any, Any], torch.Tensor]
    _rank: int
    _failed: str | None

    if TYPE_CHECKING:  # DistributedModel's

        def _new_stages(
            self, inputs_meta: Sequence[Sequence[torch.Tensor]], outputs_meta: Sequence[Sequence[torch.Tensor]],
        ) -> list[Any]: ...

    def _make_schedule(self, stages: list[Any], micro_batches: int, kind: str = "train") -> Any:
        """The torch schedule over ``stages``: the plan's class (``ScheduleGPipe`` for the forward-only
        runs of an asynchronous plan), with the loss unless ``kind`` is ``"output"`` (forward only)."""
        from torch.distributed import pipelining
        from torch.distributed.pipelining.microbatch import TensorChunkSpec

        # Inputs are cut as the example was (autosplit/microbatch.py's rule, applied to the example,
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
            self._failed = causes(e)
            raise DistributedError(advice(
                f"rank {self._rank} could not compare its batch with the other ranks': {causes(e)}",
                "a peer rank failed, exited, or did not call step() (the process group's timeout)",
                "look for the first rank that failed; call step() on every rank with a batch of the same shape",
            )) from e
        last = [q for r in range(self.layout.replicas) for q in self.layout.ranks(self.layout.stages - 1, r)] if targeted else []
        check_batches(torch.stack(table).tolist(), last)
        return rows

    def _run_for(self, rows: int | None, flat: Sequence[Any], kind: str = "train") -> Run:
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

    def _new_run(self, rows: int | None, kind: str) -> Run:
        M = self.micro_batches
        if rows is None or self._rows is None or rows == self._rows:
            stages = self._stages if kind == "train" else self._new_stages(self.chain.inputs_meta, self.chain.outputs_meta)
            return Run(self._make_schedule(stages, M, kind), M, stages)
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
                return Run(self._make_schedule(stages, m, kind), m, stages)
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
                self._unrunnable[micro] = f"the model could not be captured at this shape ({causes(e)})"
            else:
                changed = code_change(base, other)
                if changed is None and other.crossings == self.chain.crossings:
                    return other.inputs_meta, other.outputs_meta
                self._unrunnable[micro] = changed or "other values cross the stages at this shape"
        return None
