"""Selective (per-op) recomputation: a recomputed block keeps its matmuls' and attention's outputs.

A block recomputed *selectively* runs under ``torch.utils.checkpoint`` with a policy
(:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`) that saves the output of every
matmul and attention kernel the forward dispatches (:data:`KEPT_OPS`) and recomputes everything
else in the backward: the norms, activations, rotary embeddings, casts and residual adds between
them — the memory-bound ops, whose saved tensors are most of a transformer layer's activations
and whose rerun is cheap. This is torchtitan's selective *op* checkpointing, with one difference:
torchtitan also recomputes every second ``mm`` of a layer (by a count its policy keeps); here every
matmul is kept, so that what a block keeps depends on its graph alone, as the cost model reads it.

Under tensor parallelism the policy keeps every all-reduce's and reduce-scatter's output too
(:data:`KEPT_COLLECTIVES`, as torchtitan's keeps its reduce-scatters), so that no collective runs
again in the backward but the all-gathers sequence parallelism puts before each column-parallel group.
A row-parallel linear's kept product is then a whole partial sum, kept beside its reduced output;
:mod:`autosplit.passes.tp_costs` charges both.

The cost model reads the same rule off the graph (:func:`keeps_output`): a node whose op
dispatches to one of :data:`KEPT_OPS` (a linear layer, a matmul, scaled-dot-product attention)
keeps its output; the policy and the classification are kept together here so that they agree.

Usage::

    out = checkpoint(region, *inputs, use_reentrant=False, context_fn=keep_matmuls)
    kept = [i for i, n in enumerate(nodes) if keeps_output(gm, n)]
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autosplit.compat import REDUCTION_OPS, OpOverload
from autosplit.errors import ConstraintError, advice

__all__ = ["KEPT_COLLECTIVES", "KEPT_OPS", "keep_matmuls", "keeps_output", "refuse_random_attention"]

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

KEPT_COLLECTIVES = REDUCTION_OPS
"""The collectives whose outputs a selectively recomputed block keeps: the reductions DTensor runs after
a row-parallel product (and a vocabulary-parallel lookup). The all-gathers run again, as in torchtitan."""


def _dropout_p(schema: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The ``dropout_p`` an attention call passes (its schema's default where it passes none), else 0."""
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            return args[i] if i < len(args) else kwargs.get("dropout_p", arg.default_value)
    return 0.0


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # an attention kernel with dropout draws random numbers: cached, the recompute's later draws would shift
    keep = func in KEPT_COLLECTIVES or (func in KEPT_OPS and _dropout_p(func._schema, args, kwargs) == 0)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


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
    *(op._overloadpacket.__name__ for op in KEPT_OPS),
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


_SDPA_SCHEMA = _aten.scaled_dot_product_attention.default._schema  # F.scaled_dot_product_attention's arguments


def refuse_random_attention(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> None:
    """Refuse selective recomputation of a graph whose attention draws dropout (``dropout_p`` not a
    constant 0). The policy cannot keep such a kernel's output: the rerun's later draws would shift. It
    recomputes it, so on the math path the attention's inner matmuls, ``s × s`` scores among them, are kept
    instead of its output, which the cost model does not charge."""
    for n in nodes:
        if n.op != "call_function" or not keeps_output(gm, n):
            continue
        schema = _SDPA_SCHEMA if n.target is F.scaled_dot_product_attention else getattr(n.target, "_schema", None)
        p = _dropout_p(schema, n.args, n.kwargs) if schema is not None else 0.0
        if not (isinstance(p, (int, float)) and p == 0):
            raise ConstraintError(advice(
                f"node {n.name} draws attention dropout (dropout_p={p}), and selective recomputation keeps attention outputs",
                "a kept attention kernel that draws random numbers would shift the draws its block's rerun makes, "
                "and recomputing it keeps its s × s scores, which the plan does not cost",
                "recompute whole blocks (selective=False), or train without attention dropout",
            ))
