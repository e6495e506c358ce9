"""Estimate: per node × device forward/backward time, training memory, and placement rules.

Time (DESIGN §4.1) is an analytic roofline on a :class:`DeviceSpec`::

    t = max(flops / (peak · efficiency), bytes / (bandwidth · efficiency)) + launch overhead

with FLOPs from ``torch.utils.flop_counter`` and bytes from tensor sizes (annotate pass).
Backward moves about twice the forward bytes (it reads output gradients and saved
tensors and writes input gradients).

Memory (DESIGN §4.2) per node: model state = parameters + gradients + optimizer state
(Adam: two fp32 moments per parameter) + buffers; activations = the bytes autograd saves.

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

import torch
import torch.fx as fx
from networkx.utils import UnionFind

from autosplit.compat import NormBase
from autosplit.costtable import (
    OPTIMIZER_SPARSE_STEP,
    OPTIMIZER_STATE_BYTES,
    OPTIMIZER_STEP_TRAFFIC,
    OPTIMIZER_TEMP_FACTOR,
    OVERRIDE_KEYS,
    SPARSE_REFUSED,
    CostTable,
)
from autosplit.devices import DeviceSpec
from autosplit.errors import CostModelError, advice
from autosplit.passes.annotate import NodeInfo, node_info
from autosplit.passes.profile import Profile
from autosplit.plans import PartialRecompute

__all__ = [
    "CostTable", "estimate", "roofline", "link_time", "optimizer_step_time", "node_step_time", "OPTIMIZER_STATE_BYTES", "OVERRIDE_KEYS",
    "with_overrides",
]


# Nodes that move no data and launch nothing: they only name a value.
_FREE_TARGETS = {operator.getitem}


@dataclasses.dataclass(frozen=True)
class LossCost:
    """One micro-batch's loss on every device (:mod:`autosplit.passes.loss`), charged by :func:`estimate`."""

    fwd: tuple[float, ...]
    """[device] forward seconds."""
    bwd: tuple[float, ...]
    saved_bytes: int
    """What autograd keeps from the loss's forward to its backward (the output it reads excluded)."""


def roofline(flops: float, nbytes: float, spec: DeviceSpec, *, half: bool = False) -> float:
    """Seconds for one op of ``flops`` FLOPs touching ``nbytes`` bytes on ``spec``."""
    if flops == 0 and nbytes == 0:
        return 0.0
    peak = (spec.peak_flops_half or spec.peak_flops) if half else spec.peak_flops
    memory_efficiency = spec.memory_efficiency or spec.efficiency
    return max(flops / (peak * spec.efficiency), nbytes / (spec.memory_bandwidth * memory_efficiency)) + spec.launch_overhead


def optimizer_step_time(param_bytes: float, param_tensors: int, optimizer: str, spec: DeviceSpec) -> float:
    """Seconds of one optimizer step over parameters of ``param_bytes`` in ``param_tensors`` tensors:
    memory-bound passes over them (:data:`OPTIMIZER_STEP_TRAFFIC`) plus a launch per op."""
    passes, ops = OPTIMIZER_STEP_TRAFFIC[optimizer]
    bandwidth = spec.memory_bandwidth * (spec.memory_efficiency or spec.efficiency)
    return passes * param_bytes / bandwidth + ops * param_tensors * spec.launch_overhead


def node_step_time(info: NodeInfo, optimizer: str, spec: DeviceSpec) -> float:
    """Seconds of one optimizer step over the parameters a node owns: tables whose gradient is
    sparse (:attr:`NodeInfo.sparse_table_bytes`) over the rows of that gradient where the optimizer
    steps them sparsely (:data:`OPTIMIZER_SPARSE_STEP`), the rest over their whole bytes."""
    if not (info.sparse_table_bytes and optimizer in OPTIMIZER_SPARSE_STEP):
        return optimizer_step_time(info.param_bytes, len(info.params), optimizer, spec)
    passes, ops, _ = OPTIMIZER_SPARSE_STEP[optimizer]
    sparse = passes * info.sparse_grad_bytes / (spec.memory_bandwidth * (spec.memory_efficiency or spec.efficiency))
    dense = info.param_bytes - info.sparse_table_bytes  # its launches counted per tensor, the tables' too (a few launches high)
    return sparse + ops * spec.launch_overhead + (optimizer_step_time(dense, len(info.params), optimizer, spec) if dense else 0.0)


