"""Tensor-parallel rules read from the captured graph, not from module names (DESIGN §4.9).

Megatron-LM's intra-layer split (Shoeybi et al., 2019), as torch's ``ColwiseParallel``/``RowwiseParallel``
apply it, found by following each linear's output through its readers (traced or exported graphs):

1. A linear with a parameter weight reading a whole tensor starts a group, column-parallel: its output
   is split along its features. The split follows elementwise ops with operands broadcast across it,
   reshapes (features → (heads, head_dim): on the heads, a count tp must divide), transposes, slices
   of other dimensions, attention (``matmul`` along a batch dimension, ``softmax`` and masks over
   others, ``scaled_dot_product_attention``), rotary arithmetic and grouped-query ``expand``.
2. A linear reading it split along its input features is row-parallel (its output all-reduced).
   Groups that meet merge (q, k and v at the attention's ``matmul``).
3. Any other reader (a ``split`` along it: a fused qkv; a norm or reduction over it; the output after a
   row-parallel linear) leaves the group's linears whole, each tried again as a group's start.
4. A group with no row-parallel linear whose split reaches only the output is an LM head over the
   vocabulary (all-gathered, or ``loss_parallel``); a lookup of the input ids is vocabulary-parallel
   (all-reduced). A parameter split two ways, or split once and read whole elsewhere, stays whole, as
   norms do (sequence parallelism is the cost model's choice: :mod:`autosplit.passes.tp_costs`).

Usage::

    rules = tensor_parallel_rules(traced.captured, getattr(model, "config", None))
    check_degree(rules, 4)      # ConstraintError: "num_key_value_heads 2 is not divisible by tp 4"
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

from autosplit import compat
from autosplit.errors import ConstraintError, advice
from autosplit.passes.annotations import node_info
from autosplit.passes.capture import Captured

__all__ = ["LINEAR_FUNCTIONS", "TensorParallelRules", "check_degree", "tensor_parallel_rules"]

log = logging.getLogger(__name__)
aten = torch.ops.aten

LINEAR_FUNCTIONS = {nn.functional.linear, aten.linear.default, compat.C_LINEAR}
_LOOKUPS = {nn.functional.embedding: (1, 0), torch.embedding: (0, 1), aten.embedding.default: (0, 1)}  # → (table, indices) at
_ELEMENTWISE = frozenset((
    "add sub rsub mul div truediv floordiv pow neg exp log abs sqrt rsqrt square reciprocal sin cos erf "
    "relu gelu silu sigmoid tanh softplus mish elu leakyrelu leaky_relu hardtanh dropout identity to to_copy "
    "type float half bfloat16 double contiguous clone detach alias lift_fresh_copy where masked_fill maximum "
    "minimum clamp eq ne lt le gt ge and or iadd isub imul itruediv"
).split())
_SHAPE_ONLY = frozenset("size sym_size sym_numel numel dim assert_tensor_metadata".split())
_REDUCTIONS = frozenset("sum mean amax amin var std logsumexp".split())
_CHUNKS = ("split", "chunk", "split_with_sizes")
_PLACES = {("col", "weight"): 0, ("col", "bias"): 0, ("row", "weight"): 1, ("table", "table"): 0}  # (role, slot) → dim


@dataclass(frozen=True)
class TensorParallelRules:
    """Which parameters and nodes a tp-way tensor-parallel split divides, and what it moves."""

    shards: Mapping[str, int]
    """Parameter (``model.named_parameters()`` name) → its split dimension: 0 for a column-parallel linear's
    weight and bias and a vocabulary table, 1 for a row-parallel linear's weight (its bias stays whole)."""
    split_nodes: frozenset[str]
    """Nodes whose compute and outputs tp divides: each group's linears and the nodes between, lookups."""
    forward_collectives: Mapping[str, int]
    """Node → bytes of its whole output: all-reduced after a row-parallel linear or a vocabulary lookup,
    all-gathered after an LM head, in the forward."""
    backward_collectives: Mapping[str, int]
    """Node → bytes of its gradient, all-reduced in the backward: each group's input (q, k, v's: once)."""
    divisors: tuple[tuple[str, int], ...]
    """(name, count) every tp degree must divide: heads, split features, vocabularies (config names)."""
    replicated: Mapping[str, str]
    """Module path → why its parameters stay whole on every tp rank."""
    whole_linears: frozenset[str] = frozenset()
    """Of :attr:`replicated`, the linears (whole on every rank: no sequence parallelism around them)."""


