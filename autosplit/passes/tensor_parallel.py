"""Tensor-parallel rules read from the captured graph, not from module names (DESIGN §4.9).

Megatron-LM's intra-layer split (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism"), as torch's ``ColwiseParallel`` and
``RowwiseParallel`` apply it, found by following how each linear's output is used:

1. Every linear whose weight is a parameter (``nn.Linear``, ``F.linear``, ``aten.linear``) that
   reads a whole (replicated) tensor starts a *group* as column-parallel: its output is split along
   its last (feature) dimension.
2. The split follows its readers: elementwise ops with scalars or operands broadcast across the
   split dimension, activations and dropout, reshapes that keep the split dimension outermost in
   its group (features → (heads, head_dim): the split moves to the heads, whose count must divide
   tp; heads merged back → features), transposes and permutes, slices along other dimensions,
   attention (``matmul`` of two tensors split along the same batch dimension, ``softmax`` and masks
   over others, ``scaled_dot_product_attention``), rotary arithmetic and grouped-query ``expand``.
3. A linear that reads a tensor split along its input features is row-parallel: its output is a
   partial sum, all-reduced in the forward. Groups that meet (q, k, v at the attention's matmul)
   merge; a group with a row-parallel linear is a valid pair (attention q/k/v → o, MLP gate/up → down).
4. Any other reader of a split tensor — a split along the split dimension (a fused qkv), a reduction
   or norm over it, the model's output when the group has a row-parallel linear — leaves the whole
   group replicated, and the linears it started are tried again as the start of new groups.
5. A group with no row-parallel linear whose split output reaches only the model's output is an LM
   head, column-parallel over the vocabulary (its output all-gathered, or read by ``loss_parallel``);
   an embedding looked up by the model's input ids is vocabulary-parallel (its output all-reduced).
   A parameter split along two dimensions, or split in one use and read whole in another, stays
   replicated and so do its users. Norms stay replicated (sequence parallelism is the cost model's).

Weights: a column-parallel linear's weight and bias along dim 0, a row-parallel one's weight along
dim 1 (its bias replicated), a vocabulary-parallel table along dim 0. Reads shapes and bytes from
the annotate pass (:class:`~autosplit.passes.annotations.NodeInfo`), for both graph flavours
(``symbolic_trace``: modules and ``torch`` functions; ``export``: ATen ops).

Usage::

    rules = tensor_parallel_rules(traced.captured, getattr(model, "config", None))
    check_degree(rules, 4)      # ConstraintError: "num_key_value_heads 2 is not divisible by tp 4"
    rules.shards                # {"model.layers.0.self_attn.q_proj.weight": 0, ...}
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autosplit.errors import ConstraintError, advice
from autosplit.passes.annotations import node_info
from autosplit.passes.capture import Captured

__all__ = ["TensorParallelRules", "check_degree", "tensor_parallel_rules"]

log = logging.getLogger(__name__)
aten = torch.ops.aten

_LINEARS = {nn.functional.linear, aten.linear.default, torch._C._nn.linear}
_LOOKUPS = {nn.functional.embedding: (1, 0), torch.embedding: (0, 1), aten.embedding.default: (0, 1)}
"""Embedding functions → the positions of the table and of the indices among their arguments."""
_ELEMENTWISE = frozenset((
    "add add_ iadd sub isub rsub mul imul div truediv itruediv floordiv pow neg exp log abs sqrt rsqrt square "
    "reciprocal sin cos erf relu gelu silu sigmoid tanh softplus mish elu leakyrelu leaky_relu hardtanh dropout "
    "identity to to_copy type float half bfloat16 double contiguous clone detach alias lift_fresh_copy where "
    "masked_fill maximum minimum clamp eq ne lt le gt ge and or"
).split())
_SHAPE_ONLY = frozenset("size sym_size sym_numel numel dim assert_tensor_metadata".split())
_REDUCTIONS = frozenset("sum mean amax amin var std logsumexp".split())
_PLACES = {("col", "weight"): 0, ("col", "bias"): 0, ("row", "weight"): 1, ("table", "table"): 0}
"""(a node's role, the slot a parameter takes in it) → the dimension the parameter is split along."""
_NO_PARTNER = "a Linear not followed by a row-parallel partner"


@dataclass(frozen=True)
class TensorParallelRules:
    """Which parameters and nodes a tp-way tensor-parallel split divides, and what it moves."""

    shards: Mapping[str, int]
    """Parameter name (as ``model.named_parameters()`` names it) → the dimension it is split along:
    0 for a column-parallel linear's weight and bias and a vocabulary-parallel table, 1 for a
    row-parallel linear's weight (its bias stays replicated)."""
    split_nodes: frozenset[str]
    """Nodes whose compute and outputs are divided over the tp ranks: the column-parallel linears,
    every node between them and their row-parallel partner, the partner (its output partial until the
    all-reduce), the LM head and the vocabulary-parallel lookups."""
    forward_collectives: Mapping[str, int]
    """Node → bytes of its whole output, reduced after it in the forward: all-reduced after each
    row-parallel linear and vocabulary-parallel lookup, all-gathered after an LM head."""
    backward_collectives: Mapping[str, int]
    """Node → bytes of the gradient of its output, all-reduced in the backward: the input of each
    column-parallel group, once per distinct tensor (q, k and v reading one normed state: once)."""
    divisors: tuple[tuple[str, int], ...]
    """(name, count) pairs every tp degree must divide: head counts, split feature sizes, vocabulary
    sizes; named by the model's config attribute of that value where one is given."""
    replicated: Mapping[str, str]
    """Module path → why its parameters stay whole on every tp rank."""


def check_degree(rules: TensorParallelRules, tp: int) -> None:
    """Refuse ``tp`` unless it divides every count of :attr:`TensorParallelRules.divisors`."""
    if tp < 1:
        raise ConstraintError(advice(f"tp {tp} is not a positive degree", None, "pass tp ≥ 1"))
    bad = [f"{name} {count} is not divisible by tp {tp}" for name, count in rules.divisors if count % tp]
    if bad:
        common = math.gcd(*(count for _, count in rules.divisors))
        fits = [d for d in range(1, common + 1) if common % d == 0]
        raise ConstraintError(advice(
            "; ".join(bad), "tensor parallelism gives each rank an equal share of the heads, split features and vocabulary",
            f"choose tp among {fits}",
        ))


def tensor_parallel_rules(captured: Captured, config: Any = None) -> TensorParallelRules:
    """The tensor-parallel split of an annotated captured graph (module docstring: the rules).

    ``config``: the model's configuration (a ``transformers`` ``PretrainedConfig``, any object), whose
    integer attributes name the divisors (``num_key_value_heads``); ``None``: described by module.
    """
    disabled: dict[str, str] = {}
    while True:  # each round leaves ≥ 1 more linear or lookup replicated, so it ends
        walk = _Walk(captured, disabled)
        failed = walk.failed()
        if not failed:
            failed = {k: v for k, v in _conflicts(walk).items() if k not in disabled}
        if not failed:
            break
        log.debug("tensor parallel: %d left replicated this round: %s", len(failed), failed)
        disabled.update(failed)
    rules = _collect(walk, config)
    log.info("tensor parallel: %d parameters split, %d forward and %d backward collectives, divisors %s",
             len(rules.shards), len(rules.forward_collectives), len(rules.backward_collectives), rules.divisors)
    return rules


class _Unsplittable(Exception):
    """An op that cannot take a split input (internal: its message says why)."""


@dataclass(eq=False)
class _Group:
    """Linears and the nodes between them that one split joins."""

    cols: list[fx.Node] = field(default_factory=list)
    rows: list[fx.Node] = field(default_factory=list)
    members: list[fx.Node] = field(default_factory=list)
    ends: list[fx.Node] = field(default_factory=list)
    """Split nodes the graph's output reads."""
    heads: list[tuple[fx.Node, int]] = field(default_factory=list)
    bad: str | None = None

    @property
    def is_head(self) -> bool:
        return not self.rows and bool(self.ends) and self.bad is None


class _Walk:
    """One pass over the graph in order: which nodes are split along which dimension, by group."""

    def __init__(self, captured: Captured, disabled: Mapping[str, str]):
        self.gm, self.paths, self.disabled = captured.gm, captured.module_paths, disabled
        self.split: dict[fx.Node, int] = {}
        self.tuples: set[fx.Node] = set()
        self.owner: dict[fx.Node, _Group] = {}
        self.lookups: dict[fx.Node, str] = {}
        """Vocabulary-parallel lookups → their table."""
        for node in self.gm.graph.nodes:
            self._visit(node)

    def path(self, node: fx.Node) -> str:
        return str(node.target) if node.op == "call_module" else self.paths.get(node.name, "")

    def where(self, node: fx.Node) -> str:
        return f"{node.name} ({self.path(node) or 'the root'})"

    def groups(self) -> list[_Group]:
        return list({id(g): g for g in self.owner.values()}.values())

    def valid(self) -> list[_Group]:
        return [g for g in self.groups() if g.bad is None and (g.is_head or (g.rows and not g.ends))]

    def failed(self) -> dict[str, str]:
        """Column-parallel linears of the groups that are no valid pair nor an LM head → why."""
        out = {}
        for g in self.groups():
            why = g.bad
            if why is None and g.rows and g.ends:
                why = f"{', '.join(self.where(n) for n in g.ends)} reaches the model's output still split"
            elif why is None and not g.rows and not g.ends:
                why = f"its split output ends at {', '.join(self.where(n) for n in g.members[-1:])}"
            if why is not None:
                out.update({n.name: f"{_NO_PARTNER}: {why}" for n in g.cols})
        return out

    def _merge(self, nodes: Iterable[fx.Node]) -> _Group:
        groups = list({id(self.owner[n]): self.owner[n] for n in nodes}.values())
        first = groups[0]
        for g in groups[1:]:
            for name in ("cols", "rows", "members", "ends", "heads"):
                getattr(first, name).extend(getattr(g, name))
            first.bad = first.bad or g.bad
            for n in g.members:
                self.owner[n] = first
        return first

    def _visit(self, node: fx.Node) -> None:
        readers = [a for a in node.all_input_nodes if a in self.split]
        if _linear(self.gm, node) is not None:
            self._linear(node, readers)
            return
        lookup = _lookup(self.gm, node)
        if lookup is not None and node.name not in self.disabled and getattr(lookup[1], "op", None) == "placeholder":
            self.lookups[node] = lookup[0]
        if not readers:
            return
        group = self._merge(readers)
        if node.op == "output":
            group.ends.extend(readers)
            return
        try:
            dim = _rule(self, node)
        except _Unsplittable as e:
            group.bad = group.bad or f"{self.where(node)} {e}"
            return
        if dim is not None:
            self.split[node], self.owner[node] = dim, group
            group.members.append(node)

    def _linear(self, node: fx.Node, readers: list[fx.Node]) -> None:
        x = node.args[0]
        if readers and x in self.split:
            group = self._merge(readers)
            why = self.disabled.get(node.name)
            if why is None and self.split[x] != len(_shape(x)) - 1:
                why = f"reads it split along dimension {self.split[x]}, not its input features"
            if why is not None:
                group.bad = group.bad or f"{self.where(node)}: {why}"
                return
            group.rows.append(node)
            group.members.append(node)
            self.owner[node] = group
        elif node.name not in self.disabled:
            group = _Group(cols=[node], members=[node])
            self.split[node], self.owner[node] = len(_shape(node)) - 1, group


def _shape(node: Any) -> tuple[int, ...]:
    """The shape of the one tensor ``node`` makes (its annotation); ``()`` for anything else."""
    shapes = node_info(node).output_shapes if isinstance(node, fx.Node) else ()
    return tuple(shapes[0]) if len(shapes) == 1 else ()


def _tensors(nodes: Iterable[Any]) -> list[fx.Node]:
    return [n for n in nodes if isinstance(n, fx.Node) and len(node_info(n).output_shapes) == 1]


def _param(gm: fx.GraphModule, node: Any) -> str | None:
    """The name of the parameter ``node`` reads whole (a ``get_attr``), else ``None``."""
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    try:
        gm.get_parameter(str(node.target))
    except AttributeError:
        return None
    return str(node.target)


def _linear(gm: fx.GraphModule, node: fx.Node) -> tuple[str, str | None] | None:
    """(weight, bias) of a linear whose weight (and bias, if any) are parameters."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Linear):
            return f"{node.target}.weight", (f"{node.target}.bias" if mod.bias is not None else None)
    elif node.op == "call_function" and node.target in _LINEARS:
        weight = _param(gm, node.args[1] if len(node.args) > 1 else node.kwargs.get("weight"))
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if weight is not None and (bias is None or _param(gm, bias) is not None):
            return weight, _param(gm, bias)
    return None


def _lookup(gm: fx.GraphModule, node: fx.Node) -> tuple[str, fx.Node] | None:
    """(table, indices) of an embedding lookup whose table is a parameter."""
    if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.Embedding):
        return f"{node.target}.weight", node.args[0]
    at = _LOOKUPS.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
    table = _param(gm, node.args[at[0]]) if at else None
    return (table, node.args[at[1]]) if at and table else None


def _op(gm: fx.GraphModule, node: fx.Node) -> str:
    """The op's plain name, the same for a module, a method, a ``torch`` function and an ATen op."""
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__.lower()
    if node.op == "call_method":
        return str(node.target).strip("_")
    packet = getattr(node.target, "_overloadpacket", None)
    return str(getattr(packet or node.target, "__name__", node.target)).strip("_")


def _norm(dim: Any, ndim: int) -> int:
    return int(dim) % ndim if ndim else 0


def _arg(node: fx.Node, at: int, name: str, default: Any = None) -> Any:
    return node.args[at] if len(node.args) > at else node.kwargs.get(name, default)


def _rule(w: _Walk, node: fx.Node) -> int | None:
    """The dimension ``node``'s output is split along, given its inputs'; ``_Unsplittable`` if none."""
    op = _op(w.gm, node)
    if op in _SHAPE_ONLY or (op == "getattr" and node.args[1] in ("shape", "device", "dtype", "ndim")):
        return None
    rule = _RULES.get(op) or (_elementwise if op in _ELEMENTWISE else _reduction if op in _REDUCTIONS else None)
    if rule is None:
        raise _Unsplittable(f"reads it with {op}, which does not keep a split")
    return rule(w, node)


def _aligned(w: _Walk, node: fx.Node, operands: list[fx.Node], upto: int | None = None) -> int:
    """The output dimension the split operands (right-aligned, as broadcasting aligns them) agree
    on; replicated operands must not span it (size 1 or absent) where it is below ``upto``."""
    nd = len(_shape(node))
    dims = {w.split[a] + nd - len(_shape(a)) for a in operands if a in w.split}
    if len(dims) != 1:
        raise _Unsplittable("combines tensors split along different dimensions")
    dim = dims.pop()
    for a in operands:
        s = _shape(a)
        k = dim - nd + len(s)
        if a not in w.split and (upto is None or dim < upto) and k >= 0 and s[k] != 1:
            raise _Unsplittable(f"combines it with {a.name}, whole along the split dimension ({s[k]} entries)")
    return dim


def _elementwise(w: _Walk, node: fx.Node) -> int:
    return _aligned(w, node, _tensors(node.all_input_nodes))


def _matmul(w: _Walk, node: fx.Node) -> int:
    a, b = node.args[:2]
    na, nb = len(_shape(a)), len(_shape(b))
    if min(na, nb) < 2 or w.split.get(a) == na - 1 or w.split.get(b) == nb - 2:  # type: ignore[arg-type]
        raise _Unsplittable("contracts over the split dimension (a product of two activations)")
    return _aligned(w, node, _tensors((a, b)), upto=len(_shape(node)) - 2)


def _attention(w: _Walk, node: fx.Node) -> int:
    operands = _tensors((*node.args[:3], _arg(node, 3, "attn_mask")))
    dim = _aligned(w, node, operands)
    if dim >= len(_shape(node)) - 2:
        raise _Unsplittable("attends along the split dimension")
    return dim


def _reshape_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> int | None:
    """Where a reshape ``src`` → ``dst`` puts dimension ``dim``, kept whole-sliced: the outermost
    (non-1) dimension of its group of ``src`` dimensions becomes the outermost of ``dst``'s."""
    i = j = 0
    while i < len(src) and j < len(dst):
        i0, j0, pi, pj = i, j, src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj and (i < len(src) or j < len(dst)):
            if pi < pj and i < len(src):
                pi, i = pi * src[i], i + 1
            elif j < len(dst):
                pj, j = pj * dst[j], j + 1
            else:
                return None
        if i0 <= dim < i:
            lead_src = [k for k in range(i0, i) if src[k] != 1]
            lead_dst = [k for k in range(j0, j) if dst[k] != 1]
            return lead_dst[0] if lead_src[:1] == [dim] and lead_dst else None
    return None


def _reshape(w: _Walk, node: fx.Node) -> int:
    x = node.args[0]
    src, dst = _shape(x), _shape(node)
    new = _reshape_dim(src, dst, w.split[x])
    if new is None:
        raise _Unsplittable(f"reshapes {src} into {dst}, where the split dimension is not outermost")
    if dst[new] < src[w.split[x]]:  # features into (heads, head_dim): tp must divide the heads
        w.owner[x].heads.append((node, dst[new]))
    return new


def _expand(w: _Walk, node: fx.Node) -> int:
    x = node.args[0]
    src, dst = _shape(x), _shape(node)
    new = w.split[x] + len(dst) - len(src)
    if dst[new] != src[w.split[x]]:
        raise _Unsplittable("expands the split dimension")
    return new


def _transpose(w: _Walk, node: fx.Node) -> int:
    x = node.args[0]
    n, dim = len(_shape(x)), w.split[x]
    if _op(w.gm, node) == "permute":
        order = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return [_norm(d, n) for d in order].index(dim)
    a, b = (0, 1) if _op(w.gm, node) == "t" else (_norm(_arg(node, 1, "dim0"), n), _norm(_arg(node, 2, "dim1"), n))
    return b if dim == a else a if dim == b else dim


def _softmax(w: _Walk, node: fx.Node) -> int:
    x = node.args[0]
    given = _arg(node, 1, "dim")
    if given is None or _norm(given, len(_shape(x))) == w.split[x]:
        raise _Unsplittable("normalises over the split dimension")
    return w.split[x]


def _reduction(w: _Walk, node: fx.Node) -> int:
    x = node.args[0]
    given, keep = _arg(node, 1, "dim"), _arg(node, 2, "keepdim", False)
    if given is None:
        raise _Unsplittable("reduces over every dimension, the split one too")
    dims = [_norm(d, len(_shape(x))) for d in (given if isinstance(given, (list, tuple)) else [given])]
    dim = w.split[x]
    if dim in dims:
        raise _Unsplittable("reduces over the split dimension")
    return dim if keep is True else dim - sum(d < dim for d in dims)


def _slice(w: _Walk, node: fx.Node) -> int:
    x = node.args[0]
    dim, src = w.split[x], _shape(x)
    if _op(w.gm, node) == "select":
        at = _norm(node.args[1], len(src))
        if at == dim:
            raise _Unsplittable("selects along the split dimension")
        return dim - (at < dim)
    if _shape(node)[dim] != src[dim]:
        raise _Unsplittable("slices the split dimension")
    return dim


def _getitem(w: _Walk, node: fx.Node) -> int:
    x, index = node.args[:2]
    if x in w.tuples:
        return w.split[x]
    src, dst, dim = _shape(x), _shape(node), w.split[x]
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in items):
        raise _Unsplittable("indexes it with a tensor")
    if any(i is Ellipsis for i in items):
        at = next(k for k, i in enumerate(items) if i is Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(src) - sum(i is not None for i in items) + 1)
    i = j = 0
    for item in items:
        if item is not None and i == dim:
            if isinstance(item, int) or src[i] != dst[j]:
                raise _Unsplittable("indexes into the split dimension")
            return j
        i, j = i + (item is not None), j + (not isinstance(item, int))
    return j + dim - i


