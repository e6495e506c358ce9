"""Micro-batching, in one place: how a batch is cut into ``M`` micro-batches.

The batch dimension is dimension 0 of the first tensor input with a dimension; a tensor
input (positional or keyword, at any depth of a tuple/list/dict) whose dimension 0 has
that size is split into ``M`` equal slices, every other value (weights passed as inputs,
scalars, ``None``, shape-less tensors) is given whole to every micro-batch. Profiling,
stage measurement and both runtimes use this rule, so they agree on what one micro-batch
is — the unit the cost model is written in.

Usage::

    chunks = split_batch((x,), {"attention_mask": mask}, 4)   # [(args, kwargs)] × 4
    first = split_batch(values, None, 4)[0][0]               # flat graph inputs of micro-batch 0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from autosplit.compat import pytree
from autosplit.errors import ConstraintError, advice

__all__ = ["batch_size", "is_batched", "split_batch", "split_target"]


def batch_size(args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> int | None:
    """Dimension 0 of the first tensor input that has one; ``None`` when there is none."""
    for leaf in pytree.tree_leaves((tuple(args), dict(kwargs or {}))):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def is_batched(value: Any, batch: int | None) -> bool:
    """Whether ``value`` is cut along dimension 0 when the batch has ``batch`` rows."""
    return batch is not None and isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


def split_batch(
    args: Sequence[Any], kwargs: Mapping[str, Any] | None, micro_batches: int
) -> list[tuple[tuple, dict[str, Any]]]:
    """``micro_batches`` pairs ``(args, kwargs)`` that together make the batch ``(args, kwargs)``."""
    kwargs = dict(kwargs or {})
    batch = batch_size(args, kwargs)
    if micro_batches <= 1 or batch is None:
        return [(tuple(args), kwargs)] * max(micro_batches, 1)
    if batch % micro_batches:
        raise ConstraintError(
            advice(
                f"a batch of {batch} (dimension 0 of the first tensor input) does not divide into "
                f"{micro_batches} micro-batches",
                "every micro-batch must have the same shape",
                f"pass micro_batches= that divides {batch}, or a batch that {micro_batches} divides",
            )
        )
    size = batch // micro_batches

    def piece(i: int):
        return lambda x: x[i * size : (i + 1) * size] if is_batched(x, batch) else x

    return [
        (tuple(pytree.tree_map(piece(i), list(args))), pytree.tree_map(piece(i), kwargs)) for i in range(micro_batches)
    ]


def split_target(target: Any, parts: int) -> list[Any]:
    """``parts`` pieces of a loss target, cut along its own dimension 0 as :func:`split_batch` cuts a batch
    (each micro-batch's, or each data-parallel copy's, rows)."""
    return [args[0] for args, _ in split_batch((target,), None, parts)]