def check_degree(rules: TensorParallelRules, tp: int) -> None:
    """Refuse ``tp`` (≥ 1: :class:`~autosplit.options.PlanOptions` checks it) unless it divides every count of
    :attr:`TensorParallelRules.divisors`."""
    bad = [f"{name} {count} is not divisible by tp {tp}" for name, count in rules.divisors if count % tp]
    if bad:
        common = math.gcd(*(count for _, count in rules.divisors))
        raise ConstraintError(advice(
            "; ".join(bad), "tensor parallelism gives each rank an equal share of the heads, split features and vocabulary",
            f"choose tp among {[d for d in range(1, common + 1) if common % d == 0]}",
        ))


def tensor_parallel_rules(captured: Captured, config: Any = None) -> TensorParallelRules:
    """The tensor-parallel split of an annotated captured graph; ``config`` (the model's, any object):
    its integer attributes name the divisors (``num_key_value_heads``)."""
    disabled: dict[str, str] = {}
    while True:  # each round leaves ≥ 1 more linear or lookup whole, so the rounds end
        walk = _Walk(captured, disabled)
        failed = {n.name: f"a Linear not followed by a row-parallel partner: {why}"
                  for g, why in walk.verdicts() if why is not None for n in g.cols}
        failed = failed or {k: v for k, v in walk.conflicts().items() if k not in disabled}
        if not failed:
            break
        log.debug("tensor parallel: left whole this round: %s", failed)
        disabled.update(failed)
    rules = walk.rules(config)
    log.info("tensor parallel: %d parameters split; divisors %s", len(rules.shards), rules.divisors)
    return rules


class _Unsplittable(Exception):
    """An op that cannot take a split input (internal: its message says why)."""


@dataclass(eq=False)
class _Group:
    """Linears and the nodes between them that one split joins; ``ends``: split nodes the output reads."""

    cols: list[fx.Node] = field(default_factory=list)
    rows: list[fx.Node] = field(default_factory=list)
    members: list[fx.Node] = field(default_factory=list)
    ends: list[fx.Node] = field(default_factory=list)
    heads: list[tuple[fx.Node, int]] = field(default_factory=list)
    bad: str | None = None


