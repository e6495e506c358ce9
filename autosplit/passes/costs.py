"""Estimate: per node × device forward/backward time, training memory, and placement rules.

Time (DESIGN §4.1) is an analytic roofline on a :class:`DeviceSpec`, or measured
(:mod:`autosplit.passes.time_model`); memory (DESIGN §4.2) per node is model state
(parameters, gradients, optimizer state, buffers) and the activations autograd saves
(:mod:`autosplit.passes.memory_model`). This module assembles them into a
:class:`~autosplit.costtable.CostTable`.

The table also carries the placement rules codegen relies on (DESIGN §4.5):

- *colocate*: a module called twice shares its parameters, so its calls stay together; a
  parameter read through ``get_attr`` lives with its first reader (later readers receive
  it as a transfer and autograd sums its gradient); an in-place op stays with the node
  whose tensor it writes, so the write happens where the tensor lives.
- *order edges*: readers of a tensor that an in-place op writes keep their order around
  the write, though fx records no data edge between them.

Measured costs (DESIGN §4.1): for a device with a :class:`~autosplit.passes.profile.Profile`,
the node's measured forward/backward seconds replace the roofline, and its measured saved
bytes and transient peak replace the annotated ones. Profiles hold one micro-batch; the
table holds the whole batch (× micro-batches), like the analytic costs.

The loss (:mod:`autosplit.passes.loss`), when the planner is given one, is charged to the node
that makes the model's output last: the stage that returns the output runs it per micro-batch.

Overrides (:func:`with_overrides`): ``{"blocks.3": {"fwd": 2e-3, "bwd": 4e-3}, "linear_1": {"saved_bytes": 0}}``
sets a node's cost, or a module's total, on every device, whatever the table's source.

Usage::

    table = estimate(gm, devices, optimizer="adam")
    table = estimate(gm, devices, profiles=[prof, None], micro_batches=4)
"""


from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from autosplit.costtable import OPTIMIZER_STATE_BYTES, OVERRIDE_KEYS, SPARSE_REFUSED, CostTable
from autosplit.devices import DeviceSpec
from autosplit.errors import CostModelError, advice
from autosplit.passes.annotations import NodeInfo, node_info
from autosplit.passes.ep_costs import gemm_terms
from autosplit.passes.experts import grouped_gemms
from autosplit.passes.float8 import Float8Choice, choose_float8
from autosplit.passes.fusion import UNFUSED, Fusion, fused
from autosplit.passes.input_free import input_free
from autosplit.passes.memory_model import activation_bytes, describe_blocks, saved_bytes, state_bytes
from autosplit.passes.outline import outlinable_blocks, unit_targets
from autosplit.passes.profile import Profile
from autosplit.passes.selective import keeps_output, refuse_random_attention
from autosplit.passes.time_model import node_roofline, node_times, optimizer_times, row_sharer, split_costs, wgrad_shares
from autosplit.plans import PartialRecompute

__all__ = ["LossCost", "estimate", "with_overrides"]


@dataclasses.dataclass(frozen=True)
class LossCost:
    """One micro-batch's loss on every device (:mod:`autosplit.passes.loss`), charged by :func:`estimate`."""

    fwd: tuple[float, ...]
    """[device] forward seconds."""
    bwd: tuple[float, ...]
    saved_bytes: int
    """What autograd keeps from the loss's forward to its backward (the output it reads excluded)."""


