"""Values that depend on no input: made again by each stage that reads them, never sent.

A node is *input-free* when its value follows from constants alone, through ops that are pure
and draw no random numbers, and no op writes it in place (a stage after the write must read the
written value): no graph input, parameter, buffer or module reaches it. The causal
mask transformers builds from ``arange`` and the position ids are; the rotary tables are not
(they read the ``inv_freq`` buffer). Such a value is the same in every micro-batch and on every
rank, and a stage makes it for far less than receiving it costs: a Llama's boolean mask at 8,192
tokens is 64 MiB a micro-batch, relayed by every stage between its maker and its last reader,
and torch's ``PipelineStage`` keeps a buffer of it for every micro-batch of the step. So no stage
sends one: each stage computes the input-free values its own nodes read (:func:`copy_closure`),
in :mod:`~autosplit.passes.codegen` and :mod:`~autosplit.passes.chain` alike, and the cost model
charges a crossing the receiving stage's computing and its copy instead of the transfer and the
buffers (:mod:`autosplit.solver.build`).

A graph from ``torch.export`` names ATen overloads, whose schemas say whether they write and
whose tags whether they are random; a traced graph names torch functions and tensor methods,
judged by the ATen ops of the same name (any random overload, or a name that writes in place,
rules one out; a name ATen lacks is not input-free).

Usage::

    free = input_free(gm)                  # node names
    copy_closure(graph, read, free, env)   # before the stage's own nodes
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch
import torch.fx as fx

from autosplit.compat import OpOverload, pytree
from autosplit.passes.recompute_regions import aliases, written_inputs

__all__ = ["copy_closure", "input_free"]

_WRITES = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor", "ilshift",
                     "irshift", "imatmul", "setitem", "delitem"})
"""Python's operators that write their first argument."""


def input_free(gm: fx.GraphModule) -> frozenset[str]:
    """The names of ``gm``'s input-free nodes (the module docstring), those a tensor comes out of.
    A value some op writes in place, directly or through a view, is not: a stage after the write
    reads the written value, which only the writer's stage has."""
    written = {a for n in gm.graph.nodes if n.op.startswith("call") for u in written_inputs(gm, n) for a in aliases(gm, u)}
    free: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method") and n not in written and all(u in free for u in n.all_input_nodes) and _pure(n):
            free.add(n)
    return frozenset(n.name for n in free if _holds_tensor(n))


def copy_closure(graph: fx.Graph, read: Iterable[fx.Node], free: Collection[str], env: dict[fx.Node, Any]) -> None:
    """Copy into ``graph`` every input-free node of ``read`` and what it is made from, in graph
    order, unless ``env`` holds it already."""
    made: set[fx.Node] = set()
    stack = [n for n in read if n.name in free]
    while stack:
        n = stack.pop()
        if n not in made and n not in env:
            made.add(n)
            stack.extend(n.all_input_nodes)
    for n in next(iter(made)).graph.nodes if made else ():  # in graph order: what a node reads is made first
        if n in made:
            env[n] = graph.node_copy(n, env.__getitem__)


def _pure(n: fx.Node) -> bool:
    """``n`` writes nothing, draws no random number and takes no ``out=``."""
    if "out" in n.kwargs:
        return False
    if isinstance(n.target, OpOverload):
        return not n.target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in n.target.tags
    name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")
    if n.op == "call_function" and getattr(n.target, "__module__", None) in ("_operator", "operator"):
        return name not in _WRITES
    if n.target is getattr:  # a tensor's ``.shape``, ``.device``, ``.dtype`` as a traced graph reads them
        return True
    packet = getattr(torch.ops.aten, name, None) if name and not name.endswith("_") else None
    if packet is None or n.kwargs.get("inplace") is True:
        return False
    return not any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


def _holds_tensor(n: fx.Node) -> bool:
    """Whether ``n``'s value has a tensor in it, as annotated or traced (a Python value crosses as a
    constant already; a value of no record is left to cross as it does)."""
    info = n.meta.get("autosplit")
    if info is not None:
        return info.output_bytes > 0
    value = n.meta.get("val", n.meta.get("tensor_meta"))
    return any(isinstance(v, torch.Tensor) or hasattr(v, "shape") for v in pytree.tree_leaves(value))
