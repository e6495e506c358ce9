"""A ``torch.distributed.pipelining`` stage that posts all of a step's receives when the step begins.

The pipelining schedules post a micro-batch's receive just before it runs (GPipe), or batch it
with a send they then wait for (1F1B). Gloo moves a message only once its receive is posted, so
on CPU ranks of one pinned core each, a stage that is still computing the previous micro-batch
leaves its neighbour's data, and its neighbour's send, waiting: on GNMT at M = 8 the stages
idled for milliseconds per micro-batch in a profiler trace. Every micro-batch has its own receive buffers in a stage, so nothing stops
posting them all at once.

:class:`EarlyReceivingStage` does that when micro-batch 0's forward receive is asked for, or
when micro-batch 0's forward runs on a stage that is asked for none (a first stage, or a V's
stage fed in memory by its neighbour on the same rank), hands the schedule no receive ops of its
own, and waits for a micro-batch's data in :meth:`EarlyReceivingStage.wait_received` at the start
of its forward or backward chunk, which is after every send the schedule issued before it, so no
schedule can deadlock on it. Sends keep their order and carry a tag (:func:`message_tag`) that
the early receive matches.

Both stage classes record when each of their actions ran (:class:`Span`) while their
``timeline`` is a list (:meth:`~autosplit.runtime.distributed.DistributedModel.tracing`), and run
their forward in the plan's precision (autocast for the mixed ones, the
backward outside it), as the micro-batch it is (:func:`~autosplit.passes.recompute_regions.micro_batch`, read by
blocks that keep some micro-batches' activations), and refuse to send a tensor whose dtype is not the one the next stage's
receive buffer was made with.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from autosplit.errors import DistributedError, advice
from autosplit.passes.recompute_regions import micro_batch
from autosplit.runtime.precision import autocast

__all__ = ["EarlyReceivingStage", "ContiguousGradStage", "Span"]


class Span(NamedTuple):
    """One action a stage ran: ``kind`` ``"F"``, ``"B"``, ``"I"``, ``"W"`` as in the schedule's
    action lists, or ``"L"`` (the loss on the last stage's output, which torch's schedules compute
    after its ``F``), of micro-batch ``micro`` of stage ``stage``, from ``start`` to ``end`` in
    ``time.perf_counter()`` seconds (one clock for every process of a Linux host). Waiting for a
    received tensor is outside it."""

    kind: str
    stage: int
    micro: int
    start: float
    end: float


class _PolicyStage(PipelineStage):
    """A stage whose forward runs under the plan's precision (``precision``: the plan's, and the
    stage's device type; :func:`~autosplit.runtime.precision.autocast`, inside the step's
    :func:`~autosplit.runtime.precision.cast_once`, so the micro-batches share each weight's copy),
    the backward outside it; a tensor it sends whose dtype is not the one its neighbour's receive
    buffer was made with is a typed error before the send, never a silent cast or a mismatched message."""

    def __init__(self, *args: Any, precision: tuple[str, str] = ("fp32", "cpu"), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.precision = precision
        self._sent_dtypes = tuple(t.dtype for t in kwargs.get("output_args") or ())
        self.timeline: list[Span] | None = None
        """Where this stage's :class:`Span` go while it is a list; ``None``: not recorded."""

    def _record(self, kind: str, micro: int, start: float) -> None:
        if self.timeline is not None:
            self.timeline.append(Span(kind, self.stage_index, micro, start, time.perf_counter()))

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        with autocast(*self.precision), micro_batch(fwd_chunk_id):  # the micro-batch: for blocks that keep some
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._record("F", fwd_chunk_id, start)
        if not self.is_last:
            sent = out if isinstance(out, (tuple, list)) else (out,)
            wrong = [(i, t.dtype, d) for i, (t, d) in enumerate(zip(sent, self._sent_dtypes))
                     if isinstance(t, torch.Tensor) and t.dtype != d]
            if wrong:
                i, got, expected = wrong[0]
                raise DistributedError(advice(
                    f"stage {self.stage_index} computed its output {i} in {got}, where its static metadata (stage "
                    f"{self.stage_index + 1}'s receive buffer) say {expected} ({len(wrong)} of {len(sent)} outputs differ)",
                    f"the metadata were traced under precision {self.precision[0]!r} on {self.precision[1]}, and the stage "
                    "computes otherwise (an op autocast treats differently on this device, or a dtype set inside forward)",
                    "plan with precision='fp32', or cast the value to one dtype inside forward",
                ))
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._record("B" if kwargs.get("full_backward", True) else "I", bwd_chunk_id, start)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._record("W", bwd_chunk_id, start)
        return out