def link_time(nbytes: float, a: DeviceSpec, b: DeviceSpec) -> float:
    """Seconds to move ``nbytes`` from ``a`` to ``b``: latency + bytes / bandwidth (slower end)."""
    bandwidth, latency = a.link_to(b)
    return latency + nbytes / bandwidth


def _times(node: fx.Node, info: NodeInfo, spec: DeviceSpec) -> tuple[float, float]:
    if node.op not in ("call_function", "call_method", "call_module") or node.target in _FREE_TARGETS:
        return 0.0, 0.0
    nbytes = info.input_bytes + info.output_bytes
    fwd = roofline(info.fwd_flops, nbytes, spec, half=info.half)
    has_backward = info.bwd_flops or info.saved_bytes or info.saved_inputs
    bwd = roofline(info.bwd_flops, 2 * nbytes, spec, half=info.half) if has_backward else 0.0
    return fwd, bwd


def _saved_bytes(
    gm: fx.GraphModule, nodes: list[fx.Node], infos: list[NodeInfo], own: list[int], recomputed: Collection[int] = frozenset()
) -> tuple[list[int], list[int]]:
    """(activation bytes, bytes held when sent to another stage) per node; each storage once.

    A tensor that several consumers save for backward (the input of q, k and v
    projections) is alive once: it is charged to its producer, on top of what the
    producer itself saves. A saved graph input is charged to its first saver. The
    model's outputs stay alive until the loss has used them: they count as saved.

    Nodes in ``recomputed`` (the blocks a plan checkpoints) save nothing of their own: the
    checkpoint keeps every tensor they read from outside the blocks instead, and recomputes the rest
    in the backward.
    """
    index = {n.name: i for i, n in enumerate(nodes)}
    placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    saved = [0 if i in recomputed else b for i, b in enumerate(own)]
    charged: set[str] = set()

    def kept(i: int) -> Sequence[str]:  # what node i keeps alive for its backward
        if i not in recomputed:
            return infos[i].saved_inputs
        return [u.name for u in nodes[i].all_input_nodes if index.get(u.name) not in recomputed]

    for i in range(len(infos)):
        for name in kept(i):
            if name in charged:
                continue
            charged.add(name)
            if name in index:
                p = index[name]
                if (not infos[p].saves_output or p in recomputed) and nodes[p].op != "get_attr":  # parameters are model state
                    saved[p] += infos[p].output_bytes
            elif name in placeholders:
                saved[i] += node_info(placeholders[name]).output_bytes
    held = {nodes[i].name for i, info in enumerate(infos) if info.saves_output and i not in recomputed} | charged
    output = next(iter(gm.graph.find_nodes(op="output")))
    for u in output.all_input_nodes:
        if u.name in index and u.name not in held:
            saved[index[u.name]] += infos[index[u.name]].output_bytes
            held.add(u.name)
    sent = [0 if n.name in held or n.op == "get_attr" else info.output_bytes for n, info in zip(nodes, infos)]
    return saved, sent


def with_overrides(table: CostTable, overrides: Mapping[str, Mapping[str, float]]) -> CostTable:
    """``table`` with user costs: a node's own, or a module's total spread over its nodes.

    Times are seconds for the whole batch and apply on every device; a module's total is
    shared in proportion to its nodes' current costs (equally when those are all zero).
    """
    by_name = {name: i for i, name in enumerate(table.nodes)}
    fwd, bwd = [list(row) for row in table.fwd_time], [list(row) for row in table.bwd_time]
    saved = list(table.saved_bytes)
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
                for d in range(len(table.devices)):
                    for i, t in zip(members, spread(cost[field], [rows[i][d] for i in members])):
                        rows[i][d] = t
        if "saved_bytes" in cost:
            for i, b in zip(members, spread(cost["saved_bytes"], [saved[i] for i in members])):
                saved[i] = round(b)
    return dataclasses.replace(
        table, fwd_time=tuple(map(tuple, fwd)), bwd_time=tuple(map(tuple, bwd)), saved_bytes=tuple(saved)
    )


