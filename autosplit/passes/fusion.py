"""Kernel fusion in the memory model: what an engine's fused kernels save for the backward, where the
captured graph shows the ops one by one.

A graph captured from eager code saves what each op's autograd formula saves: a transformers RMSNorm
upcasts its input to fp32, squares it, averages, takes ``rsqrt`` and multiplies, and autograd keeps the
fp32 copy, the product and the bf16 cast — four times the input where one kernel keeps it once. The
engines of the published record run fused kernels (:attr:`~autosplit.engine_profiles.EngineProfile.fuses`):

- **norms** (``"norm"``; Transformer Engine's, Inductor's, torch's own ``nn.LayerNorm``): a norm module
  saves its input and a statistic per row (a few bytes per token, left out here), and its backward
  recomputes the rest. A module is a norm when its class name ends in ``RMSNorm`` or ``LayerNorm``.
- **gated activations** (``"gated"``; Transformer Engine's SwiGLU / GeGLU, Inductor's fusion of
  ``act(gate) * up``): the product saves the gate and the up projection, and recomputes ``act(gate)`` in
  its backward instead of keeping it.
- **FP8 inputs** (``"fp8-inputs"``; Transformer Engine): a linear computing in FP8 keeps the FP8 copy of its
  input it made for the forward GEMM (a byte per value) for its weight's gradient, not the bf16 input; the
  linears reading one tensor (q, k and v; gate and up) keep one copy, as Transformer Engine's fused
  projection does. (torchao's float8 keeps the bf16 input: torchtitan's profile does not name it.)
- **FP8 weights** (``"fp8-weights"``; Transformer Engine under Megatron's ``fp8_param_gather``, which Megatron-Bridge's
  performance recipes set for tensorwise current scaling): an FP8 linear's compute copy of its weight is the FP8
  one, a byte per value, not a bf16 copy (MXFP8 keeps a copy per scaling direction: no saving, not applied).
- **fused attention** (``attention``: on every GPU, whatever the engine — torch's flash and memory-efficient
  kernels, cuDNN's, Transformer Engine's): ``scaled_dot_product_attention`` keeps its query, key, value and
  mask as given — grouped key/value heads read in place — and its output and an fp32 log-sum-exp per query
  row. Annotation replays it on CPU tensors, whose kernel may repeat grouped heads to every query head and keep
  those copies.

:func:`fused` rewrites the annotated :class:`~autosplit.passes.annotations.NodeInfo` of those nodes; the
memory model (:mod:`autosplit.passes.memory_model`) then counts each saved storage once, at its producer,
as it does for any graph. Times are unchanged: the roofline charges bytes moved, and a fusion's saving in
them is the engine profile's ``memory`` efficiency.

Usage::

    infos = fused(nodes, infos, Fusion(norms=norm_paths(model), gated=True))
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Collection, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosplit.passes.annotations import NodeInfo, node_info

__all__ = ["FUSIONS", "Fusion", "UNFUSED", "fused", "norm_paths"]

FUSIONS = ("norm", "gated", "fp8-inputs", "fp8-weights")
"""The fusions an engine profile can name."""


@dataclasses.dataclass(frozen=True)
class Fusion:
    """The fused kernels of a plan's engine, as :func:`fused` applies them."""

    norms: frozenset[str] = frozenset()
    """Module paths of the norms that run as one kernel each."""
    gated: bool = False
    fp8_inputs: bool = False
    fp8_weights: bool = False
    fp8_experts: bool = False
    """Under an FP8 recipe its experts' grouped matmuls run in FP8 too (Transformer Engine's grouped GEMM); torchao's
    linears alone (autosplit's runtime) leave them bf16."""
    torchao_weights: bool = False
    """FP8 linears run by torchao under autocast read their fp32 weights: autocast casts (and keeps) no bf16 copy."""
    attention: bool = False
    """Attention as a GPU's fused kernel saves it (a plan for GPUs, whatever its engine)."""


UNFUSED = Fusion()
"""The graph's ops as captured, one kernel each."""

NORM_SUFFIXES = ("RMSNorm", "LayerNorm")
_aten = torch.ops.aten
_ACTIVATIONS = {F.silu, F.gelu, torch.sigmoid, _aten.silu.default, _aten.gelu.default, _aten.sigmoid.default}
_MULS = {operator.mul, torch.mul, _aten.mul.Tensor}
_ATTENTION = {F.scaled_dot_product_attention, _aten.scaled_dot_product_attention.default}
_ATTENTION_INPUTS = ("query", "key", "value", "attn_mask")


def norm_paths(model: torch.nn.Module | None) -> frozenset[str]:
    """Module paths of ``model``'s norms (class name ending in ``RMSNorm`` or ``LayerNorm``)."""
    if model is None:
        return frozenset()
    return frozenset(path for path, m in model.named_modules() if path and type(m).__name__.endswith(NORM_SUFFIXES))


def _is_activation(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _ACTIVATIONS) or (node.op == "call_method" and node.target in ("sigmoid",))


def _is_mul(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _MULS) or (node.op == "call_method" and node.target == "mul")


