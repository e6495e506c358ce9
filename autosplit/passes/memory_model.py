"""The memory model of the estimate pass (DESIGN §4.2): bytes per node, and what recomputing saves.

Per node: model state = parameters + gradients + optimizer state (Adam: two fp32 moments per
parameter) + buffers; activations = the bytes autograd saves, each storage charged once, at its
producer; outputs sent to another stage are held until their gradient returns; the transient
peak is at least the optimizer step's temporaries. A block a plan may recompute (activation
checkpointing) saves what its members stop holding, less what the checkpoint keeps of its inputs.

Usage::

    own, peaks, step = activation_bytes(nodes, infos, profiles, micro_batches, "adam")
    saved, sent = saved_bytes(gm, nodes, infos, own)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch.fx as fx

from autosplit.compat import NormBase
from autosplit.costtable import OPTIMIZER_SPARSE_STEP, OPTIMIZER_STATE_BYTES, OPTIMIZER_TEMP_FACTOR
from autosplit.passes.annotations import NodeInfo, node_info
from autosplit.passes.profile import Profile

__all__ = ["activation_bytes", "describe_blocks", "saved_bytes", "state_bytes"]


def saved_bytes(
    gm: fx.GraphModule, nodes: list[fx.Node], infos: list[NodeInfo], own: list[int], recomputed: Mapping[int, int] | None = None,
    keeps: Collection[int] = frozenset(),
) -> tuple[list[int], list[int]]:
    """(activation bytes, bytes held when sent to another stage) per node; each storage once.

    A tensor that several consumers save for backward (the input of q, k and v
    projections) is alive once: it is charged to its producer, on top of what the
    producer itself saves. A saved graph input is charged to its first saver. The
    model's outputs stay alive until the loss has used them: they count as saved.

    Nodes in ``recomputed`` (node → its block: the blocks a plan checkpoints) save nothing of their
    own: each block's checkpoint keeps every tensor its nodes read from outside the block instead —
    another recomputed block's output too: each block is a region of its own — and recomputes the
    rest in the backward; of them, those in ``keeps`` (a selective checkpoint's matmuls and attention:
    :func:`~autosplit.passes.selective.keeps_output`) keep their output as well.
    """
    recomputed = recomputed or {}
    index = {n.name: i for i, n in enumerate(nodes)}
    placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    saved = [0 if i in recomputed else b for i, b in enumerate(own)]
    charged: set[str] = set()
    for i in sorted(set(keeps) & set(recomputed)):  # the selective checkpoint's cache: each output once, at its node
        charged.add(nodes[i].name)
        saved[i] += infos[i].output_bytes

    def kept(i: int) -> Sequence[str]:  # what node i keeps alive for its backward
        if i not in recomputed:
            return infos[i].saved_inputs
        return [u.name for u in nodes[i].all_input_nodes if recomputed.get(index.get(u.name, -1)) != recomputed[i]]

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


def activation_bytes(
    nodes: list[fx.Node], infos: list[NodeInfo], profiles: list[Profile | None], micro_batches: int, optimizer: str
) -> tuple[list[int], list[int], list[int]]:
    """(bytes each node saves for backward, its transient peak, the temporaries the optimizer step allocates while
    it updates the node's largest parameter (:data:`OPTIMIZER_TEMP_FACTOR`)) per node: annotated, or measured by the
    first profile, the step's apart, as sharding the parameters shrinks it (:attr:`~autosplit.costtable.CostTable.step_bytes`). The
    low-precision weight copy autocast saves (``NodeInfo.weight_copy_bytes``) is no activation:
    the runtime casts each weight once per step and every micro-batch shares the copy
    (:mod:`autosplit.runtime.precision`), so it is held with the model state (:func:`state_bytes`)."""
    transient = [info.output_bytes / micro_batches for info in infos]
    own_saved = [info.saved_bytes - info.weight_copy_bytes for info in infos]
    measured = next((p for p in profiles if p is not None), None)
    if measured is not None:  # memory does not depend on which device of a kind measured it
        for i, n in enumerate(nodes):
            if n.name in measured.nodes:  # a profiled micro-batch saved one copy of its own
                own_saved[i] = max(0, measured.nodes[n.name].saved_bytes - infos[i].weight_copy_bytes) * micro_batches
                transient[i] = measured.nodes[n.name].peak_bytes
    return own_saved, [round(t) for t in transient], [int(_step_temporaries(info, optimizer)) for info in infos]


def _step_temporaries(info: NodeInfo, optimizer: str) -> int:
    """Bytes the optimizer step allocates while it updates the node's parameters: a dense step's
    temporaries scale with the largest parameter; a node holding only sparse-gradient tables that
    the optimizer steps sparsely allocates in units of their gradient."""
    if info.sparse_table_bytes == info.param_bytes > 0 and optimizer in OPTIMIZER_SPARSE_STEP:
        return OPTIMIZER_SPARSE_STEP[optimizer][2] * info.sparse_grad_bytes
    return OPTIMIZER_TEMP_FACTOR[optimizer] * info.largest_param_bytes


def state_bytes(info: NodeInfo, optimizer: str) -> int:
    """Parameters, gradients, optimizer state and buffers of a node, and the compute copy of its
    weights a mixed precision makes once per step; a sparse-gradient table's gradient is its rows
    (:attr:`NodeInfo.sparse_grad_bytes`), not the table."""
    gradients = info.param_bytes - info.sparse_table_bytes + info.sparse_grad_bytes
    optimizer_state = OPTIMIZER_STATE_BYTES[optimizer] * info.param_bytes // 4
    return info.param_bytes + gradients + optimizer_state + info.buffer_bytes + info.weight_copy_bytes


def describe_blocks(
    gm: fx.GraphModule, nodes: list[fx.Node], infos: list[NodeInfo], own: list[int], saved: list[int],
    blocks: Sequence[tuple[str, Collection[str]]], micro_batches: int, keeps: Collection[int] = frozenset(),
) -> dict[str, Any]:
    """The cost table's fields that describe ``blocks`` (label, member node names) as a plan may
    recompute them: members, the bytes recomputing each saves (what its members stop holding, less
    what the checkpoint keeps of its inputs and, selectively, of ``keeps``' outputs; an input that k
    blocks read, a mask or the rotary tables, is kept once for all of them, 1/k of it charged to each,
    so that the blocks' savings add up), what such inputs hold beyond those shares when it alone
    recomputes, the bytes its backward holds again while it recomputes, and why a block cannot be
    recomputed."""
    index = {n.name: i for i, n in enumerate(nodes)}
    members = [tuple(sorted(index[m] for m in names if m in index)) for _, names in blocks]
    totals = _SavedTotals(gm, nodes, infos, own)
    readers: dict[str, int] = {}  # name → how many blocks read it from outside themselves
    for block in members:
        inside = {nodes[i].name for i in block}
        for name in {u.name for i in block for u in nodes[i].all_input_nodes} - inside:
            readers[name] = readers.get(name, 0) + 1
    saves, shared, held, why = [], [], [], []
    kept = frozenset(keeps)
    for block in members:
        saves.append(totals.saving(block, kept, readers))
        shared.append(saves[-1] - totals.saving(block, kept))
        held.append(sum(saved[i] for i in block))
        why.append(_not_recomputable(gm, [nodes[i] for i in block], [infos[i] for i in block]))
    return dict(blocks=tuple(label for label, _ in blocks), block_members=tuple(members), block_saves=tuple(saves),
                block_shared=tuple(shared),
                block_activations=tuple(held), block_refusal=tuple(why))


class _SavedTotals:
    """The sum of :func:`saved_bytes`'s activations, and what recomputing one block alone takes off
    it, without walking the whole graph per block (a 405B Llama has 126 blocks over 9,000 nodes).

    The sum does not depend on which saver a storage is charged to: it is every node's own saved
    bytes, plus each kept name's producer output once (where the producer does not save it itself,
    or is recomputed; a placeholder's whole), plus the model's outputs no one holds. Recomputing a
    block changes the terms of the names its members keep, read or are, and no other: those are
    summed before and after."""

    def __init__(self, gm: fx.GraphModule, nodes: list[fx.Node], infos: list[NodeInfo], own: list[int]):
        self.nodes, self.infos, self.own = nodes, infos, own
        self.index = {n.name: i for i, n in enumerate(nodes)}
        self.placeholders = {n.name: node_info(n).output_bytes for n in gm.graph.find_nodes(op="placeholder")}
        self.outputs = {u.name for u in next(iter(gm.graph.find_nodes(op="output"))).all_input_nodes if u.name in self.index}
        self.keepers: dict[str, int] = {}  # name → how many nodes keep it, none recomputed
        for info in infos:
            for name in set(info.saved_inputs):
                self.keepers[name] = self.keepers.get(name, 0) + 1

    def _term(self, name: str, kept: bool, block: frozenset[int]) -> int:
        """What ``name`` adds to the sum: its storage where kept, or as a model output no one holds."""
        p = self.index.get(name)
        if p is None:
            return self.placeholders.get(name, 0) if kept else 0
        info, recomputed = self.infos[p], p in block
        if kept:
            return info.output_bytes if (not info.saves_output or recomputed) and self.nodes[p].op != "get_attr" else 0
        held = info.saves_output and not recomputed
        return info.output_bytes if name in self.outputs and not held else 0

    def saving(self, block: Sequence[int], keeps: frozenset[int] = frozenset(), shared: Mapping[str, int] | None = None) -> int:
        """Bytes :func:`saved_bytes`'s sum loses when ``block`` (node indices) alone is recomputed, its
        members in ``keeps`` keeping their outputs; with ``shared`` (name → how many blocks read it), a
        name's change is divided among the blocks that read it (what recomputing them all changes once)."""
        inside = frozenset(block)
        cached = {self.nodes[i].name for i in keeps & inside}
        change: dict[str, int] = {}
        for i in inside:
            for name in set(self.infos[i].saved_inputs):
                change[name] = change.get(name, 0) - 1
            for u in {u.name for u in self.nodes[i].all_input_nodes}:
                if self.index.get(u) not in inside:
                    change[u] = change.get(u, 0) + 1
            change.setdefault(self.nodes[i].name, 0)
        change_sum = 0.0
        for name, delta in change.items():
            count = self.keepers.get(name, 0)
            then = self._term(name, count > 0, frozenset())
            change_sum += (self._term(name, count + delta > 0 or name in cached, inside) - then) / (shared or {}).get(name, 1)
        return sum(self.own[i] for i in inside) - round(change_sum)


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
