"""Recompute regions: activation checkpointing of a plan's blocks inside codegen's stages.

Within a stage, each contiguous run of a recomputed block's nodes (``recompute``, the plan's blocks
by module path) becomes one *region*, a sub-``GraphModule`` whose placeholders are the values the
run reads from outside it and whose outputs are the values read after it. The stage calls it as
``torch.utils.checkpoint.checkpoint(self.recompute_h_1, *inputs, use_reentrant=False)`` — the
backward reruns it, with the forward's RNG state, instead of keeping its activations — and names
the results as the nodes they are; a plan that recomputes *selectively* calls
``recompute_selectively(self.recompute_h_1, *inputs)`` instead, which keeps the region's matmul and
attention outputs (:mod:`autosplit.passes.selective`). A region holds no state: its code reads its stage's modules,
parameters and buffers. A block whose rerun would differ or change state again (in-place writes
into what it reads, running statistics of batch norm in training) is refused.
A block that keeps some micro-batches (``partial``: :class:`~autosplit.plans.PartialRecompute`) is
called as ``recompute_unless_kept(self.recompute_h_1, *inputs, keep=1, window=2)``: the forward of a
micro-batch that keeps its activations calls the region plainly, the others under the checkpoint.
The micro-batch is the one the pipeline stage runs (:func:`micro_batch`); a forward outside one
recomputes.

Both of codegen's forms use it (:func:`~autosplit.passes.codegen.generate`,
:func:`~autosplit.passes.chain.generate_chain`): :meth:`Regions.copy_nodes` while a stage's graph
is built, :func:`attach_regions` once the stage module exists.

Usage::

    regions = Regions(captured, nodes, recompute, partial)
    pending = regions.copy_nodes(graph, members, env)
    stage = fx.GraphModule(root, graph)
    attach_regions(stage, pending, captured.gm)
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import difflib
import itertools
import logging
import operator
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint

from autosplit import debug
from autosplit.compat import NormBase, OpOverload
from autosplit.compat import copy_attr as _copy_attr  # fx's own copy of an attribute into a GraphModule, containers and all
from autosplit.errors import CodegenError, advice
from autosplit.passes.capture import Captured
from autosplit.passes.selective import keep_matmuls, refuse_random_attention
from autosplit.plans import PartialRecompute

__all__ = ["REGION_BLOCK", "Regions", "aliases", "attach_regions", "micro_batch", "recompute_selectively", "recompute_unless_kept",
           "written_inputs"]

REGION_BLOCK = "autosplit_region"
"""``node.meta`` key: the block (module path) whose region a stage's node calls or names — the region's
``get_attr``, its ``checkpoint`` call and their ``getitem`` s (:mod:`autosplit.passes.outline` reads it)."""

log = logging.getLogger(__name__)

_MICRO_BATCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("autosplit_micro_batch", default=None)


@contextlib.contextmanager
def micro_batch(index: int) -> Iterator[None]:
    """Run a stage's forward as micro-batch ``index`` of its step (what :func:`recompute_unless_kept` reads)."""
    token = _MICRO_BATCH.set(index)
    try:
        yield
    finally:
        _MICRO_BATCH.reset(token)


def recompute_unless_kept(region: torch.nn.Module, *inputs: Any, keep: int, window: int, selective: bool = False) -> Any:
    """``region(*inputs)``, kept for the backward if this forward's micro-batch keeps its activations
    (:meth:`PartialRecompute.recomputes`), else under ``torch.utils.checkpoint`` (a forward outside a
    pipeline stage, which sets no micro-batch, recomputes: the plan counted no more), ``selective``:
    keeping its matmuls' outputs (:func:`~autosplit.passes.selective.keep_matmuls`)."""
    index = _MICRO_BATCH.get()
    if index is not None and not PartialRecompute("", keep, window).recomputes(index):
        return region(*inputs)
    if selective:
        return recompute_selectively(region, *inputs)
    return torch.utils.checkpoint.checkpoint(region, *inputs, use_reentrant=False)


