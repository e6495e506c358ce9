"""Capturing a model as it computes under FSDP2's ``MixedPrecisionPolicy``
(``precision="bf16-fsdp"``): every floating parameter cast to bf16 before the forward.

``torch.export`` bakes the dtypes it traced into the graph — ``x.to(input_dtype)`` in a
``transformers`` RMSNorm becomes a cast to the dtype the input had while tracing, and
``_assert_tensor_metadata`` nodes check them — so a graph exported with fp32 parameters would
compute another function once FSDP2 hands it bf16 ones (an fp32 residual stream, a matmul of
mismatched dtypes). The graph is therefore captured with the parameters' data swapped for bf16
copies (:func:`params_in`; free on the meta device), and their own data put back after: the
graph holds the model's own ``Parameter`` objects, fp32 again, and computes as the eager model
does under the policy (``tests/passes/test_param_dtype.py``). A symbolically traced graph
records no dtypes and captures the same either way.

Usage::

    with params_in(model, capture_dtype("bf16-fsdp")):
        captured = ...  # export the model
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from autosplit.compat import pytree

__all__ = ["PARAM_CAST", "capture_dtype", "inputs_in", "params_in"]

PARAM_CAST = {"bf16-fsdp": torch.bfloat16}
"""The precisions whose runtime casts every floating parameter before the forward, and to what."""


def capture_dtype(precision: str) -> torch.dtype | None:
    """The dtype a model's floating parameters are captured in for ``precision`` (None: their own)."""
    return PARAM_CAST.get(precision)


@contextlib.contextmanager
def params_in(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """``model``'s floating parameters hold ``dtype`` copies of their data inside the context
    (``Parameter`` objects unchanged, as ``hold`` converts them), and their own data again after,
    whatever happens inside; nothing changes for ``dtype=None``."""
    if dtype is None:
        yield
        return
    own = [(p, p.data) for p in model.parameters() if p.is_floating_point() and p.dtype != dtype]
    try:
        with torch.no_grad():
            for p, data in own:
                p.data = data.to(dtype)
        yield
    finally:
        for p, data in own:
            p.data = data


def inputs_in(values: Any, dtype: torch.dtype | None) -> Any:
    """``values`` with every floating tensor in it cast to ``dtype`` (unchanged for None): the model's
    inputs as the runtime casts them where they enter."""
    if dtype is None:
        return values
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, values)
