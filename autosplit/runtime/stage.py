"""A ``torch.distributed.pipelining`` stage that posts all of a step's receives when the step begins.

The pipelining schedules post a micro-batch's receive just before it runs (GPipe), or batch it
with a send they then wait for (1F1B). Gloo moves a message only once its receive is posted, so
on CPU ranks of one pinned core each, a stage that is still computing the previous micro-batch
leaves its neighbour's data, and its neighbour's send, waiting: on GNMT at M = 8 the stages
idled for milliseconds per micro-batch in a profiler trace. Every micro-batch has its own receive buffers in a stage, so nothing stops
posting them all at once.

:class:`EarlyReceivingStage` does that when micro-batch 0's forward receive is asked for (the
first thing every schedule does in a step), hands the schedule no receive ops of its own, and
waits for a micro-batch's data in :meth:`EarlyReceivingStage.wait_received` at the start of its
forward or backward chunk, which is after every send the schedule issued before it, so no
schedule can deadlock on it. Sends are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from autosplit.errors import DistributedError, advice

__all__ = ["EarlyReceivingStage", "ContiguousGradStage"]


class EarlyReceivingStage(PipelineStage):
    """:class:`~torch.distributed.pipelining.PipelineStage` with a step's receives posted at its start."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._posted: dict[tuple[str, int], list[dist.Work]] = {}

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
        chunks = self.chunks or 0
        for i in range(chunks):
            self._posted["forward", i] = self._post(super().get_fwd_recv_ops(i))
        if self.has_backward:
            for i in range(chunks):
                self._posted["backward", i] = self._post(super().get_bwd_recv_ops(i))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if fwd_chunk_id == 0:
            self._post_step()
        return []

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return []

    def wait_received(self, kind: str, chunk: int) -> None:
        """Block until micro-batch ``chunk``'s ``"forward"`` inputs or ``"backward"`` gradients are in."""
        for work in self._posted.pop((kind, chunk), []):
            work.wait()

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.wait_received("forward", fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.wait_received("backward", bwd_chunk_id)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


class ContiguousGradStage(PipelineStage):
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