def recompute_selectively(region: torch.nn.Module, *inputs: Any) -> Any:
    """``region(*inputs)`` under ``torch.utils.checkpoint``, keeping its matmuls' and attention's outputs
    for the backward and recomputing the rest (:func:`~autosplit.passes.selective.keep_matmuls`)."""
    return torch.utils.checkpoint.checkpoint(region, *inputs, use_reentrant=False, context_fn=keep_matmuls)



_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
    operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
})
"""Python's in-place operators: each writes its first argument."""

_VIEWS = frozenset({
    "getitem", "getattr", "view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "expand", "expand_as",
    "narrow", "select", "squeeze", "unsqueeze", "flatten", "unflatten", "unfold", "as_strided", "diagonal", "detach",
    "split", "split_with_sizes", "chunk", "unbind", "tensor_split", "movedim", "moveaxis", "swapaxes", "swapdims",
    "contiguous", "to", "type", "type_as", "float", "double", "half", "bfloat16", "real", "imag", "view_as_real",
    "view_as_complex",
})
"""Ops that may return their first argument's memory (a view of it, or the tensor itself)."""


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


def _inplace(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``node`` writes its first argument and returns it, by its code: ``x += y``, a method or function
    named ``…_`` (torch's naming), ``inplace=True``, a module with ``inplace`` set."""
    name = _op_name(node)
    python_operator = node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator")
    return (
        node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True
        # torch's trailing underscore, not Python's operator.and_ / or_ / not_ (``a & b`` writes nothing)
        or (name.endswith("_") and not name.startswith("_") and name != "requires_grad_" and not python_operator)
        or (node.op == "call_module" and getattr(gm.get_submodule(str(node.target)), "inplace", False) is True)
    )


def written_inputs(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The input nodes ``node`` writes in place: as the annotate pass measured them (version
    counters), else read from the code, conservatively (:func:`_inplace`, an ATen op whose schema
    writes, batch norm's running statistics in training)."""
    mutates = getattr(node.meta.get("autosplit"), "mutates", None)
    if mutates is not None:
        return [u for u in node.all_input_nodes if u.name in mutates]
    if isinstance(node.target, OpOverload):
        written: list[fx.Node] = []
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                fx.node.map_arg(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name), written.append)
        return written
    if node.target is torch.nn.functional.batch_norm:
        bound = {**dict(zip(("input", "running_mean", "running_var", "weight", "bias", "training"), node.args)), **node.kwargs}
        stats = (bound.get("running_mean"), bound.get("running_var")) if bound.get("training") else ()
        return [v for v in stats if isinstance(v, fx.Node)]
    first = node.args[0] if node.args else None
    return [first] if isinstance(first, fx.Node) and _inplace(gm, node) else []


def aliases(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """``node`` and the values whose memory it may be, followed up through views and in-place ops
    (which alias their first argument): what a write into ``node`` writes."""
    chain = [node]
    while True:
        n = chain[-1]
        if isinstance(n.target, OpOverload):
            aliasing = any(r.alias_info is not None for r in n.target._schema.returns)
        else:
            aliasing = _op_name(n) in _VIEWS or _inplace(gm, n)
        first = n.args[0] if aliasing and n.args else None
        if not isinstance(first, fx.Node) or first in chain:
            return chain
        chain.append(first)


@dataclass
class _Pending:
    """A region made while its stage's graph was built; attached once the stage module exists."""

    block: str
    graph: fx.Graph
    call: fx.Node
    """The stage's ``checkpoint`` call, whose first argument becomes the region."""


class Regions:
    """The plan's recomputed blocks over a captured graph: the block each node belongs to (the
    outermost of ``blocks`` holding its module path), and each stage's runs of a block's nodes
    made into regions (:meth:`copy_nodes`)."""

    def __init__(
        self, captured: Captured, nodes: Sequence[fx.Node], blocks: Collection[str], partial: Sequence[PartialRecompute] = (),
        selective: bool = False,
    ):
        self.gm = captured.gm
        self.partial = {p.block: p for p in partial}
        self.selective = selective
        wanted = set(blocks)
        self.block_of: dict[fx.Node, str] = {}
        self.writes: list[tuple[fx.Node, fx.Node]] = []
        held: set[str] = set()  # every module path that holds a node: the blocks one can name
        for n in nodes if wanted else ():
            path = captured.module_paths.get(n.name, "")
            parts = path.split(".") if path else []
            prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            held.update(prefixes)
            block = next((p for p in prefixes if p in wanted), None)
            if block is not None:
                self.block_of[n] = block
        unknown = [b for b in dict.fromkeys(blocks) if b not in held]
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(held), n=5, cutoff=0.0)
            raise CodegenError(advice(
                f"recompute names {unknown[0]!r}, the module path of no node of the graph"
                + (f" ({len(unknown)} such blocks: {unknown[:5]})" if len(unknown) > 1 else ""),
                "a block is a module (by qualified name) whose forward the model calls; a module it never calls, "
                "or a misspelt name, holds no node",
                f"name blocks of this graph, such as {near}",
            ))
        if selective:
            refuse_random_attention(self.gm, self.block_of)
        self.order = {n: i for i, n in enumerate(self.gm.graph.nodes)} if self.block_of else {}
        if self.block_of:  # (node, what it writes in place), for _check
            self.writes = [(n, w) for n in nodes for w in written_inputs(self.gm, n)]

    def copy_nodes(self, graph: fx.Graph, members: Sequence[fx.Node], env: dict[fx.Node, Any]) -> list[_Pending]:
        """Copy ``members`` (a stage's nodes, in order) into ``graph``; each maximal run of one
        recomputed block's nodes becomes ``checkpoint(region, *inputs, use_reentrant=False)`` and a
        ``getitem`` per value read outside the run, named as its node. A run of attribute reads
        alone, or whose values nothing outside it reads, is copied as it is."""
        pending = []
        for block, group in itertools.groupby(members, key=self.block_of.get):
            run = list(group)
            inside = set(run)
            outputs = [n for n in run if any(u not in inside for u in n.users)]
            if block is None or not outputs or all(n.op == "get_attr" for n in run):
                for n in run:
                    env[n] = graph.node_copy(n, env.__getitem__)
                continue
            inputs = list(dict.fromkeys(u for n in run for u in n.all_input_nodes if u not in inside))
            self._check(block, run, inputs)
            sub = fx.Graph()
            local: dict[fx.Node, fx.Node] = {}
            for u in inputs:
                local[u] = sub.placeholder(u.name)
                local[u].meta = dict(u.meta)
            for n in run:
                local[n] = sub.node_copy(n, local.__getitem__)
            sub.output(tuple(local[n] for n in outputs))
            sub.lint()
            args = (None, *(env[u] for u in inputs))  # the region itself once the stage exists (attach_regions)
            target, kwargs = self._call(block)
            call = graph.create_node("call_function", target, args, kwargs, name=f"checkpoint_{block}")
            call.meta[REGION_BLOCK] = block
            for i, n in enumerate(outputs):
                env[n] = graph.create_node("call_function", operator.getitem, (call, i), name=n.name)
                env[n].meta[REGION_BLOCK] = block
            pending.append(_Pending(block, sub, call))
        return pending

    def _call(self, block: str) -> tuple[Callable[..., Any], dict[str, Any]]:
        """The function a stage calls ``block``'s region with, and its keyword arguments."""
        some = self.partial.get(block)
        if some is not None:
            return recompute_unless_kept, dict(keep=some.keep, window=some.window, **({"selective": True} if self.selective else {}))
        return (recompute_selectively, {}) if self.selective else (torch.utils.checkpoint.checkpoint, dict(use_reentrant=False))

    def _check(self, block: str, run: Sequence[fx.Node], inputs: Sequence[fx.Node]) -> None:
        """Refuse a region whose rerun in the backward would not compute what its forward did, or would
        change state again: one that writes in place into a value it reads from outside or into a
        parameter or buffer, whose inputs a later node writes, or that holds a module updating
        running statistics in training."""
        leave_out = f"leave {block!r} out of recompute (blocks inside it that do not may stay)"
        for n in run:
            if n.op != "call_module":
                continue
            for name, m in self.gm.get_submodule(str(n.target)).named_modules(prefix=str(n.target)):
                if isinstance(m, NormBase) and m.track_running_stats and m.training:
                    raise CodegenError(advice(
                        f"block {block!r} cannot be recomputed: it holds {name} ({type(m).__name__}), whose running "
                        "statistics update in training",
                        "recomputing the block in the backward would update them a second time", leave_out,
                    ))
        inside = set(run)
        read = {a for u in inputs for a in aliases(self.gm, u)}
        for n, w in self.writes:
            aliases_of_w = aliases(self.gm, w)
            if n in inside:
                hit = next((a for a in aliases_of_w if a not in inside or a.op == "get_attr"), None)
                if hit is not None:
                    what = "a parameter or buffer" if hit.op == "get_attr" else "a value the block reads from outside it"
                    raise CodegenError(advice(
                        f"block {block!r} cannot be recomputed: {n.name} writes in place into {hit.name}, {what}",
                        "recomputing the block in the backward would write it a second time, and read what it wrote", leave_out,
                    ))
            elif self.order[n] > self.order[run[0]] and read.intersection(aliases_of_w):
                raise CodegenError(advice(
                    f"block {block!r} cannot be recomputed: {n.name}, after it, writes in place into {w.name}, which the block reads",
                    "recomputing the block in the backward would read the written value", leave_out,
                ))


def attach_regions(stage: fx.GraphModule, pending: Sequence[_Pending], gm: fx.GraphModule) -> None:
    """Make each pending region a :class:`_Region` of ``stage``, named after its block
    (``recompute_h_1``), and its ``checkpoint`` call read it; the stage gets what the region reads
    of ``gm`` (the same objects, under the same names), as it does what its own nodes read."""
    for p in pending:
        for n in p.graph.nodes:
            if n.op in ("get_attr", "call_module"):
                try:
                    operator.attrgetter(str(n.target))(stage)
                except AttributeError:
                    _copy_attr(gm, stage, str(n.target))
        name = base = "recompute_" + re.sub(r"\W", "_", p.block)
        i = 0
        while hasattr(stage, name):
            i += 1
            name = f"{base}_{i}"
        region = _Region(p.graph, stage, name)
        stage.add_module(name, region)
        with stage.graph.inserting_before(p.call):
            read = stage.graph.get_attr(name)
            read.meta[REGION_BLOCK] = p.block
            p.call.update_arg(0, read)
        log.debug("%s: block %s recomputed in the backward as %s (%d values in, %d out)", type(stage).__name__, p.block, name,
                  len(p.call.args) - 1, len(p.call.users))
        if debug.stage_code.isEnabledFor(logging.DEBUG):
            debug.stage_code.debug("%s.%s:\n%s", type(stage).__name__, name, region.code.strip())
    if pending:
        stage.recompile()


class _Region(fx.GraphModule):
    """A recomputed block's nodes in a stage, as the module its stage calls under
    ``torch.utils.checkpoint.checkpoint``. It holds no state of its own: the modules, parameters
    and buffers its code reads (``self.h…``) are looked up on its stage at each call, so nothing is
    registered twice (the stage's ``state_dict`` and parameter names stay the model's) and a stage
    whose tensors are replaced (materialised from meta, moved) is seen as it is."""

    def __init__(self, graph: fx.Graph, owner: fx.GraphModule | None, class_name: str):
        super().__init__(torch.nn.Module(), fx.Graph(), class_name=class_name)
        self.__dict__["_shared"] = frozenset(str(n.target).split(".")[0] for n in graph.nodes if n.op in ("get_attr", "call_module"))
        self.__dict__["_owner"] = owner  # not a submodule: the stage holds the region, never the reverse
        self.graph = graph

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("_shared", ()):
            return getattr(self.__dict__["_owner"], name)
        return super().__getattr__(name)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Region:
        copied = _Region(copy.deepcopy(self.graph, memo), None, type(self).__name__)
        memo[id(self)] = copied
        copied.__dict__["_owner"] = copy.deepcopy(self.__dict__["_owner"], memo)
        return copied
