"""The experts of a mixture-of-experts model, found in its captured graph: one group per MoE layer.

transformers' MoE layers (Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS, ...) and torchtitan's keep a
layer's experts as one module whose parameters are stacked along a leading dimension of ``E``
experts (``gate_up_proj`` of ``(E, 2·I, h)``, ``down_proj`` of ``(E, h, I)``, GPT-OSS's biases of
``(E, n)``), run as one grouped matmul; a router beside them picks ``k`` experts per token with a
``topk`` over ``E`` scores. Expert parallelism shards exactly such a module along its expert
dimension, so the group is recognised as a whole, never as ``E`` separate linears:

- an **expert module**: the innermost module every parameter of which (its own and its children's) has
  the same leading dimension ``E > 1`` and at least one of which is 3-D (a router's ``(E, h)`` weight
  alone is 2-D: not experts; the MoE block holding both is not the innermost);
- its **top k**: the last ``topk`` the graph runs inside the expert module's parent (the MoE block)
  over ``E`` scores (DeepSeek-V3's group-limited routing runs a ``topk`` over groups first);
- its **tokens** ``T`` (the rows a call routes, at the graph's batch: the ``topk``'s rows) and
  their **width** ``h`` (the last dimension of the expert module's output, one row per token).

A module with stacked parameters but no such ``topk`` is not a group: nothing says how many
experts a token meets.

Usage::

    groups = expert_groups(gm, model)
    groups[0].experts, groups[0].top_k, groups[0].dispatched_bytes()
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from autosplit.errors import ConstraintError, advice
from autosplit.passes.annotations import node_info

__all__ = ["ExpertGroup", "check_experts", "expert_groups", "expert_modules", "grouped_gemms"]

GROUPED_MM = ("_grouped_mm", "grouped_mm_fallback")
"""The ops (by name, less their overload) that run a layer's experts as one grouped matmul."""


@dataclass(frozen=True)
class ExpertGroup:
    """One MoE layer's experts, as the graph at one batch runs them."""

    module: str
    """Qualified name of the module holding the stacked experts (``model.layers.3.mlp.experts``)."""
    experts: int
    """``E``, the leading dimension of every parameter of the module."""
    top_k: int
    """Experts each token meets."""
    params: tuple[str, ...]
    """Qualified names of the stacked parameters (each ``E`` experts' slices)."""
    nodes: tuple[str, ...]
    """The graph's nodes that compute the experts (their module path inside :attr:`module`), in order."""
    tokens: int
    """Rows the layer routes per call at the graph's batch (``T``)."""
    hidden: int
    """Width of a routed row (``h``)."""
    itemsize: float
    """Bytes of a routed value, as the graph computes the experts' output (4 in fp32, 2 under bf16)."""

    def routed_rows(self) -> int:
        """``T·k``: the rows the experts compute, each token once per expert it meets."""
        return self.tokens * self.top_k

    def dispatched_bytes(self) -> float:
        """Bytes of the routed rows: what a dispatch (or a combine) moves in all, before the share that
        stays on its own rank."""
        return self.routed_rows() * self.hidden * self.itemsize