def with_overrides(table: CostTable, overrides: Mapping[str, Mapping[str, float]]) -> CostTable:
    """``table`` with user costs: a node's own, or a module's total spread over its nodes.

    Times are seconds for the whole batch and apply on every device; a module's total is
    shared in proportion to its nodes' current costs (equally when those are all zero).
    """
    by_name = {name: i for i, name in enumerate(table.nodes)}
    fwd, bwd = [list(row) for row in table.fwd_time], [list(row) for row in table.bwd_time]
    saved, timed = list(table.saved_bytes), set()
    for key, cost in overrides.items():
        unknown = set(cost) - set(OVERRIDE_KEYS)
        if unknown:
            raise CostModelError(advice(
                f"option cost_overrides[{key!r}] has unknown fields {sorted(unknown)}",
                "an override sets only forward/backward seconds and saved bytes", f"use the fields {OVERRIDE_KEYS}",
            ))
        members = [by_name[key]] if key in by_name else [
            i for i, path in enumerate(table.module_paths) if path == key or path.startswith(key + ".")
        ]
        if not members:
            raise CostModelError(advice(
                f"option cost_overrides names {key!r}, which is neither a node nor a module of the graph",
                "a misspelt name, or a module the capture traced through",
                f"use a node name (like {list(table.nodes[:4])}) or a module path "
                f"(like {sorted({p for p in table.module_paths if p})[:4]})",
            ))

        def spread(total: float, current: list[float]) -> list[float]:
            whole = sum(current)
            return [total * (c / whole if whole > 0 else 1 / len(current)) for c in current]

        for field, rows in (("fwd", fwd), ("bwd", bwd)):
            if field in cost:
                timed.update(members)
                for d in range(len(table.devices)):
                    for i, t in zip(members, spread(cost[field], [rows[i][d] for i in members])):
                        rows[i][d] = t
        if "saved_bytes" in cost:
            for i, b in zip(members, spread(cost["saved_bytes"], [saved[i] for i in members])):
                saved[i] = round(b)
    return dataclasses.replace(
        table, fwd_time=tuple(map(tuple, fwd)), bwd_time=tuple(map(tuple, bwd)), saved_bytes=tuple(saved),
        expert_gemms=tuple(g for g in table.expert_gemms if g[0] not in timed),  # the user's times stand under ep too
    )


def _placement_rules(
    gm: fx.GraphModule, nodes: list[fx.Node], index: Mapping[fx.Node, int], infos: list[NodeInfo]
) -> tuple[tuple[tuple[int, ...], ...], set[tuple[int, int]]]:
    """(colocated groups, order edges) that codegen relies on (see the module docstring): calls of
    one module, a ``get_attr`` and its first reader, and an in-place op and the node it writes stay
    together; readers of a written tensor keep their order around the write."""
    from networkx.utils import UnionFind  # deferred: networkx loads when a graph is first annotated

    colocate = UnionFind(range(len(nodes)))
    by_name = {n.name: n for n in gm.graph.nodes}
    order_edges: set[tuple[int, int]] = set()
    first_call: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n.op == "call_module":
            j = first_call.setdefault(str(n.target), i)
            colocate.union(i, j)
        elif n.op == "get_attr":
            readers = [index[u] for u in n.users if u in index]
            if readers:
                colocate.union(i, min(readers))
        for written in (by_name[name] for name in infos[i].mutates):
            if written in index:
                colocate.union(i, index[written])
            for reader in written.users:
                if reader is not n and reader in index:
                    order_edges.add((index[reader], i) if index[reader] < i else (i, index[reader]))
    groups = tuple(sorted(tuple(sorted(g)) for g in colocate.to_sets() if len(g) > 1))
    return groups, order_edges


def _input_free(gm: fx.GraphModule, nodes: list[fx.Node]) -> tuple[bool, ...]:
    """[node] whether its value is input-free (:func:`~autosplit.passes.input_free.input_free`); empty: none is."""
    free = input_free(gm)
    return tuple(n.name in free for n in nodes) if free else ()


def _param_reads(gm: fx.GraphModule, nodes: list[fx.Node]) -> tuple[str, ...]:
    """Per node, the qualified name of the parameter a ``get_attr`` reads, or ``""`` (any other node,
    or a buffer or constant read)."""
    return tuple(
        str(n.target) if n.op == "get_attr" and isinstance(operator.attrgetter(str(n.target))(gm), torch.nn.Parameter)
        else ""
        for n in nodes
    )