def _cat(w: _Walk, node: fx.Node) -> int:
    parts = list(node.args[0])
    dims = {w.split.get(t) for t in parts}
    if None in dims or len(dims) != 1 or _norm(_arg(node, 1, "dim", 0), len(_shape(node))) in dims:
        raise _Unsplittable("concatenates it with a whole tensor or along the split dimension")
    return dims.pop()  # type: ignore[return-value]


def _chunks(w: _Walk, node: fx.Node) -> int:
    x = node.args[0]
    if _norm(_arg(node, 2, "dim", 0), len(_shape(x))) == w.split[x]:
        raise _Unsplittable(f"splits it along the sharded dimension {w.split[x]} (a fused projection)")
    w.tuples.add(node)
    return w.split[x]


_RULES = {
    **dict.fromkeys("view reshape unsafe_view flatten unflatten unsqueeze squeeze view_as reshape_as".split(), _reshape),
    **dict.fromkeys(("expand", "expand_as"), _expand),
    **dict.fromkeys(("transpose", "permute", "t"), _transpose),
    **dict.fromkeys(("matmul", "bmm"), _matmul),
    **dict.fromkeys(("softmax", "log_softmax"), _softmax),
    **dict.fromkeys(("slice", "narrow", "select"), _slice),
    **dict.fromkeys(("split", "chunk", "split_with_sizes"), _chunks),
    "scaled_dot_product_attention": _attention, "getitem": _getitem, "cat": _cat,
}


