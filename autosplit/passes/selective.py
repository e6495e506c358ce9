"""Selective (per-op) recomputation: a recomputed block keeps its matmuls' and attention's outputs.

A block recomputed *selectively* runs under ``torch.utils.checkpoint`` with a policy
(:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`) that saves the output of every
matmul and attention kernel the forward dispatches (:data:`KEPT_OPS`) and recomputes everything
else in the backward: the norms, activations, rotary embeddings, casts and residual adds between
them — the memory-bound ops, whose saved tensors are most of a transformer layer's activations
and whose rerun is cheap. This is torchtitan's selective *op* checkpointing, with one difference:
torchtitan also recomputes every second ``mm`` of a layer (by a count its policy keeps); here every
matmul is kept, so that what a block keeps depends on its graph alone, as the cost model reads it.

Not under tensor parallelism (:func:`~autosplit.options.refuse_selective_tp`): there a row-parallel linear's local matmul
output is a whole partial sum, ``tp`` times the sharded activation the cost model charges, and the
collectives between the matmuls would run again in the backward, which no cost here counts.

The cost model reads the same rule off the graph (:func:`keeps_output`): a node whose op
dispatches to one of :data:`KEPT_OPS` (a linear layer, a matmul, scaled-dot-product attention)
keeps its output; the policy and the classification are kept together here so that they agree.

Usage::

    out = checkpoint(region, *inputs, use_reentrant=False, context_fn=keep_matmuls)
    kept = [i for i, n in enumerate(nodes) if keeps_output(gm, n)]
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autosplit.compat import OpOverload

__all__ = ["KEPT_OPS", "keep_matmuls", "keeps_output"]

_aten = torch.ops.aten
KEPT_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(_aten, name)
)
"""The ATen ops whose outputs a selectively recomputed block keeps: matmuls (what a linear layer or
``@`` dispatches to) and the fused attention kernels (their output and log-sum-exp)."""


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def keep_matmuls() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: keep :data:`KEPT_OPS`' outputs, recompute the rest."""
    return create_selective_checkpoint_contexts(_policy)


_FUNCTIONS = frozenset({
    F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum, operator.matmul,
    F.scaled_dot_product_attention,
})
_METHODS = frozenset({"matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__", "__rmatmul__"})
_ATEN_NAMES = frozenset({
    "linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "einsum", "_scaled_mm", "scaled_dot_product_attention",
    *(str(op.name()).split("::")[1].split(".")[0] for op in KEPT_OPS),
})


def keeps_output(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether a selectively recomputed block keeps ``node``'s output: its op dispatches to a matmul or
    an attention kernel (:data:`KEPT_OPS`). A module called whole keeps it when it is a linear layer;
    any other module's inner matmuls are not seen here."""
    if node.op == "call_function":
        if node.target in _FUNCTIONS:
            return True
        target = node.target
        return isinstance(target, OpOverload) and target.namespace == "aten" and target._overloadpacket.__name__ in _ATEN_NAMES
    if node.op == "call_method":
        return node.target in _METHODS
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), torch.nn.Linear)
    return False