def expert_modules(model: torch.nn.Module) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Qualified module name → (``E``, its stacked parameters' qualified names), for each innermost module
    whose parameters all lead with the same ``E > 1``, one at least 3-D (the module docstring): the experts,
    not the MoE block around them, whose router's ``(E, h)`` weight leads with ``E`` too."""
    found: dict[str, tuple[int, tuple[str, ...]]] = {}
    for name, module in model.named_modules():
        params = list(module.named_parameters())
        if name == "" or not params or not any(p.dim() == 3 for _, p in params):
            continue
        leading = {p.shape[0] if p.dim() else None for _, p in params}
        if len(leading) == 1 and (e := leading.pop()) is not None and e > 1:
            found[name] = (int(e), tuple(f"{name}.{p}" for p, _ in params))
    return {name: v for name, v in found.items() if not any(other.startswith(f"{name}.") for other in found)}


def expert_groups(
    gm: fx.GraphModule, model: torch.nn.Module | None, module_paths: Mapping[str, str] | None = None,
) -> tuple[ExpertGroup, ...]:
    """The expert groups of the annotated graph ``gm`` of ``model`` (the module docstring), in graph
    order; none for a dense model or without ``model``. ``module_paths``: node name → module path
    (the capture's), else each node's annotation's."""
    if model is None:
        return ()
    modules = expert_modules(model)
    if not modules:
        return ()
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    path_of = {n.name: (module_paths or {}).get(n.name, _annotated_path(n)) for n in nodes}
    groups = []
    for module, (experts, params) in modules.items():
        inside = [n for n in nodes if _within(path_of[n.name], module)]
        parent = module.rpartition(".")[0]
        picks = [n for n in nodes if _is_topk(n) and _within(path_of[n.name], parent) and _scores_width(n) == experts]
        if not inside or not picks:
            continue
        rows, k = _topk_shape(picks[-1])
        hidden, itemsize = _width(inside[-1])
        if rows and k and hidden:
            groups.append(ExpertGroup(module, experts, k, params, tuple(n.name for n in inside), rows, hidden, itemsize))
    order = {n.name: i for i, n in enumerate(nodes)}
    return tuple(sorted(groups, key=lambda g: order[g.nodes[0]]))


def grouped_gemms(nodes: Sequence[fx.Node]) -> dict[int, int]:
    """Index into ``nodes`` → bytes of the stacked experts' weight it reads, for each grouped matmul of the experts'
    rows, ``(S, K) × (E, K, N)`` (torch's ``_grouped_mm``, transformers' CPU fallback): every expert's weight is
    read once per call, of which a rank of an expert-parallel group holds and reads ``1/ep``
    (:func:`~autosplit.passes.ep_costs.ep_laid_out`)."""
    found = {}
    for i, n in enumerate(nodes):
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        weight = n.args[1] if len(n.args) > 1 and name.split(".")[0] in GROUPED_MM else None
        value = weight.meta.get("val") if isinstance(weight, fx.Node) else None
        if isinstance(value, torch.Tensor) and value.dim() == 3:
            found[i] = value.numel() * value.element_size()
    return found


def _within(path: str, module: str) -> bool:
    return module == "" or path == module or path.startswith(f"{module}.")


def _annotated_path(node: fx.Node) -> str:
    return node_info(node).module_path if "autosplit" in node.meta else ""


def _is_topk(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "topk"
    return node.op == "call_function" and (node.target is torch.topk or getattr(node.target, "__name__", "").startswith("topk"))


def _scores_width(node: fx.Node) -> int | None:
    """The last dimension of the scores a ``topk`` node picks from (its first argument)."""
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node) or "autosplit" not in source.meta:
        return None
    shapes = node_info(source).output_shapes
    return shapes[0][-1] if shapes and shapes[0] else None


def _topk_shape(node: fx.Node) -> tuple[int, int]:
    """(rows, k) of a ``topk``'s output: its leading dimensions together, and its last."""
    shapes = node_info(node).output_shapes if "autosplit" in node.meta else ()
    if not shapes or not shapes[0]:
        return 0, 0
    return math.prod(shapes[0][:-1]), shapes[0][-1]


def _width(node: fx.Node) -> tuple[int, float]:
    """(last dimension, bytes a value) of the node's first output: the experts' rows as they return."""
    if "autosplit" not in node.meta or not (shapes := node_info(node).output_shapes) or not shapes[0]:
        return 0, 0.0
    info = node_info(node)
    return shapes[0][-1], info.output_bytes / max(1, sum(math.prod(s) for s in shapes))


def check_experts(groups: tuple[ExpertGroup, ...], ep: int) -> None:
    """Refuse an expert-parallel degree ``ep`` the model cannot take: no expert group, or one whose experts do
    not divide over ``ep`` ranks."""
    if ep <= 1:
        return
    if not groups:
        raise ConstraintError(advice(
            f"expert_parallel={ep}, and this model has no mixture-of-experts layer",
            "expert parallelism spreads the experts of a module whose parameters are stacked along a leading expert "
            "dimension, with a router's topk over them (autosplit.passes.experts); none was found",
            "plan with expert_parallel=1 (or 'auto')",
        ))
    counts = sorted({g.experts for g in groups})
    if bad := [e for e in counts if e % ep]:
        fits = sorted(d for d in range(1, min(counts) + 1) if all(e % d == 0 for e in counts))
        raise ConstraintError(advice(
            f"{bad[0]} experts do not divide over ep {ep}",
            "each expert-parallel rank holds an equal share of every layer's experts, whole",
            f"pass expert_parallel= one of {fits}, or 'auto'",
        ))