def _reads(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, str]]:
    """(parameter, slot) for each parameter ``node`` reads; slot ``weight``, ``bias``, ``table`` or ``other``."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        slot = {nn.Linear: {"weight": "weight", "bias": "bias"}, nn.Embedding: {"weight": "table"}}.get(type(mod), {})
        return [(f"{node.target}.{n}", slot.get(n, "other")) for n, _ in mod.named_parameters()]
    linear, lookup = _linear(gm, node), _lookup(gm, node)
    slots = {linear[0]: "weight", linear[1]: "bias"} if linear else {lookup[0]: "table"} if lookup else {}
    return [(p, slots.get(p, "other")) for a in node.all_input_nodes if (p := _param(gm, a)) is not None]


def _uses(walk: _Walk) -> dict[str, dict[fx.Node, int | None]]:
    """Parameter → each node reading it → the dimension that read splits it along (``None``: whole)."""
    role = {n: "table" for n in walk.lookups}
    for g in walk.valid():
        role.update({**dict.fromkeys(g.cols, "col"), **dict.fromkeys(g.rows, "row")})
    uses: dict[str, dict[fx.Node, int | None]] = {}
    for node in walk.gm.graph.nodes:
        for param, slot in _reads(walk.gm, node):
            uses.setdefault(param, {})[node] = _PLACES.get((role.get(node, ""), slot))
    return uses


def _conflicts(walk: _Walk) -> dict[str, str]:
    """Nodes that would split a parameter another read splits otherwise or reads whole → why."""
    out = {}
    for param, uses in _uses(walk).items():
        if len(set(uses.values())) > 1:
            seen = "; ".join(f"{walk.where(n)}: {'whole' if d is None else f'dim {d}'}" for n, d in uses.items())
            out.update({n.name: f"its parameter {param} would be split inconsistently ({seen})"
                        for n, d in uses.items() if d is not None})
    return out


def _size(node: Any) -> int:
    return node_info(node).output_bytes


def _collect(walk: _Walk, config: Any) -> TensorParallelRules:
    """The rules of a walk that left no group invalid."""
    shards = {p: d for p, uses in _uses(walk).items() if len(set(uses.values())) == 1 and (d := next(iter(uses.values()))) is not None}
    split, forward, backward = set(walk.lookups), {n.name: _size(n) for n in walk.lookups}, {}
    names = _Names(config)
    for g in walk.valid():
        split.update(g.members)
        forward.update({n.name: _size(n) for n in (g.ends if g.is_head else g.rows)})
        backward.update({c.args[0].name: _size(c.args[0]) for c in g.cols})  # type: ignore[union-attr]
        for node, heads in g.heads:
            names.add("heads", heads, walk.path(node))
        for col in g.cols:
            names.add("vocab" if g.is_head else "features", _shape(col)[-1], walk.path(col))
    for node, table in walk.lookups.items():
        names.add("vocab", walk.gm.get_parameter(table).shape[0], walk.path(node))
    return TensorParallelRules(
        shards=shards, split_nodes=frozenset(n.name for n in split), forward_collectives=forward,
        backward_collectives=backward, divisors=tuple(names.found.items()), replicated=_replicated(walk, shards),
    )


def _replicated(walk: _Walk, shards: Mapping[str, int]) -> dict[str, str]:
    """Module path → why it stays whole: a linear or lookup left out (the round's reason), else the
    op that reads its parameters whole."""
    out: dict[str, str] = {}
    split_owners = {p.rpartition(".")[0] for p in shards}
    for node in walk.gm.graph.nodes:
        reads = _reads(walk.gm, node)
        path = walk.path(node) or (reads[0][0].rpartition(".")[0] if reads else "")
        if not reads or path in split_owners or path in out or any(p in shards for p, _ in reads):
            continue
        if node.name in walk.disabled:
            out[path] = walk.disabled[node.name]
        elif _linear(walk.gm, node) is not None:
            out[path] = _NO_PARTNER
        elif _lookup(walk.gm, node) is not None:
            out[path] = "an embedding looked up by computed indices, not the model's input ids"
        elif any(p not in shards for p, _ in reads):
            out[path] = f"its parameters are read whole by {_op(walk.gm, node)} ({node.name}); norms stay replicated"
    return out


class _Names:
    """Divisors in the order found, each named by the config attribute of that count when one fits."""

    _PREFER = ("num_attention_heads", "n_head", "num_heads", "intermediate_size", "ffn_dim", "n_inner", "hidden_size", "vocab_size")

    def __init__(self, config: Any):
        values = config.to_dict() if hasattr(config, "to_dict") else vars(config) if config is not None else {}
        self.ints = {k: v for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool)}
        self.found: dict[str, int] = {}
        self._described: set[tuple[str, int]] = set()

    _SAY = {"heads": "the {} heads of {}", "features": "the {} output features of {}", "vocab": "the vocabulary of {} ({})"}

    def add(self, kind: str, count: int, path: str) -> None:
        fits = [k for k, v in self.ints.items() if v == count and self._kind(k) == kind]
        if fits:
            name = min(fits, key=lambda k: (self._PREFER.index(k) if k in self._PREFER else len(self._PREFER), k))
            self.found.setdefault(name, count)
        elif (kind, count) not in self._described:
            self._described.add((kind, count))
            self.found.setdefault(self._SAY[kind].format(count, path or "the root"), count)

    @staticmethod
    def _kind(attr: str) -> str:
        if "vocab" in attr:
            return "vocab"
        if "head" in attr:
            return "heads" if "dim" not in attr and "size" not in attr else ""
        return "features" if any(w in attr for w in ("size", "dim", "inner", "embd", "model")) and "max" not in attr else ""