class _Walk:
    """One pass over the graph in order: which nodes are split along which dimension, by group; the
    rule for each op is the method ``_RULES`` names (it raises :class:`_Unsplittable` when none fits)."""

    def __init__(self, captured: Captured, disabled: Mapping[str, str]):
        self.gm, self.paths, self.disabled = captured.gm, captured.module_paths, disabled
        first: dict[int, str] = {}  # each parameter by its first name, as model.named_parameters() names a tied one
        self.params = {name: first.setdefault(id(p), name) for name, p in self.gm.named_parameters(remove_duplicate=False)}
        self.split: dict[fx.Node, int] = {}
        self.tuples: set[fx.Node] = set()
        self.owner: dict[fx.Node, _Group] = {}
        for node in self.gm.graph.nodes:
            self.visit(node)
        self.lookups = {n: lk[0] for n in self.gm.graph.nodes  # vocabulary-parallel lookups → their table
                        if n.name not in disabled and (lk := self.lookup(n)) and getattr(lk[1], "op", None) == "placeholder"}

    def path(self, node: fx.Node) -> str:
        return str(node.target) if node.op == "call_module" else self.paths.get(node.name, "")

    def where(self, node: fx.Node) -> str:
        return f"{node.name} ({self.path(node) or 'the root'})"

    def verdicts(self) -> list[tuple[_Group, str | None]]:
        """Each group → why it is neither a pair nor an LM head (``None``: it is one)."""
        out = []
        for g in {id(g): g for g in self.owner.values()}.values():
            leaks = f"{', '.join(self.where(n) for n in g.ends)} reaches the model's output still split" if g.rows and g.ends else None
            out.append((g, g.bad or leaks or (None if g.rows or g.ends else f"its split output ends at {self.where(g.members[-1])}")))
        return out

    def merge(self, nodes: Iterable[fx.Node]) -> _Group:
        first, *others = {id(self.owner[n]): self.owner[n] for n in nodes}.values()
        for g in others:
            for name in ("cols", "rows", "members", "ends", "heads"):
                getattr(first, name).extend(getattr(g, name))
            first.bad = first.bad or g.bad
            self.owner.update(dict.fromkeys(g.members, first))
        return first

    def param(self, node: Any) -> str | None:
        """The name of the parameter ``node`` reads whole (a ``get_attr``), else ``None``."""
        return self.params.get(str(node.target)) if isinstance(node, fx.Node) and node.op == "get_attr" else None

    def linear(self, node: fx.Node) -> tuple[str, str | None] | None:
        """(weight, bias) of a linear whose weight (and bias, if any) are parameters."""
        if node.op == "call_module":
            mod = self.gm.get_submodule(str(node.target))
            if isinstance(mod, nn.Linear):
                return f"{node.target}.weight", (f"{node.target}.bias" if mod.bias is not None else None)
        elif node.op == "call_function" and node.target in LINEAR_FUNCTIONS:
            weight, bias = self.param(_arg(node, 1, "weight")), _arg(node, 2, "bias")
            if weight is not None and (bias is None or self.param(bias) is not None):
                return weight, self.param(bias)
        return None

    def lookup(self, node: fx.Node) -> tuple[str, fx.Node] | None:
        """(table, indices) of an embedding lookup whose table is a parameter."""
        if node.op == "call_module" and isinstance(self.gm.get_submodule(str(node.target)), nn.Embedding):
            return f"{node.target}.weight", _arg(node, 0)
        at = _LOOKUPS.get(node.target) if node.op == "call_function" else None
        table = self.param(_arg(node, at[0])) if at else None
        return (table, _arg(node, at[1])) if at and table else None

    def op(self, node: fx.Node) -> str:
        """The op's plain name, the same for a module, a method, a ``torch`` function and an ATen op."""
        if node.op == "call_module":
            return type(self.gm.get_submodule(str(node.target))).__name__.lower()
        if node.op == "call_method":
            return str(node.target).strip("_")
        packet = getattr(node.target, "_overloadpacket", None)
        return str(getattr(packet or node.target, "__name__", node.target)).strip("_")

    def reads(self, node: fx.Node) -> list[tuple[str, str]]:
        """(parameter, slot) for each parameter ``node`` reads; slot ``weight``, ``bias``, ``table`` or ``other``."""
        if node.op == "call_module":
            mod = self.gm.get_submodule(str(node.target))
            slot = {nn.Linear: {"weight": "weight", "bias": "bias"}, nn.Embedding: {"weight": "table"}}.get(type(mod), {})
            return [(self.params[f"{node.target}.{n}"], slot.get(n, "other")) for n, _ in mod.named_parameters()]
        linear, lookup = self.linear(node), self.lookup(node)
        slots = {linear[0]: "weight", linear[1]: "bias"} if linear else {lookup[0]: "table"} if lookup else {}
        return [(p, slots.get(p, "other")) for a in node.all_input_nodes if (p := self.param(a)) is not None]

    def visit(self, node: fx.Node) -> None:
        readers = [a for a in node.all_input_nodes if a in self.split]
        if self.linear(node) is not None and _arg(node, 0) not in self.split:
            if node.name not in self.disabled:  # column-parallel: a new group
                self.split[node], self.owner[node] = len(_shape(node)) - 1, _Group(cols=[node], members=[node])
            return
        if not readers:
            return
        group = self.merge(readers)
        if node.op == "output":
            group.ends.extend(readers)
            return
        op = self.op(node)
        if op in _SHAPE_ONLY or (op == "getattr" and _arg(node, 1) in ("shape", "device", "dtype", "ndim")):
            return
        rule = _RULES.get(op) or ("broadcast" if op in _ELEMENTWISE else "reduction" if op in _REDUCTIONS else None)
        try:
            if rule is None:
                raise _Unsplittable(f"reads it with {op}, which does not keep a split")
            dim = getattr(self, rule)(node, op)
        except _Unsplittable as e:
            group.bad = group.bad or f"{self.where(node)} {e}"
            return
        if dim is not None:
            self.split[node], self.owner[node] = dim, group
            group.members.append(node)

    def row(self, node: fx.Node, op: str) -> None:
        """A linear reading a split tensor: row-parallel when it is split along the input features."""
        x = _arg(node, 0)
        why = self.disabled.get(node.name) or ("its weight is not a parameter" if self.linear(node) is None else None)
        if why is None and self.split.get(x) != len(_shape(x)) - 1:
            why = f"reads it split along dimension {self.split.get(x)}, not its input features"
        if why is not None:
            raise _Unsplittable(f"(a linear): {why}")
        group = self.owner[node] = self.owner[x]
        group.rows.append(node)
        group.members.append(node)

    def aligned(self, node: fx.Node, operands: Iterable[Any], upto: int | None = None) -> int:
        """The output dimension the split operands (right-aligned, as broadcasting aligns them) agree
        on; whole operands must not span it (size 1 or absent) where it is below ``upto``."""
        operands, nd = [a for a in operands if _shape(a)], len(_shape(node))
        dims = {self.split[a] + nd - len(_shape(a)) for a in operands if a in self.split}
        if len(dims) != 1:
            raise _Unsplittable("combines tensors split along different dimensions")
        dim = dims.pop()
        for a in operands:
            s, k = _shape(a), dim - nd + len(_shape(a))
            if a not in self.split and (upto is None or dim < upto) and k >= 0 and s[k] != 1:
                raise _Unsplittable(f"combines it with {a.name}, whole along the split dimension ({s[k]} entries)")
        return dim

    def broadcast(self, node: fx.Node, op: str) -> int:
        """Elementwise ops; ``matmul`` (split along a batch dimension, or a's rows, or b's columns) and
        attention (along a batch dimension: the heads)."""
        if op in ("matmul", "bmm"):
            a, b = _arg(node, 0), _arg(node, 1)
            na, nb = len(_shape(a)), len(_shape(b))
            if min(na, nb) < 2 or self.split.get(a) == na - 1 or self.split.get(b) == nb - 2:
                raise _Unsplittable("contracts over the split dimension (a product of two activations)")
            return self.aligned(node, [a, b], upto=len(_shape(node)) - 2)
        sdpa = op == "scaled_dot_product_attention"
        dim = self.aligned(node, [*(_arg(node, i) for i in range(3)), _arg(node, 3, "attn_mask")] if sdpa else node.all_input_nodes)
        if sdpa and dim >= len(_shape(node)) - 2:
            raise _Unsplittable("attends along the split dimension")
        return dim

    def reshape(self, node: fx.Node, op: str) -> int:
        x = _arg(node, 0)
        src, dst, dim = _shape(x), _shape(node), self.split[x]
        shift = len(dst) - len(src)  # expand: the same dimensions, leading ones added
        new = _reshape_dim(src, dst, dim) if "expand" not in op else dim + shift if dst[dim + shift] == src[dim] else None
        if new is None:
            raise _Unsplittable(f"reshapes {src} into {dst}, where the split dimension is not outermost")
        if dst[new] < src[dim]:  # features into (heads, head_dim): tp must divide the heads
            self.owner[x].heads.append((node, dst[new]))
        return new

    def transpose(self, node: fx.Node, op: str) -> int:
        x = _arg(node, 0)
        n, dim = len(_shape(x)), self.split[x]
        if op == "permute":
            order = _arg(node, 1) if isinstance(_arg(node, 1), (list, tuple)) else [_arg(node, i) for i in range(1, len(node.args))]
            return [d % n for d in order].index(dim)
        a, b = (0, 1) if op == "t" else (_arg(node, 1, "dim0") % n, _arg(node, 2, "dim1") % n)
        return b if dim == a else a if dim == b else dim

    def along(self, node: fx.Node, op: str) -> int:
        """An op along one dimension (softmax, select, split, slice): any but the split one, or a slice
        that keeps it whole."""
        x = _arg(node, 0)
        given, dim, n = _arg(node, 2 if op in _CHUNKS else 1, "dim", None if "softmax" in op else 0), self.split[x], len(_shape(x))
        if op in ("slice", "narrow") and _shape(node)[dim] == _shape(x)[dim]:
            return dim
        if given is None or given % n == dim:
            raise _Unsplittable(f"splits it along the split dimension {dim} (a fused projection)" if op in _CHUNKS
                                else f"reads it with {op} along the split dimension {dim}")
        self.tuples.update([node] if op in _CHUNKS else [])
        return dim - (op == "select" and given % n < dim)

    def reduction(self, node: fx.Node, op: str) -> int:
        x = _arg(node, 0)
        given, keep, dim = _arg(node, 1, "dim"), _arg(node, 2, "keepdim", False), self.split[x]
        dims = [] if given is None else [d % len(_shape(x)) for d in (given if isinstance(given, (list, tuple)) else [given])]
        if not dims or dim in dims:
            raise _Unsplittable("reduces over the split dimension")
        return dim if keep is True else dim - sum(d < dim for d in dims)

    def getitem(self, node: fx.Node, op: str) -> int:
        x, index = _arg(node, 0), _arg(node, 1)
        if x in self.tuples:
            return self.split[x]
        src, dst, dim = _shape(x), _shape(node), self.split[x]
        items = list(index) if isinstance(index, tuple) else [index]
        if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in items):
            raise _Unsplittable("indexes it with a tensor")
        if Ellipsis in items:
            at = items.index(Ellipsis)
            items[at:at + 1] = [slice(None)] * (len(src) - sum(i is not None for i in items) + 1)
        i = j = 0
        for item in items:
            if item is not None and i == dim:
                if isinstance(item, int) or src[i] != dst[j]:
                    raise _Unsplittable("indexes into the split dimension")
                return j
            i, j = i + (item is not None), j + (not isinstance(item, int))
        return j + dim - i

    def cat(self, node: fx.Node, op: str) -> int:
        dims = {self.split.get(t) for t in _arg(node, 0)}
        if None in dims or len(dims) != 1 or _arg(node, 1, "dim", 0) % len(_shape(node)) in dims:
            raise _Unsplittable("concatenates it with a whole tensor or along the split dimension")
        return dims.pop()  # type: ignore[return-value]

    def uses(self) -> dict[str, dict[fx.Node, int | None]]:
        """Parameter → each node reading it → the dimension that read splits it along (``None``: whole)."""
        role = {n: "table" for n in self.lookups}
        for g in (g for g, why in self.verdicts() if why is None):
            role.update({**dict.fromkeys(g.cols, "col"), **dict.fromkeys(g.rows, "row")})
        uses: dict[str, dict[fx.Node, int | None]] = {}
        for node in self.gm.graph.nodes:
            for param, slot in self.reads(node):
                uses.setdefault(param, {})[node] = _PLACES.get((role.get(node, ""), slot))
        return uses

    def conflicts(self) -> dict[str, str]:
        """Nodes that would split a parameter another read splits otherwise or reads whole → why."""
        out = {}
        for param, uses in self.uses().items():
            if len(set(uses.values())) > 1:
                seen = "; ".join(f"{self.where(n)}: {'whole' if d is None else f'dim {d}'}" for n, d in uses.items())
                out.update({n.name: f"its parameter {param} would be split inconsistently ({seen})"
                            for n, d in uses.items() if d is not None})
        return out

    def rules(self, config: Any) -> TensorParallelRules:
        """The rules of a walk that left no group invalid and no parameter split two ways."""
        shards = {p: d for p, uses in self.uses().items() if (d := next(iter(uses.values()))) is not None}
        size = {n: node_info(n).output_bytes for n in self.gm.graph.nodes}
        split, forward, backward = set(self.lookups), {n.name: size[n] for n in self.lookups}, {}
        found: list[tuple[str, int, str]] = []  # (kind, count, module path) in the order found
        for g in (g for g, why in self.verdicts() if why is None):
            split.update(g.members)
            forward.update({n.name: size[n] for n in (g.rows or g.ends)})
            backward.update({_arg(c, 0).name: size[_arg(c, 0)] for c in g.cols})
            found += [("heads", heads, self.path(node)) for node, heads in g.heads]
            found += [("features" if g.rows else "vocab", _shape(col)[-1], self.path(col)) for col in g.cols]
        found += [("vocab", self.gm.get_parameter(t).shape[0], self.path(n)) for n, t in self.lookups.items()]
        return TensorParallelRules(
            shards=shards, split_nodes=frozenset(n.name for n in split), forward_collectives=forward,
            backward_collectives=backward, divisors=_divisors(found, config), replicated=self.replicated(shards),
            whole_linears=frozenset(self.path(n) for n in self.gm.graph.nodes if self.linear(n) and n not in split),
        )

    def replicated(self, shards: Mapping[str, int]) -> dict[str, str]:
        """Module path → why it stays whole: the round's reason for a linear or lookup left out, else
        the op that reads its parameters whole."""
        out: dict[str, str] = {}
        for node in self.gm.graph.nodes:
            reads = self.reads(node)
            path = self.path(node) or (reads[0][0].rpartition(".")[0] if reads else "")
            if not reads or path in out or any(p in shards for p, _ in reads):
                continue
            out[path] = self.disabled.get(node.name) or (
                "an embedding looked up by computed indices, not the model's input ids" if self.lookup(node) is not None
                else f"its parameters are read whole by {self.op(node)} ({node.name}); norms stay replicated")
        return out