class ContiguousGradStage(_PolicyStage):
    """:class:`~torch.distributed.pipelining.PipelineStage` that sends contiguous input gradients.

    torch's split backward (the input pass of the zero-bubble schedules, torch 2.13) hands the
    gradients ``autograd.grad`` returns straight to the sends, and gloo refuses a non-contiguous
    one (the gradient of a transposed or expanded input): each is made contiguous once it is computed.
    """

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        grads = self.bwd_cache.get(bwd_chunk_id)
        if grads is not None:
            self.bwd_cache[bwd_chunk_id] = tuple(g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads)
        return out


class EarlyReceivingStage(ContiguousGradStage):
    """:class:`~torch.distributed.pipelining.PipelineStage` with a step's receives posted at its start.

    Every message carries a tag naming its receiving stage, direction, micro-batch and place
    among that micro-batch's tensors (:func:`message_tag`), so a receive posted early matches its
    own message whatever order the sender sends in: with several stages per rank, one neighbour
    sends a rank activations for one stage and gradients for another. Receives from a stage on
    the same rank are not posted (torch's runtime hands those tensors over in memory)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._posted: dict[tuple[str, int], list[dist.Work]] = {}
        self._opened = False  # micro-batch 0's forward receive opened this step's receives

    def _remote(self, stage: int) -> bool:
        return self.stage_index_to_group_rank[stage] != self.group_rank

    def _tagged(self, ops: list[dist.P2POp], stage: int, kind: str, chunk: int) -> list[dist.P2POp]:
        return [dist.P2POp(op.op, op.tensor, group=op.group, tag=message_tag(stage, kind, chunk, i), group_peer=op.group_peer)
                for i, op in enumerate(ops)]

    def _post(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        works = (dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer) for op in ops)
        return [w for w in works if w is not None]

    def _post_step(self) -> None:
        if self._posted:
            raise DistributedError(advice(
                f"stage {self.stage_index}: a step began with {len(self._posted)} receives of the last one pending "
                f"(first: {sorted(self._posted)[0]})",
                "the last step ended before every micro-batch's forward and backward ran",
                "start a new DistributedModel after a failed step",
            ))
        if self._receives_forward():
            for i in range(len(self.args_recv_info)):  # one per micro-batch (forward-only steps set no `chunks`)
                ops = super().get_fwd_recv_ops(i)
                self._posted["forward", i] = self._post(self._tagged(ops, self.stage_index, "forward", i))
        if self.has_backward and not self.is_last and self._remote(self.stage_index + 1):
            for i in range(self.chunks or 0):
                ops = super().get_bwd_recv_ops(i)
                self._posted["backward", i] = self._post(self._tagged(ops, self.stage_index, "backward", i))

    def _receives_forward(self) -> bool:
        return not self.is_first and self._remote(self.stage_index - 1)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if fwd_chunk_id == 0:
            self._post_step()
            self._opened = True
        return []

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return []

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._tagged(super().get_fwd_send_ops(fwd_chunk_id), self.stage_index + 1, "forward", fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._tagged(super().get_bwd_send_ops(bwd_chunk_id), self.stage_index - 1, "backward", bwd_chunk_id)

    def wait_received(self, kind: str, chunk: int) -> None:
        """Block until micro-batch ``chunk``'s ``"forward"`` inputs or ``"backward"`` gradients are in."""
        for work in self._posted.pop((kind, chunk), []):
            work.wait()

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if fwd_chunk_id == 0:  # a first stage, or one fed in memory, is asked for no receive: its step opens here
            if not self._opened:
                self._post_step()
            self._opened = False
        if self._receives_forward() and ("forward", fwd_chunk_id) not in self._posted:
            raise DistributedError(advice(
                f"stage {self.stage_index} was about to compute micro-batch {fwd_chunk_id} with no receive posted for "
                f"its inputs ({len(self.args_recv_info)} micro-batches prepared)",
                "the schedule ran a micro-batch this stage did not prepare for",
                "report this with the schedule and micro-batch count; the stage would otherwise read an empty buffer",
            ))
        self.wait_received("forward", fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.wait_received("backward", bwd_chunk_id)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


def message_tag(stage: int, kind: str, chunk: int, index: int) -> int:
    """The tag of the ``index``-th tensor micro-batch ``chunk`` sends to ``stage``: its
    activations (``kind="forward"``) or gradients (``"backward"``). Unique within a step for up
    to 256 stages, 4096 micro-batches and 1024 tensors each (a 31-bit tag); gloo matches a receive to the message of its tag,
    NCCL ignores tags (its messages between two ranks arrive in the order they were sent)."""
    if not (0 <= stage < 256 and 0 <= chunk < 4096 and 0 <= index < 1024):
        raise DistributedError(advice(
            f"stage {stage} cannot tag micro-batch {chunk}'s tensor {index}: tags hold 256 stages, 4096 micro-batches "
            "and 1024 tensors a micro-batch", "two messages would share a tag and a receive could take the wrong one",
            "run fewer stages or micro-batches, or merge the crossing tensors",
        ))
    return ((2 * stage + (kind == "backward")) << 22) + (chunk << 10) + index
