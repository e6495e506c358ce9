"""Gradient clipping by the norm of the whole model, across every rank that holds a part of it.

``torch.nn.utils.clip_grad_norm_(pipe.parameters(), max_norm)`` on a pipeline clips each rank by
the norm of its own stage: every stage is scaled by a different factor and training leaves the
unsplit model's path without an error. The norm that clipping means is the whole model's:
torchtitan all-reduces it over the pipeline mesh for this (``torchtitan.distributed.utils.
clip_grad_norm_``). Here every element of the model's gradient is counted on exactly one rank:

- a gradient sharded by FSDP2 (a DTensor ``Shard`` placement) by every rank, for its shard;
- a gradient every rank of a mesh dimension holds whole (a ``Replicate`` placement, a plain tensor
  on every replica) by the rank at coordinate 0 of that dimension only;
- a tied weight that several stages hold (each copy with the summed gradient) by one of them.

The ranks' sums of ``|g|^p`` (or their maxima for ``p = inf``) are all-reduced over the whole
process group, and every gradient of every rank is scaled by one factor,
``min(1, max_norm / (norm + 1e-6))``, with :func:`torch.nn.utils.clip_grads_with_norm_` — the
formula of :func:`torch.nn.utils.clip_grad_norm_`, so the pipeline clips as the unsplit model does.

Usage (every rank, after the step's gradients are in)::

    norm = pipe.clip_grad_norm_(1.0)       # the same norm on every rank
    optimizer.step()
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from autosplit.errors import DistributedError, advice

__all__ = ["counted_here", "global_grad_norm", "clip_by_global_norm"]


def counted_here(grad: torch.Tensor, *, replica: int) -> torch.Tensor | None:
    """The part of ``grad`` this rank counts in the model's norm, or None where another rank counts it.

    A DTensor counts its local tensor where, on every mesh dimension it is replicated over, this
    rank is at coordinate 0; a plain tensor (held whole by every replica) on replica 0 only."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return grad if replica == 0 else None
    placements = grad.placements
    coordinate = grad.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the gradient's mesh
        return None
    for dim, placement in enumerate(placements):
        if placement.is_replicate() and coordinate[dim] != 0:
            return None
        if placement.is_partial():
            raise DistributedError(advice(
                f"a gradient is still a partial sum over mesh dimension {dim} ({placements})",
                "its reduction has not run, so its norm would count each rank's part separately",
                "clip after step() has returned on every rank",
            ))
    return grad.to_local()


def global_grad_norm(
    counted: Iterable[torch.Tensor], *, norm_type: float, device: torch.device, group: Any = None,
) -> torch.Tensor:
    """The ``norm_type``-norm of every gradient part each rank of ``group`` passes as ``counted``
    (each element on one rank), in float64 on ``device``; the same value on every rank."""
    p = float(norm_type)
    if not (p > 0 or math.isinf(p)) or math.isnan(p):
        raise DistributedError(advice(
            f"norm_type {norm_type} is not a norm clipping can use",
            "the total norm is the p-norm of every gradient element, for p > 0 or inf",
            "pass norm_type=2.0 (the default), 1.0, or float('inf')",
        ))
    inf = math.isinf(p)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in counted:
        if g.numel() == 0:
            continue
        g = g.coalesce().values() if g.is_sparse else g
        norm = torch.linalg.vector_norm(g.detach().to(torch.float64), p).to(device)
        total = torch.maximum(total, norm) if inf else total + norm**p
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    return total if inf else total ** (1.0 / p)


def clip_by_global_norm(
    params: Iterable[torch.Tensor], total: torch.Tensor, *, max_norm: float, error_if_nonfinite: bool,
) -> None:
    """Scale the gradient of every parameter in ``params`` by ``min(1, max_norm / (total + 1e-6))``
    (every rank with the same ``total``, so the same factor); refuse a non-finite ``total`` if asked."""
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise DistributedError(advice(
            f"the total norm of the model's gradients is {float(total)}",
            "a gradient holds an inf or NaN (an overflow, or a loss that is not finite)",
            "find the step whose loss is not finite, lower the learning rate, or pass error_if_nonfinite=False "
            "(the gradients are then scaled by a NaN factor, as torch does)",
        ))
    with_grads = [p for p in params if p.grad is not None]
    if with_grads:  # torch's function reads each parameter's .grad
        dtype = with_grads[0].grad.dtype  # type: ignore[union-attr]
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total.to(dtype), foreach=False)