def _fuse_norm(members: list[int], nodes: Sequence[fx.Node], infos: list[NodeInfo]) -> None:
    """One norm module's nodes as one kernel (in place): the first saves the module's inputs from outside
    it (parameters aside), none saves anything made inside it."""
    inside = {nodes[i].name for i in members}
    outside = tuple(dict.fromkeys(u.name for i in members for u in nodes[i].all_input_nodes
                                  if u.name not in inside and u.op != "get_attr"))
    for k, i in enumerate(members):
        info = infos[i]
        kept = tuple(name for name in info.saved_inputs if name not in inside and name not in outside)
        infos[i] = dataclasses.replace(info, saved_bytes=info.weight_copy_bytes, saves_output=False,
                                       saved_inputs=(outside + kept) if k == 0 else kept)


def _fp8_inputs(nodes: Sequence[fx.Node], infos: list[NodeInfo], linears: Collection[int]) -> None:
    """FP8 linears keep an FP8 copy of their input (in place): one per input tensor, made by its first reader."""
    copied: set[str] = set()
    for i in sorted(linears):
        source = nodes[i].all_input_nodes[0] if nodes[i].all_input_nodes else None
        info = infos[i]
        if source is None or source.name not in info.saved_inputs:
            continue
        extra = 0
        if source.name not in copied:
            copied.add(source.name)
            shape = node_info(source).output_shapes[0] if "autosplit" in source.meta else ()
            extra = math.prod(shape) if shape else 0
        infos[i] = dataclasses.replace(info, saved_bytes=info.saved_bytes + extra,
                                       saved_inputs=tuple(n for n in info.saved_inputs if n != source.name))


def _fp8_weights(nodes: Sequence[fx.Node], infos: list[NodeInfo], linears: Collection[int], kept: float) -> None:
    """FP8 linears compute with an FP8 copy of their weights (in place): ``kept`` of the bf16 copy (half: Transformer
    Engine's FP8 copy; none: torchao's, which casts the fp32 weight itself), on the node holding it (the linear module's
    own, or the weight it reads as an attribute)."""
    index = {n.name: i for i, n in enumerate(nodes)}
    holders = {index[u.name] for i in linears for u in (nodes[i], *nodes[i].all_input_nodes)
               if u.name in index and (u is nodes[i] or u.op == "get_attr")}
    for i in holders:
        info = infos[i]
        dropped = info.weight_copy_bytes - int(info.weight_copy_bytes * kept)
        infos[i] = dataclasses.replace(info, weight_copy_bytes=info.weight_copy_bytes - dropped, saved_bytes=info.saved_bytes - dropped)


def _fused_attention(nodes: Sequence[fx.Node], infos: list[NodeInfo]) -> None:
    """Each attention node saves what a GPU's fused kernel keeps (in place): its query, key, value and mask as
    given, its output and an fp32 log-sum-exp per row of it."""
    for i, node in enumerate(nodes):
        if node.op != "call_function" or node.target not in _ATTENTION or not infos[i].output_shapes:
            continue
        given = [*node.args[:4], *(node.kwargs.get(k) for k in _ATTENTION_INPUTS[len(node.args):])]
        inputs = tuple(dict.fromkeys(u.name for u in given if isinstance(u, fx.Node)))
        shape = infos[i].output_shapes[0]
        lse = math.prod(shape[:-1]) * 4 if shape else 0
        infos[i] = dataclasses.replace(infos[i], saved_bytes=infos[i].output_bytes + lse, saves_output=True, saved_inputs=inputs)


def fused(
    nodes: Sequence[fx.Node], infos: Sequence[NodeInfo], fusion: Fusion, float8: Collection[int] = (), experts: Collection[int] = (),
) -> list[NodeInfo]:
    """``infos`` as the fused kernels save (the module docstring): the nodes of each norm module in
    ``fusion.norms`` as one kernel; with ``gated``, each product of an activation's output saves the activation's
    input instead (the activation's own saving) and not its output; with ``fp8_inputs``, the FP8 linears
    (``float8``: indices into ``nodes``) and the experts' FP8 grouped matmuls (``experts``) keep FP8 copies of
    their inputs, with ``fp8_weights`` the linears of their weights; with ``attention``, attention keeps what a
    GPU's fused kernel does."""
    out = list(infos)
    regions: dict[str, list[int]] = {}
    for i, info in enumerate(infos):
        parts = info.module_path.split(".") if info.module_path else []
        # the outermost norm module that holds the node: its path itself or one of its prefixes
        owner = next((p for p in (".".join(parts[:k]) for k in range(1, len(parts) + 1)) if p in fusion.norms), None)
        if owner is not None:
            regions.setdefault(owner, []).append(i)
    for members in regions.values():
        _fuse_norm(members, nodes, out)
    if fusion.gated:
        for i, node in enumerate(nodes):
            if not _is_mul(node):
                continue
            acts = {u.name for u in node.all_input_nodes if _is_activation(u) and len(u.users) == 1}
            if acts & set(out[i].saved_inputs):
                out[i] = dataclasses.replace(out[i], saved_inputs=tuple(n for n in out[i].saved_inputs if n not in acts))
    if fusion.fp8_inputs and (float8 or experts):
        _fp8_inputs(nodes, out, [*float8, *experts])
    if (fusion.fp8_weights or fusion.torchao_weights) and float8:
        _fp8_weights(nodes, out, float8, kept=0.0 if fusion.torchao_weights else 0.5)
    if fusion.attention:
        _fused_attention(nodes, out)
    return out
