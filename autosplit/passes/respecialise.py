"""An exported graph at another batch size, from two real captures, without a third export.

``torch.export`` bakes the batch into the graph's integer arguments (``view(x, [b, s, h, d])``,
``expand``, ``arange``), so a data-parallel copy's share of the batch is a new capture — seconds to
minutes for a large model, once per share the mesh search costs. The graph is the same at every batch
(the capture refuses one that is not: :func:`~autosplit.passes.capture.fingerprint`); only those
integers move, and in the models people train they move affinely with the rows: ``b``, ``b · s``,
``b · n_heads``. Two real captures at ``r₁ ≠ r₂`` rows fix each moving integer's line
``c(r) = α · r + β``; :func:`respecialised` writes the graph at ``r`` rows with ``α · r + β`` in
its place.

It is for *planning* only — the costs of a share — and refuses (returns None, the caller captures for
real) where the two graphs differ in anything but integers, where a moving integer's line has no
integral slope or gives a non-positive value, where a constant tensor the graph reads changes shape
with the batch, or at one row (``torch.export`` specialises a size-1 dimension, so a row's graph may
not be the same). A share run by the runtime is always captured for real, and refused unless it is
the same graph (:meth:`~autosplit.compiler.trace.Traced.at_micro_batch`), so a planning graph is never
run.

Usage::

    graph = respecialised(global_capture, 512, second_capture, 256, rows=16)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from autosplit.compat import graph_codegen, set_graph_codegen
from autosplit.passes.capture import Captured

__all__ = ["respecialised"]


class _Refused(Exception):
    """A value that does not move affinely with the batch: capture for real."""


def respecialised(a: Captured, rows_a: int, b: Captured, rows_b: int, rows: int) -> Captured | None:
    """``a``'s graph at ``rows`` rows, its integer arguments moved along the lines ``a`` (at ``rows_a``)
    and ``b`` (at ``rows_b``) draw; None where that is not sound (the module docstring)."""
    if rows < 2 or rows_a == rows_b or min(rows_a, rows_b) < 2:
        return None
    nodes_a, nodes_b = list(a.gm.graph.nodes), list(b.gm.graph.nodes)
    if [(n.op, n.name, n.target) for n in nodes_a] != [(n.op, n.name, n.target) for n in nodes_b]:
        return None
    if any(_attr_shape(a.gm, n) != _attr_shape(b.gm, n) for n in nodes_a if n.op == "get_attr"):
        return None
    graph = fx.Graph()
    set_graph_codegen(graph, graph_codegen(a.gm.graph))  # an exported graph's inputs and outputs are pytrees
    remap: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(a.gm.graph, remap))
    line = _Line(rows_a, rows_b, rows)
    try:
        for na, nb in zip(nodes_a, nodes_b):
            if na.op == "output":  # its values are nodes: nothing to move
                continue
            copy = remap[na]
            copy.args = line.moved(na.args, nb.args, copy.args)
            copy.kwargs = line.moved(na.kwargs, nb.kwargs, copy.kwargs)
    except _Refused:
        return None
    gm = fx.GraphModule(a.gm, graph)
    if [n.name for n in gm.graph.nodes] != [n.name for n in nodes_a]:
        return None
    if gm.graph.find_nodes(op="call_module", target=_GUARDS):
        gm.add_submodule(_GUARDS, _Unguarded())  # its checks are of a's shapes, which this graph leaves on purpose
    return dataclasses.replace(a, gm=gm)


_GUARDS = "_guards_fn"
"""The module torch.export calls first to check the example's shapes (its ``Guard failed: … == 16``)."""


class _Unguarded(torch.nn.Module):
    """A respecialised graph's stand-in for torch.export's shape guards: planning reads its shapes,
    and a graph that runs is a real capture with its own guards."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None


def _attr_shape(gm: fx.GraphModule, node: fx.Node) -> Any:
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


@dataclasses.dataclass(frozen=True)
class _Line:
    """Moves integers seen at ``rows_a`` and ``rows_b`` rows to ``rows``."""

    rows_a: int
    rows_b: int
    rows: int

    def moved(self, va: Any, vb: Any, copy: Any) -> Any:
        """``copy`` (``va``'s structure, its nodes remapped) with each integer that differs between
        ``va`` and ``vb`` moved to ``rows``; raises :class:`_Refused` where the two differ otherwise."""
        if isinstance(va, (list, tuple)):
            if not isinstance(vb, type(va)) or len(va) != len(vb):
                raise _Refused
            return type(copy)(self.moved(x, y, c) for x, y, c in zip(va, vb, copy))
        if isinstance(va, dict):
            if not isinstance(vb, dict) or va.keys() != vb.keys():
                raise _Refused
            return {k: self.moved(va[k], vb[k], copy[k]) for k in va}
        if isinstance(va, slice):
            parts = zip((va.start, va.stop, va.step), (vb.start, vb.stop, vb.step), (copy.start, copy.stop, copy.step))
            return slice(*(self.moved(x, y, c) for x, y, c in parts))
        if isinstance(va, fx.Node):
            if not isinstance(vb, fx.Node) or va.name != vb.name:
                raise _Refused
            return copy
        if type(va) is int and type(vb) is int and va != vb:
            return self._point(va, vb)
        if type(va) is not type(vb) or (va != vb and not (va != va and vb != vb)):  # NaN equals NaN here
            raise _Refused
        return copy

    def _point(self, va: int, vb: int) -> int:
        slope, rest = divmod(vb - va, self.rows_b - self.rows_a)
        value = va + slope * (self.rows - self.rows_a)
        if rest or value <= 0 or va <= 0 or vb <= 0:
            raise _Refused
        return value