def _optimizer_times(
    infos: list[NodeInfo], kinds: list[DeviceSpec], kind_of: list[int], profiles: list[Profile | None],
    optimizer: str, per_device: Callable[[tuple], tuple],
) -> tuple[tuple[float, ...], ...]:
    """[node][device] seconds of the optimizer step over the node's parameters: the analytic
    model (:func:`optimizer_step_time`), scaled on a profiled device so that the whole model's
    step takes what the profile measured (cache-resident state steps faster than DRAM bandwidth says).
    The profile steps dense gradients, so its scale is taken against the dense model of the step."""
    analytic = [tuple(node_step_time(info, optimizer, d) for d in kinds) for info in infos]
    scale = [1.0] * len(kind_of)
    for d, prof in enumerate(profiles):
        total = sum(optimizer_step_time(info.param_bytes, len(info.params), optimizer, kinds[kind_of[d]]) for info in infos)
        if prof is not None and prof.optimizer_step > 0 and total > 0:
            scale[d] = prof.optimizer_step / total
    if all(x == 1.0 for x in scale):
        return tuple(per_device(row) for row in analytic)
    return tuple(tuple(row[k] * x for k, x in zip(kind_of, scale)) for row in analytic)


def _row_sharer(kind_of: list[int]) -> Callable[[tuple], tuple]:
    """A function that turns one value per device kind into a row over devices (``kind_of[d]`` is
    device ``d``'s kind); equal rows come back as one shared tuple, as deep models repeat them."""
    expanded: dict[tuple, tuple] = {}

    def per_device(per_kind: tuple) -> tuple:
        if per_kind not in expanded:
            expanded[per_kind] = tuple(per_kind[k] for k in kind_of)
        return expanded[per_kind]

    return per_device


def _node_times(
    nodes: list[fx.Node], infos: list[NodeInfo], kinds: list[DeviceSpec], kind_of: list[int], profiles: list[Profile | None],
    micro_batches: int, per_device: Callable[[tuple], tuple],
) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
    """[node][device] forward and backward seconds: the roofline per device kind, replaced on a
    profiled device by the node's measured times (one micro-batch, scaled to the whole batch)."""
    by_kind = [[_times(n, info, d) for n, info in zip(nodes, infos)] for d in kinds]
    fwd, bwd = [], []
    for i, n in enumerate(nodes):
        times = [by_kind[k][i] for k in range(len(kinds))]
        got = [(d, prof.nodes[n.name]) for d, prof in enumerate(profiles) if prof is not None and n.name in prof.nodes]
        if not got:
            fwd.append(per_device(tuple(t[0] for t in times)))
            bwd.append(per_device(tuple(t[1] for t in times)))
            continue
        row = [times[k] for k in kind_of]
        for d, node in got:
            row[d] = (node.fwd * micro_batches, node.bwd * micro_batches)
        fwd.append(tuple(t[0] for t in row))
        bwd.append(tuple(t[1] for t in row))
    return fwd, bwd


def _activation_bytes(
    nodes: list[fx.Node], infos: list[NodeInfo], profiles: list[Profile | None], micro_batches: int, optimizer: str
) -> tuple[list[int], list[int]]:
    """(bytes each node saves for backward, its transient peak) per node: annotated, or measured
    by the first profile. The transient peak is at least the temporaries the optimizer step
    allocates while it updates the node's largest parameter (:data:`OPTIMIZER_TEMP_FACTOR`). The
    whole batch's saved bytes hold a weight copy autocast makes once per micro-batch: every
    micro-batch in flight keeps its own (``NodeInfo.weight_copy_bytes``)."""
    transient = [info.output_bytes / micro_batches for info in infos]
    own_saved = [info.saved_bytes + (micro_batches - 1) * info.weight_copy_bytes for info in infos]
    measured = next((p for p in profiles if p is not None), None)
    if measured is not None:  # memory does not depend on which device of a kind measured it
        for i, n in enumerate(nodes):
            if n.name in measured.nodes:
                own_saved[i] = measured.nodes[n.name].saved_bytes * micro_batches
                transient[i] = measured.nodes[n.name].peak_bytes
    peaks = [int(max(round(t), _step_temporaries(info, optimizer))) for t, info in zip(transient, infos)]
    return own_saved, peaks


