"""The autocast policy the annotate pass applies: torch.autocast's op lists, on any tensors.

``torch.autocast`` acts only on CPU and CUDA tensors, while annotation runs on fake tensors — of
a meta-device model too, and for a GPU target on a machine without one — so the policy is applied
at the function level (:class:`_Autocast`, a ``TorchFunctionMode``): the inputs of a low-precision
op are cast down, those of the device type's fp32 ops up. :data:`LOW_PRECISION` names each
precision's low dtype for the passes and the runtime that compute in it.

Usage::

    with precision_context("bf16-mixed", "cuda", params=state_ids) as policy:
        out = op(*args)          # as autocast on CUDA would run it

Where real tensors run under a mixed precision — the runtime's stages, the profiler's passes —
:func:`forward_autocast` is each forward's ``torch.autocast`` and :func:`step_scope` the step's
scope around them that keeps one cast copy of each weight for all its micro-batches
(:func:`autosplit.runtime.precision.cast_once` says how and why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from typing import Any

import torch

from autosplit.compat import pytree

__all__ = ["HALF", "LOW_PRECISION", "forward_autocast", "is_mixed", "precision_context", "step_scope"]

F = torch.nn.functional

aten = torch.ops.aten

HALF = (torch.float16, torch.bfloat16)
"""The half-precision dtypes (tensor-core peaks apply to ops computing in them)."""

LOW_PRECISION = {"bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "bf16-fsdp": torch.bfloat16}
"""The low-precision dtype of each precision (:attr:`autosplit.options.PlanOptions.precision`) but fp32."""


def _ops(*names: str) -> frozenset:
    """The torch functions, Tensor methods and aten op packets of these names (those that exist)."""
    found: set = set()
    for name in names:
        for space in (torch, torch.Tensor, F, torch.linalg):
            if hasattr(space, name):
                found.add(getattr(space, name))
        if hasattr(aten, name):
            found.add(getattr(aten, name))
    return frozenset(found)


# torch.autocast's op lists (aten/src/ATen/autocast_mode.cpp, torch 2.13): ops that run in the low
# precision, and ops each device type runs in fp32 whatever their inputs. Autocast itself acts only
# on CPU and CUDA tensors, while annotation runs on fakes — of a meta-device model too (whose
# exported graph names the meta device and reads meta buffers inside higher-order ops), and for a
# GPU target on a machine without one — so the policy is applied here, at the function level.
_LOW = _ops(
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "addr", "mv", "einsum",
    "chain_matmul", "multi_dot", "vecdot", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "_convolution", "conv_tbc", "prelu", "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
)
_LOSSES = (
    "cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss2d", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits", "poisson_nll_loss", "hinge_embedding_loss",
    "cosine_embedding_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "multilabel_margin_loss", "ctc_loss",
)
_FP32 = {
    "cuda": _ops(
        *_LOSSES, "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "__pow__", "softplus", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
        "frobenius_norm", "nuclear_norm", "cosine_similarity", "dist", "pdist", "cdist", "renorm", "logsumexp", "softmax",
        "_softmax", "log_softmax", "_log_softmax", "cumprod", "cumsum", "prod", "sum", "norm", "vector_norm", "matrix_norm",
    ),
    "cpu": _ops(
        *_LOSSES, "avg_pool3d", "grid_sampler", "polar", "prod", "quantile", "nanquantile", "stft", "cdist", "trace",
        "view_as_complex", "cholesky", "inverse", "pinverse", "max_pool3d", "adaptive_avg_pool3d", "reflection_pad1d",
        "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    ),
}


class _Autocast(torch.overrides.TorchFunctionMode):
    """torch.autocast's policy for ``device_type`` at ``dtype``, on any tensors (see :data:`_LOW`):
    floating fp32 inputs of a low-precision op are cast down (a weight's cast copy is what the op
    saves, as under autocast), and low-precision inputs of the device's fp32 ops are cast up. A
    region the model itself runs with autocast disabled (a rotary embedding's tables) is cast too."""

    def __init__(self, device_type: str, dtype: torch.dtype, params: Collection[int] = ()):
        super().__init__()
        self.fp32, self.dtype = _FP32["cpu" if device_type == "cpu" else "cuda"], dtype
        self.params = params
        self.copies: dict[int, torch.Tensor] = {}
        """The cast copies of the tensors whose ids are in ``params`` (the model's parameters), by id."""

    def _down(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            return x
        y = x.to(self.dtype)
        if id(x) in self.params:
            self.copies[id(y)] = y
        return y

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = getattr(func, "overloadpacket", func)
        if key is aten._assert_tensor_metadata:  # export's checks of the dtypes it traced, which the policy changes
            return None
        if key in _LOW:
            cast = self._down
        elif key in self.fp32:
            cast = lambda x: x.float() if isinstance(x, torch.Tensor) and x.dtype in HALF else x  # noqa: E731
        else:
            return func(*args, **kwargs)
        args, kwargs = pytree.tree_map(cast, (args, kwargs))
        return func(*args, **kwargs)


def precision_context(precision: str, device_type: str, params: Collection[int] = ()) -> contextlib.AbstractContextManager:
    """The forward's dtype policy for annotating ``precision`` on a ``device_type`` (``"cpu"``,
    ``"cuda"``) target: autocast's for the mixed precisions (recording the copies it makes of the
    tensors whose ids are in ``params``); nothing for fp32 and bf16 (a bf16 model is annotated with
    bf16 state and inputs instead)."""
    if not precision.endswith("-mixed"):
        return contextlib.nullcontext()
    return _Autocast(device_type, LOW_PRECISION[precision], params)


def is_mixed(precision: str) -> bool:
    """The precision runs the forward under ``torch.autocast`` (``"bf16-mixed"``, ``"fp16-mixed"``)."""
    return precision.endswith("-mixed")


def forward_autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, dtype)`` of a mixed precision, its cache of weight casts on;
    a null context for the others."""
    if not is_mixed(precision):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=LOW_PRECISION[precision], cache_enabled=True)


def step_scope(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """One step's scope for a mixed precision: an outer ``torch.autocast`` that casts nothing and
    keeps autocast's weight casts until it closes, so the :func:`forward_autocast` regions inside
    share one copy of each weight; a null context for the others."""
    if not is_mixed(precision):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False, cache_enabled=True)
