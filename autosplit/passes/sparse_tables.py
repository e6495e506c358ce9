"""Sparse tables: embedding tables whose gradient is non-zero only in the rows a batch looks up.

A table read only by embedding lookups (``nn.Embedding``, ``F.embedding``, ``aten.embedding``;
not one tied to an output layer) has a gradient whose non-zero part is the rows looked up, which
a sparse all-gather moves instead of the dense table; one every lookup reads with
``sparse=True`` gets a sparse gradient tensor from torch, which FSDP2's collectives do not take.
:func:`row_sparse` writes both sizes into the annotate pass's :class:`~autosplit.passes.annotations.NodeInfo` records;
:func:`sparse_gradient_tables` finds the tables a replicated stage reduces apart.

Usage::

    row_sparse(captured.gm)                    # after annotate: NodeInfo.row_grad_bytes, ...
    tables = sparse_gradient_tables(stage)     # the runtime: reduce these apart
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch
import torch.fx as fx

__all__ = ["row_sparse", "sparse_gradient_tables"]

aten = torch.ops.aten


_LOOKUPS = {torch.nn.functional.embedding: (1, 6), torch.embedding: (0, 4), aten.embedding.default: (0, 4)}
"""Embedding functions → the positions of the table and of the ``sparse`` flag among their arguments."""


def _sparse_lookup(node: fx.Node, at: int) -> bool:
    """Whether the lookup ``node`` asks for a sparse gradient (``sparse=True``, positional or by name)."""
    return bool(node.args[at] if len(node.args) > at else node.kwargs.get("sparse", False))


def _table_reads(gm: fx.GraphModule) -> Iterator[tuple[torch.Tensor, fx.Node | None, bool]]:
    """Every read of a parameter in ``gm``'s graph: (parameter, the lookup node reading it as an
    embedding table or ``None`` for any other reader, whether that lookup asks for a sparse
    gradient). A parameter's readers are the ``call_module`` nodes of modules holding it and the
    users of ``get_attr`` nodes fetching it."""
    for n in gm.graph.nodes:
        if n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            for p in mod.parameters():
                lookup = isinstance(mod, torch.nn.Embedding) and p is mod.weight
                yield p, n if lookup else None, bool(lookup and mod.sparse)
        elif n.op == "get_attr":
            try:
                p = gm.get_parameter(str(n.target))
            except AttributeError:
                continue
            for user in n.users:
                at = _LOOKUPS.get(user.target)
                if at is not None and len(user.args) > at[0] and user.args[at[0]] is n:
                    yield p, user, _sparse_lookup(user, at[1])
                else:
                    yield p, None, False


def sparse_gradient_tables(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of the graph modules in ``module`` whose gradient torch makes sparse: read
    only by embedding lookups that pass ``sparse=True`` (what a replicated stage must reduce apart:
    FSDP2's collectives take dense gradients only)."""
    sparse: dict[int, torch.nn.Parameter] = {}
    dense: set[int] = set()
    for gm in module.modules():
        if isinstance(gm, fx.GraphModule):
            for p, lookup, is_sparse in _table_reads(gm):
                if lookup is not None and is_sparse and isinstance(p, torch.nn.Parameter):
                    sparse[id(p)] = p
                else:
                    dense.add(id(p))
    return [p for key, p in sparse.items() if key not in dense]


def row_sparse(gm: fx.GraphModule) -> None:
    """Set :attr:`~autosplit.passes.annotations.NodeInfo.row_grad_bytes` on the owners of tables that every reader only looks up
    (:func:`_table_reads`; any other reader, a tied output layer, makes the gradient dense and the
    table is left out), and :attr:`~autosplit.passes.annotations.NodeInfo.sparse_grad_bytes` on those of
    :func:`sparse_gradient_tables`. Each lookup adds the rows its output holds (output elements / row width)."""
    rows: dict[int, int] = {}  # id(table) → rows looked up
    dense: set[int] = set()
    for p, lookup, _ in _table_reads(gm):
        if lookup is None or p.dim() != 2:
            dense.add(id(p))
        else:
            rows[id(p)] = rows.get(id(p), 0) + math.prod(lookup.meta["autosplit"].output_shapes[0]) // p.shape[-1]
    sparse = {key: count for key, count in rows.items() if key not in dense}
    if not sparse:
        return
    tables: dict[str, torch.Tensor] = {name: p for name, p in gm.named_parameters(remove_duplicate=False) if id(p) in sparse}
    sparse_gradient = {id(p) for p in sparse_gradient_tables(gm)}
    for n in gm.graph.nodes:
        info = n.meta.get("autosplit")
        owned = [tables[name] for name in (info.params if info else ()) if name in tables]
        if owned:
            element = info.param_bytes / info.param_count  # as the node's state is counted (bf16: 2)
            total = sum(min(sparse[id(t)], t.shape[0]) * (round(t.shape[-1] * element) + 8) for t in owned)
            made_sparse = [t for t in owned if id(t) in sparse_gradient]
            n.meta["autosplit"] = dataclasses.replace(
                info, row_grad_bytes=total, sparse_table_bytes=sum(round(t.numel() * element) for t in made_sparse),
                sparse_grad_bytes=sum(sparse[id(t)] * (round(t.shape[-1] * element) + 8) for t in made_sparse),
            )