def _step_temporaries(info: NodeInfo, optimizer: str) -> int:
    """Bytes the optimizer step allocates while it updates the node's parameters: a dense step's
    temporaries scale with the largest parameter; a node holding only sparse-gradient tables that
    the optimizer steps sparsely allocates in units of their gradient."""
    if info.sparse_table_bytes == info.param_bytes > 0 and optimizer in OPTIMIZER_SPARSE_STEP:
        return OPTIMIZER_SPARSE_STEP[optimizer][2] * info.sparse_grad_bytes
    return OPTIMIZER_TEMP_FACTOR[optimizer] * info.largest_param_bytes


def _state_bytes(info: NodeInfo, optimizer: str) -> int:
    """Parameters, gradients, optimizer state and buffers of a node; a sparse-gradient table's
    gradient is its rows (:attr:`NodeInfo.sparse_grad_bytes`), not the table."""
    gradients = info.param_bytes - info.sparse_table_bytes + info.sparse_grad_bytes
    return info.param_bytes + gradients + OPTIMIZER_STATE_BYTES[optimizer] * info.param_bytes // 4 + info.buffer_bytes


def _split_costs(nodes: list[fx.Node], profiles: list[Profile | None], micro_batches: int) -> tuple[tuple[float, ...], ...]:
    """[node][device] what splitting the backward costs (whole batch), measured where a profile timed
    torch's split backward against a whole one; empty when none did."""
    rows = tuple(
        tuple(p.nodes[n.name].split_cost * micro_batches if p is not None and n.name in p.nodes else 0.0 for p in profiles)
        for n in nodes
    )
    return rows if any(any(row) for row in rows) else ()


def _wgrad_shares(nodes: list[fx.Node], infos: list[NodeInfo], profiles: list[Profile | None]) -> tuple[float, ...]:
    """[node] the weight pass's share of its backward: measured by the first profile that timed torch's
    split backward (a zero-bubble schedule's), else from flops (annotate)."""
    measured = next((p for p in profiles if p is not None and any(n.wgrad_share is not None for n in p.nodes.values())), None)
    shares = []
    for n, info in zip(nodes, infos):
        node = measured.nodes.get(n.name) if measured is not None else None
        shares.append(node.wgrad_share if node is not None and node.wgrad_share is not None else info.wgrad_share)
    return tuple(shares)


def _placement_rules(
    gm: fx.GraphModule, nodes: list[fx.Node], index: Mapping[fx.Node, int], infos: list[NodeInfo]
) -> tuple[tuple[tuple[int, ...], ...], set[tuple[int, int]]]:
    """(colocated groups, order edges) that codegen relies on (see the module docstring): calls of
    one module, a ``get_attr`` and its first reader, and an in-place op and the node it writes stay
    together; readers of a written tensor keep their order around the write."""
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


def _param_reads(gm: fx.GraphModule, nodes: list[fx.Node]) -> tuple[str, ...]:
    """Per node, the qualified name of the parameter a ``get_attr`` reads, or ``""`` (any other node,
    or a buffer or constant read)."""
    return tuple(
        str(n.target) if n.op == "get_attr" and isinstance(operator.attrgetter(str(n.target))(gm), torch.nn.Parameter)
        else ""
        for n in nodes
    )