_RULES = {  # op → the _Walk method that says where it puts a split input
    **dict.fromkeys("view reshape unsafe_view flatten unflatten unsqueeze squeeze view_as reshape_as expand expand_as".split(), "reshape"),
    **dict.fromkeys(("transpose", "permute", "t"), "transpose"),
    **dict.fromkeys(("matmul", "bmm", "scaled_dot_product_attention"), "broadcast"),
    **dict.fromkeys(("softmax", "log_softmax", "select", "slice", "narrow", *_CHUNKS), "along"),
    "linear": "row", "getitem": "getitem", "cat": "cat",
}


def _shape(node: Any) -> tuple[int, ...]:
    """The shape of the one tensor ``node`` makes (its annotation); ``()`` for anything else."""
    shapes = node_info(node).output_shapes if isinstance(node, fx.Node) else ()
    return tuple(shapes[0]) if len(shapes) == 1 else ()


def _arg(node: fx.Node, at: int, name: str = "", default: Any = None) -> Any:
    return node.args[at] if len(node.args) > at else node.kwargs.get(name, default)


def _reshape_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> int | None:
    """Where a reshape ``src`` → ``dst`` puts dimension ``dim``: the first (non-1) dimension of ``dst``
    with as many elements before it (split into equal parts, both then select the same contiguous
    ranges of each outer row), else ``None``."""
    outer = math.prod(src[:dim])
    return next((e for e in range(len(dst)) if dst[e] != 1 and math.prod(dst[:e]) == outer), None)