def _state_parts(gm: fx.GraphModule, nodes: list[fx.Node], infos: list[NodeInfo]) -> dict[str, Any]:
    """The parts of each node's state a data-parallel layout treats apart (:func:`~autosplit.passes.sharding.laid_out`):
    the weight copy, the buffers, and whether its parameters are in an FSDP unit of their own when FSDP
    runs alone: a node of a block the runtime outlines (:func:`outlinable_blocks`, the predicate it
    uses: an exported graph's ``get_attr`` of the block's parameters among them), or one calling a
    module the graph calls that FSDP can shard alone (:func:`unit_targets`); each empty where no node has any."""
    units = set(unit_targets(gm))
    outlined = {n for members in outlinable_blocks(gm).values() for n in members}
    flags = tuple(n in outlined or (n.op == "call_module" and str(n.target) in units) for n in nodes)
    copies, buffers = tuple(i.weight_copy_bytes for i in infos), tuple(i.buffer_bytes for i in infos)
    return dict(weight_copy_bytes=copies if any(copies) else (), buffer_bytes=buffers if any(buffers) else (),
                unit_params=flags if any(flags) else ())


def _refuse_sparse(optimizer: str, nodes: list[fx.Node], infos: list[NodeInfo]) -> None:
    """A table looked up with ``sparse=True`` under an optimizer torch refuses sparse gradients for
    is a :class:`CostModelError`: the step the plan would be costed for cannot run."""
    sparse = [(n.name, info) for n, info in zip(nodes, infos) if info.sparse_table_bytes]
    if sparse and optimizer in SPARSE_REFUSED:
        name, info = sparse[0]
        raise CostModelError(advice(
            f"node {name!r} looks up a table of {info.sparse_table_bytes / 2**20:.1f} MiB with sparse=True "
            f"({len(sparse)} such node(s)), and optimizer={optimizer!r}",
            f"torch's {optimizer} refuses sparse gradients, so the step this plan would be costed for cannot run",
            "plan with optimizer='adagrad' or 'sgd' (they step sparse gradients row by row), or look the table up with sparse=False",
        ))