def _blocks(
    gm: fx.GraphModule, nodes: list[fx.Node], infos: list[NodeInfo], own: list[int], saved: list[int],
    blocks: Sequence[tuple[str, Collection[str]]], micro_batches: int,
) -> dict[str, tuple]:
    """The cost table's fields that describe ``blocks`` (label, member node names) as a plan may
    recompute them: members, the bytes recomputing each alone saves (what its members stop holding,
    less what the checkpoint keeps of its inputs), the bytes its backward holds again while it
    recomputes, and why a block cannot be recomputed."""
    index = {n.name: i for i, n in enumerate(nodes)}
    members = [tuple(sorted(index[m] for m in names if m in index)) for _, names in blocks]
    saves, held, why = [], [], []
    for block in members:
        alone, _ = _saved_bytes(gm, nodes, infos, own, frozenset(block))
        saves.append(sum(saved) - sum(alone))
        held.append(sum(saved[i] for i in block))
        why.append(_not_recomputable(gm, [nodes[i] for i in block], [infos[i] for i in block]))
    return dict(blocks=tuple(label for label, _ in blocks), block_members=tuple(members), block_saves=tuple(saves),
                block_activations=tuple(held), block_refusal=tuple(why))


def _not_recomputable(gm: fx.GraphModule, members: Sequence[fx.Node], infos: Sequence[NodeInfo]) -> str:
    """Why recomputing these nodes in the backward would train differently ("" when it would not):
    a write in place into a value from outside them (recomputing would read the written value), or
    a module whose buffers training updates (BatchNorm's running statistics would move twice)."""
    inside = {n.name for n in members}
    for n, info in zip(members, infos):
        outside = [name for name in info.mutates if name not in inside]
        if outside:
            return f"node {n.name} writes {outside[0]} in place"
        if n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            if mod.training and any(True for _ in mod.buffers()) and getattr(mod, "track_running_stats", True) and isinstance(
                mod, NormBase
            ):
                return f"module {n.target} ({type(mod).__name__}) updates its running statistics in training"
    return ""