_SAY = {"heads": "the {} heads of {}", "features": "the {} output features of {}", "vocab": "the {}-row vocabulary of {}"}


def _divisors(found: list[tuple[str, int, str]], config: Any) -> tuple[tuple[str, int], ...]:
    """Each (kind, count, path) once, named by the config's integer attribute of that count and kind
    (``num_key_value_heads``, ``intermediate_size``, ``vocab_size``), else described by the module."""
    values = config.to_dict() if hasattr(config, "to_dict") else vars(config) if config is not None else {}
    ints = {k: v for k, v in values.items() if type(v) is int}
    out: dict[str, int] = {}
    for kind, count, path in found:
        fits = [k for k, v in ints.items() if v == count and _kind(k) == kind]  # the config's first
        said = _SAY[kind].format(count, path or "the root")
        if fits or not any(name.startswith(said.split(" of ")[0] + " of ") for name in out):
            out.setdefault(fits[0] if fits else said, count)
    return tuple(out.items())


def _kind(attr: str) -> str:
    """What a config attribute counts, by its name: ``heads``, ``vocab``, ``features`` or nothing."""
    if "vocab" in attr or "head" in attr:
        return "vocab" if "vocab" in attr else "" if "dim" in attr or "size" in attr else "heads"
    return "features" if any(w in attr for w in ("size", "dim", "inner", "embd", "model")) and "max" not in attr else ""
