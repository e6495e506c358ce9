"""Example inputs given as shapes: plan a model without a batch of real data.

Planning reads the example's shapes and dtypes only, so an input may be a :class:`Spec`; it
becomes a tensor on the meta device (no memory). A model on the meta device is planned on meta
inputs; a real model given shapes is traced on zeros of them (a valid token id, a valid input).

Usage::

    plan = autosplit.plan(model_on_meta, ["H100-80GB"] * 16, example_inputs=(autosplit.Spec((8, 8192), torch.long),))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autosplit.compat import pytree

__all__ = ["Spec", "as_tensors", "is_meta"]


@dataclass(frozen=True)
class Spec:
    """An example input by its shape and dtype only."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def as_tensors(value: Any) -> Any:
    """``value`` (any nesting of inputs) with every :class:`Spec` as a meta tensor."""
    return pytree.tree_map(lambda v: v.meta() if isinstance(v, Spec) else v, value, is_leaf=lambda v: isinstance(v, Spec))


def is_meta(model: torch.nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is on the meta device (a model with none is not)."""
    state = [*model.parameters(), *model.buffers()]
    return bool(state) and all(t.is_meta for t in state)