def _charge_loss(
    gm: fx.GraphModule, index: Mapping[fx.Node, int], loss: LossCost, micro_batches: int,
    fwd: list, bwd: list, wgrad_share: list[float], own_saved: list[int],
) -> None:
    """Charge every micro-batch's ``loss`` to the node that makes the model's output last (in place)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    makers = [index[u] for u in output.all_input_nodes if u in index]
    if makers:
        at = max(makers)
        fwd[at] = tuple(t + micro_batches * c for t, c in zip(fwd[at], loss.fwd))
        # the loss's backward is the gradient of the output: input-pass work, so the node's weight pass keeps its seconds
        weight = wgrad_share[at] * sum(bwd[at])
        bwd[at] = tuple(t + micro_batches * c for t, c in zip(bwd[at], loss.bwd))
        wgrad_share[at] = weight / sum(bwd[at]) if sum(bwd[at]) > 0 else wgrad_share[at]
        own_saved[at] += micro_batches * loss.saved_bytes


def _recompute_costs(
    gm: fx.GraphModule, nodes: list[fx.Node], infos: list[NodeInfo], own_saved: list[int], described: Mapping[str, tuple],
    recompute: Collection[str], partial: Sequence[PartialRecompute], micro_batches: int,
    transient: list[int], fwd: list, bwd: list, per_device: Callable[[tuple], tuple], keeps: frozenset[int],
) -> tuple[list[int], list[int], list[int], list, dict[int, float]]:
    """(saved, sent, transient, backward, node → the share of micro-batches whose forward its backward runs again)
    of the nodes when the blocks labelled ``recompute`` recompute
    (``partial``: those that keep some micro-batches): their members keep the checkpoint's inputs
    only (and those in ``keeps`` their outputs: selectively), their backward runs their forward
    again (but ``keeps``') and holds one micro-batch of their activations."""
    unknown = sorted(set(recompute) - set(described.get("blocks", ())))
    if unknown:
        raise CostModelError(advice(
            f"cannot cost recomputing {unknown}: not among the blocks described ({list(described.get('blocks', ()))[:4]})",
            "recompute names the labels of blocks passed in blocks=", "pass every recomputed block in blocks= too",
        ))
    chosen = [described["block_members"][described["blocks"].index(label)] for label in recompute]
    recomputed = {i: b for b, block in enumerate(chosen) for i in block}
    saved, sent = saved_bytes(gm, nodes, infos, own_saved, recomputed, keeps)
    again_share = dict.fromkeys(recomputed.keys() - keeps, 1.0)
    # At the stage's peak, p.keep of its p.window micro-batches hold what keeping the block holds: each
    # partly kept block adds its share of what keeping it alone adds to recomputing them all (each
    # against that same base: folding one block's share into the next's base would shrink it)
    base, base_sent = list(saved), list(sent)
    for p in partial:
        members = frozenset(described["block_members"][described["blocks"].index(p.block)])
        whole, whole_sent = saved_bytes(gm, nodes, infos, own_saved, {i: b for i, b in recomputed.items() if i not in members}, keeps)
        saved = [s + math.ceil((b - a) * p.keep / p.window) for s, a, b in zip(saved, base, whole)]
        sent = [s + math.ceil((b - a) * p.keep / p.window) for s, a, b in zip(sent, base_sent, whole_sent)]
        again_share.update(dict.fromkeys(members - keeps, p.recomputed(micro_batches) / micro_batches))
    again = max(described["block_activations"][described["blocks"].index(label)] for label in recompute)
    transient = [t + math.ceil(again / micro_batches) if i in recomputed else t for i, t in enumerate(transient)]
    bwd = [per_device(tuple(b + f * again_share[i] for b, f in zip(bwd[i], fwd[i]))) if i in again_share else bwd[i]
           for i in range(len(nodes))]
    return saved, sent, transient, bwd, again_share


def _check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise CostModelError(advice(
            f"unknown optimizer {optimizer!r}", "the memory model knows the state of these optimizers only",
            f"choose one of {sorted(OPTIMIZER_STATE_BYTES)}",
        ))


def estimate(
    gm: fx.GraphModule, devices: tuple[DeviceSpec, ...], *, optimizer: str = "adam", profiles: Sequence[Profile | None] | None = None,
    micro_batches: int = 1, blocks: Sequence[tuple[str, Collection[str]]] = (), recompute: Collection[str] = (),
    partial: Sequence[PartialRecompute] = (), selective: bool = False, loss: LossCost | None = None, float8: str | None = None,
    float8_exclude: Sequence[str] | None = None, fusion: Fusion = UNFUSED,
) -> CostTable:
    """Build the :class:`CostTable` of an annotated graph for ``devices``.

    ``profiles[d]`` (one micro-batch of ``micro_batches``) gives device ``d`` measured costs; ``None`` or a missing
    profile keeps the analytic ones. ``blocks`` (label, member node names) are what a plan may recompute; the costs
    of those labelled in ``recompute`` are the recomputing ones (:func:`_recompute_costs`; ``partial``: some
    micro-batches keep theirs; ``selective``: keeping their matmuls' and attention's outputs, :mod:`autosplit.passes.selective`).
    ``loss`` (one micro-batch's) is charged to the node that makes the model's output last, every micro-batch's.
    ``float8``: the recipe its linears compute in, or ``"auto"``, each linear decided by its cost, ``float8_exclude``
    kept in bf16 (:func:`~autosplit.passes.float8.choose_float8`); ``fusion``: the engine's fused kernels.
    """
    _check_optimizer(optimizer)
    profiles = list(profiles or [None] * len(devices))
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    index = {n: i for i, n in enumerate(nodes)}
    # Devices alike but for their node (island) are costed once: a node's time does not depend on where its device is.
    placed = [dataclasses.replace(d, island=None) if d.island is not None else d for d in devices]
    kinds = list(dict.fromkeys(placed))
    raw, gemms = [node_info(n) for n in nodes], grouped_gemms(nodes)
    low = None if float8 is None else choose_float8(gm, nodes, raw, kinds, float8, float8_exclude, node_roofline,
                                                    gemms if fusion.fp8_experts else ())
    infos = fused(nodes, raw, fusion, low.chosen if low else (), low.experts if low else ())
    _refuse_sparse(optimizer, nodes, infos)
    kind_of = [kinds.index(d) for d in placed]
    per_device = row_sharer(kind_of)
    fwd, bwd = node_times(nodes, infos, kinds, kind_of, profiles, micro_batches, per_device, low)
    own_saved, transient, step = activation_bytes(nodes, infos, profiles, micro_batches, optimizer)
    wgrad_share = list(wgrad_shares(nodes, infos, profiles))
    if loss is not None:
        _charge_loss(gm, index, loss, micro_batches, fwd, bwd, wgrad_share, own_saved)
    edges = sorted({(index[u], index[v]) for v in nodes for u in v.all_input_nodes if u in index})
    colocate, order_edges = _placement_rules(gm, nodes, index, infos)
    saved, sent = saved_bytes(gm, nodes, infos, own_saved)
    keeps = frozenset(i for i, n in enumerate(nodes) if keeps_output(gm, n)) if selective else frozenset()
    described = describe_blocks(gm, nodes, infos, own_saved, saved, blocks, micro_batches, keeps) if blocks else {}
    if selective:
        refuse_random_attention(gm, (nodes[i] for m in described.get("block_members", ()) for i in m))
    # before any block recomputes: a block's node's own peak
    block_transient = max((int(transient[i]) for m in described.get("block_members", ()) for i in m), default=0)
    again: dict[int, float] = {}
    if recompute:
        saved, sent, transient, bwd, again = _recompute_costs(
            gm, nodes, infos, own_saved, described, recompute, partial, micro_batches, transient, fwd, bwd, per_device, keeps,
        )
    state = [state_bytes(info, optimizer) for info in infos]
    return CostTable(
        devices=tuple(devices),
        nodes=tuple(n.name for n in nodes),
        module_paths=tuple(info.module_path for info in infos),
        fwd_time=tuple(fwd),
        bwd_time=tuple(bwd),
        state_bytes=tuple(state),
        saved_bytes=tuple(saved),
        output_bytes=tuple(info.output_bytes for info in infos), edges=tuple(edges),
        order_edges=tuple(sorted(order_edges - set(edges))), colocate=colocate,
        param_counts=tuple(info.param_count for info in infos),
        sent_bytes=tuple(sent),
        transient_bytes=tuple(int(t) for t in transient), step_bytes=tuple(step),
        optimizer_time=optimizer_times(infos, kinds, kind_of, profiles, optimizer, per_device),
        param_bytes=tuple(info.param_bytes for info in infos),
        **_state_parts(gm, nodes, infos),
        row_grad_bytes=tuple(info.row_grad_bytes for info in infos) if any(info.row_grad_bytes for info in infos) else (),
        param_reads=_param_reads(gm, nodes), input_free=_input_free(gm, nodes),
        wgrad_share=tuple(wgrad_share),
        split_cost=split_costs(nodes, profiles, micro_batches),
        wgrad_bytes=tuple(info.output_bytes if 0 < info.wgrad_share < 1 else 0 for info in infos),
        output_tensors=tuple(len(info.output_shapes) for info in infos),
        recomputed=tuple(recompute),
        recompute_kept=tuple(next(((p.keep, p.window) for p in partial if p.block == label), (0, 1)) for label in recompute),
        recompute_keeps=tuple(sorted(keeps)),
        block_transient=block_transient,
        **described,
        float8_recipe=low.recipe if low else None, float8_linears=low.linears if low else (), float8_kept=low.kept if low else (),
        expert_gemms=_expert_gemms(nodes, infos, gemms, kinds, per_device, profiles, again, low),
    )


def _expert_gemms(
    nodes: list[fx.Node], infos: list[NodeInfo], gemms: Mapping[int, int], kinds: list[DeviceSpec], per_device: Callable[[tuple], tuple],
    profiles: Sequence[Profile | None], again: Mapping[int, float], low: Float8Choice | None,
) -> tuple[tuple[int, float, tuple[tuple[float, ...], ...]], ...]:
    """:attr:`~autosplit.costtable.CostTable.expert_gemms` of the grouped matmuls ``gemms`` (node → bytes of the stacked
    weight) that no profile timed: their roofline terms on each device, in FP8 where ``low`` costs them so."""
    timed = {name for p in profiles if p is not None for name in p.nodes}
    fp8 = low.costed if low is not None else frozenset()
    return tuple(
        (i, again.get(i, 0.0), per_device(tuple(gemm_terms(infos[i], weight, d, low.recipe if low and i in fp8 else None) for d in kinds)))
        for i, weight in gemms.items() if nodes[i].name not in timed
    )