def estimate(
    gm: fx.GraphModule,
    devices: tuple[DeviceSpec, ...],
    *,
    optimizer: str = "adam",
    profiles: Sequence[Profile | None] | None = None,
    micro_batches: int = 1,
    blocks: Sequence[tuple[str, Collection[str]]] = (),
    recompute: Collection[str] = (),
    partial: Sequence[PartialRecompute] = (),
    loss: LossCost | None = None,
) -> CostTable:
    """Build the :class:`CostTable` of an annotated graph for ``devices``.

    ``profiles[d]`` (one micro-batch of ``micro_batches``) gives device ``d`` measured
    costs; ``None`` or a missing profile keeps the analytic ones. ``blocks`` (label, member node
    names) are what a plan may recompute (activation checkpointing); the costs of those labelled in
    ``recompute`` are the recomputing ones: their forward runs again in the backward, their members
    keep none of their activations (the checkpoint keeps their inputs), and their backward needs
    the block's activations of one micro-batch again; those in ``partial`` keep some micro-batches'
    activations and recompute the others' (a mix of both costs, by the share of each). ``loss`` (one
    micro-batch's) is charged to the node that makes the model's output last, every micro-batch's.
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise CostModelError(advice(
            f"unknown optimizer {optimizer!r}", "the memory model knows the state of these optimizers only",
            f"choose one of {sorted(OPTIMIZER_STATE_BYTES)}",
        ))
    profiles = list(profiles or [None] * len(devices))
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    index = {n: i for i, n in enumerate(nodes)}
    infos = [node_info(n) for n in nodes]
    sparse = [(n.name, info) for n, info in zip(nodes, infos) if info.sparse_table_bytes]
    if sparse and optimizer in SPARSE_REFUSED:
        name, info = sparse[0]
        raise CostModelError(advice(
            f"node {name!r} looks up a table of {info.sparse_table_bytes / 2**20:.1f} MiB with sparse=True "
            f"({len(sparse)} such node(s)), and optimizer={optimizer!r}",
            f"torch's {optimizer} refuses sparse gradients, so the step this plan would be costed for cannot run",
            "plan with optimizer='adagrad' or 'sgd' (they step sparse gradients row by row), or look the table up with sparse=False",
        ))
    # Identical devices (the common case: 64 of one kind) are costed once.
    kinds = list(dict.fromkeys(devices))
    kind_of = [kinds.index(d) for d in devices]
    per_device = _row_sharer(kind_of)

    fwd, bwd = _node_times(nodes, infos, kinds, kind_of, profiles, micro_batches, per_device)
    own_saved, transient = _activation_bytes(nodes, infos, profiles, micro_batches, optimizer)
    wgrad_share = list(_wgrad_shares(nodes, infos, profiles))
    if loss is not None:
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
    edges = sorted({(index[u], index[v]) for v in nodes for u in v.all_input_nodes if u in index})
    colocate, order_edges = _placement_rules(gm, nodes, index, infos)
    saved, sent = _saved_bytes(gm, nodes, infos, own_saved)
    described = _blocks(gm, nodes, infos, own_saved, saved, blocks, micro_batches) if blocks else {}
    unknown = sorted(set(recompute) - set(described.get("blocks", ())))
    if unknown:
        raise CostModelError(advice(
            f"cannot cost recomputing {unknown}: not among the blocks described ({list(described.get('blocks', ()))[:4]})",
            "recompute names the labels of blocks passed in blocks=", "pass every recomputed block in blocks= too",
        ))
    if recompute:
        chosen = [described["block_members"][described["blocks"].index(label)] for label in recompute]
        recomputed = frozenset(i for block in chosen for i in block)
        saved, sent = _saved_bytes(gm, nodes, infos, own_saved, recomputed)
        again_share = dict.fromkeys(recomputed, 1.0)
        for p in partial:  # at the stage's peak, p.keep of its p.window micro-batches hold what keeping the block holds
            members = frozenset(described["block_members"][described["blocks"].index(p.block)])
            whole, whole_sent = _saved_bytes(gm, nodes, infos, own_saved, recomputed - members)
            saved = [math.ceil(a + (b - a) * p.keep / p.window) for a, b in zip(saved, whole)]
            sent = [math.ceil(a + (b - a) * p.keep / p.window) for a, b in zip(sent, whole_sent)]
            again_share.update(dict.fromkeys(members, p.recomputed(micro_batches) / micro_batches))
        again = max(described["block_activations"][described["blocks"].index(label)] for label in recompute)
        transient = [t + math.ceil(again / micro_batches) if i in recomputed else t for i, t in enumerate(transient)]
        bwd = [per_device(tuple(b + f * again_share[i] for b, f in zip(bwd[i], fwd[i]))) if i in recomputed else bwd[i]
               for i in range(len(nodes))]
    state = [_state_bytes(info, optimizer) for info in infos]
    return CostTable(
        devices=tuple(devices),
        nodes=tuple(n.name for n in nodes),
        module_paths=tuple(info.module_path for info in infos),
        fwd_time=tuple(fwd),
        bwd_time=tuple(bwd),
        state_bytes=tuple(state),
        saved_bytes=tuple(saved),
        output_bytes=tuple(info.output_bytes for info in infos),
        edges=tuple(edges),
        order_edges=tuple(sorted(order_edges - set(edges))),
        colocate=colocate,
        param_counts=tuple(info.param_count for info in infos),
        sent_bytes=tuple(sent),
        transient_bytes=tuple(int(t) for t in transient),
        optimizer_time=_optimizer_times(infos, kinds, kind_of, profiles, optimizer, per_device),
        param_bytes=tuple(info.param_bytes for info in infos),
        row_grad_bytes=tuple(info.row_grad_bytes for info in infos) if any(info.row_grad_bytes for info in infos) else (),
        param_reads=_param_reads(gm, nodes),
        wgrad_share=tuple(wgrad_share),
        split_cost=_split_costs(nodes, profiles, micro_batches),
        wgrad_bytes=tuple(info.output_bytes if 0 < info.wgrad_share < 1 else 0 for info in infos),
        output_tensors=tuple(len(info.output_shapes) for info in infos),
        recomputed=tuple(recompute),
        recompute_kept=tuple(next(((p.keep, p.window) for p in partial if p.block == label), (0, 1)) for label in recompute),
        **described,
    )
