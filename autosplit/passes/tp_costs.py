"""Tensor parallelism in a plan's costs: what one device of a ``tp`` group computes, holds and moves.

The rules come from the graph (:mod:`autosplit.passes.tensor_parallel`): which parameters are split
and along which dimension, which nodes compute a ``1/tp`` slice (the column-parallel linears, what
lies between them and their row-parallel partner, that partner), and which tensors are reduced.
Per node and device of a group of ``tp`` (:func:`tp_laid_out`):

- **compute** (forward, backward, the split backward's cost) ÷ tp on a split node; whole on a
  replicated one (norms, residuals, the loss: every tp rank runs them on the whole activation, as
  the runtime does, :mod:`autosplit.runtime.tensor_parallel`) — or ÷ tp too with ``sequence_parallel``,
  where they run on ``1/tp`` of the sequence (torchtitan's ``SequenceParallel``; costed, not run);
- **activations** (saved, sent, transient, kept for a split backward) likewise ÷ tp, but a node's whose
  output the forward reduces (a row-parallel product, a vocabulary-parallel lookup or head): whole on every
  rank without sequence parallelism (the runtime reduces it at once);
- **parameters**, their gradients and optimizer state ÷ tp for the split share of the node's parameters
  (``f``: the node holds ``1 − f + f/tp`` of them), and the optimizer's step with them; a mixed
  precision's compute copy of a weight ÷ tp where the node that reads it is split;
- **collectives**: each tensor the rules reduce in the forward (a row-parallel output, the
  vocabulary-parallel embedding's) and each gradient they reduce in the backward (at a column-parallel
  group's input): a ring all-reduce over the tp ranks, once per micro-batch, on the node's critical
  path (torch's tensor parallelism does not overlap them); under ``async_tp`` (torchtitan's async TP,
  Megatron's TP communication overlap) overlapped with the node's own GEMM, of which the engine hides
  the device's ``tp_overlap`` share of the shorter.

The tp group is ``tp`` consecutive ranks (tp innermost in the mesh), inside one node's island: the
intra-node ring, at the all-reduce link's bandwidth.

Under sequence parallelism each all-reduce is a reduce-scatter and an all-gather of the same bytes:
the same time on the ring.

An FP8 linear (:mod:`autosplit.passes.float8`) split over tp casts what it gathers: torchao gathers bf16, so
every rank casts the whole operand (a column-parallel input, a row-parallel output's gradient); Transformer
Engine casts the shard and gathers FP8, a quarter of the ring saved (:func:`_float8_under_tp`).

A block that recomputes (:func:`_recomputing`) runs its forward again in the backward. Whole
(``torch.utils.checkpoint``), collectives included: each node's ring time again. Selectively, the
policy keeps every all-reduce's and reduce-scatter's output (:data:`~autosplit.passes.selective.KEPT_COLLECTIVES`,
as torchtitan's keeps its reduce-scatters), so none runs again, but under sequence parallelism the
all-gather before each column-parallel group does (half the node's ring time); the block then holds
each collective's output (whole, ``1/tp`` of the tokens under sequence parallelism) and, where the
node is a kept matmul (a row-parallel linear), its local product: a partial sum as large as the whole
output, not the ``1/tp`` a split node's output is charged.

Usage::

    table = tp_laid_out(table, gm, rules, tp=8, micro_batches=4, numel=param_numel)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch.fx as fx

from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.passes.annotations import node_info
from autosplit.passes.float8 import CAST_TRAFFIC, cast_seconds, float8_linears
from autosplit.passes.param_dtype import PARAM_CAST
from autosplit.passes.tensor_parallel import TensorParallelRules
from autosplit.plans import PartialRecompute

__all__ = ["FP8_GATHER_SHARE", "split_shares", "tp_collective_time", "tp_laid_out"]

FP8_GATHER_SHARE = 0.75
"""Of a sequence-parallel collective's ring time, what it takes where its all-gather moves FP8: the
reduce-scatter in bf16 (half the ring) and the all-gather at a byte a value (a quarter). Transformer Engine
casts a layer's input to FP8 in the norm before it gathers it, and the output's gradient before its gather."""


def split_shares(gm: fx.GraphModule, table: CostTable, shards: Mapping[str, int], numel: Mapping[str, int]) -> list[float]:
    """[node] the share of the node's parameters (by elements) that tensor parallelism splits."""
    nodes = {n.name: n for n in gm.graph.nodes}
    shares = []
    for name in table.nodes:
        params = node_info(nodes[name]).params if name in nodes and "autosplit" in nodes[name].meta else ()
        total = sum(numel.get(p, 0) for p in params)
        shares.append(sum(numel.get(p, 0) for p in params if p in shards) / total if total else 0.0)
    return shares


def tp_collective_time(nbytes: float, tp: int, device: DeviceSpec, micro_batches: int) -> float:
    """Seconds to all-reduce ``nbytes`` (the whole batch's) over ``tp`` ranks of one node, one
    collective per micro-batch: the ring's ``2(tp−1)/tp`` of the bytes at the link's bandwidth, and
    its ``2(tp−1)`` latencies each time."""
    if tp <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = device.allreduce_link(device)
    return 2 * (tp - 1) / tp * nbytes / bandwidth + 2 * (tp - 1) * latency * micro_batches


def _ring(table: CostTable, collectives: Mapping[str, int], tp: int, micro_batches: int) -> np.ndarray:
    """[node, device] seconds of the tp collectives ``collectives`` charges each node (whole batch's bytes by name)."""
    out = np.zeros((len(table.nodes), len(table.devices)))
    for i, name in enumerate(table.nodes):
        if collectives.get(name, 0):
            out[i] = [tp_collective_time(collectives[name], tp, d, micro_batches) for d in table.devices]
    return out


def _float8_under_tp(
    table: CostTable, gm: fx.GraphModule, rules: TensorParallelRules, tp: int, *, sequence_parallel: bool, gathered: bool,
) -> tuple[CostTable, np.ndarray, np.ndarray]:
    """(``table`` with the casts its FP8 linears repeat on every tp rank, [node] share of each node's forward and
    of its backward ring time left) for ``table.float8_linears`` split over a tp group.

    ``gathered``: the engine casts before it gathers (:data:`FP8_GATHER_SHARE`): every cast reads a shard, and
    each sequence-parallel collective beside an FP8 linear (a row-parallel one's output; a column-parallel
    group's input, in the backward) takes that share. Otherwise the activations are gathered in bf16 (torchao)
    and every rank casts a whole operand: a column-parallel linear its input (forward, and again for its
    weight's gradient), a row-parallel one its output's gradient. Charged as ``(tp − 1)`` times the cast on top
    of the node's time, which the layout then divides by ``tp``: the cast whole, the rest split."""
    n, fwd_left, bwd_left = len(table.nodes), np.ones(len(table.nodes)), np.ones(len(table.nodes))
    if table.float8_recipe is None or not table.float8_linears:
        return table, fwd_left, bwd_left
    by_name = {node.name: node for node in gm.graph.nodes}
    present = [by_name[name] for name in table.nodes if name in by_name]
    chosen = set(table.float8_linears)
    roles = {present[i].name: (rules.shards.get(f"{path}.weight"), w) for i, (path, w) in float8_linears(gm, present).items()
             if path in chosen}
    index = {name: i for i, name in enumerate(table.nodes)}
    fwd = np.asarray(table.fwd_time, dtype=np.float64).reshape(n, -1)
    bwd = np.asarray(table.bwd_time, dtype=np.float64).reshape(n, -1)
    fwd_in, bwd_out, bwd_in = CAST_TRAFFIC[table.float8_recipe]
    for name, (dim, weight) in roles.items():
        i, (features, inner) = index[name], weight.shape
        if gathered and sequence_parallel and dim in (0, 1):
            if dim == 1:
                fwd_left[i] = FP8_GATHER_SHARE
            elif isinstance(source := by_name[name].args[0], fx.Node) and source.name in index:
                bwd_left[index[source.name]] = FP8_GATHER_SHARE
        elif not gathered and dim in (0, 1):
            output = table.output_bytes[i]
            if dim == 0:  # column-parallel: its whole input (output · inner / features), forward and for the weight's gradient
                whole = (fwd_in * output * inner / features, bwd_in * output * inner / features)
            else:  # row-parallel: its whole output's gradient
                whole = (0.0, bwd_out * output)
            fwd[i] += [(tp - 1) * cast_seconds(whole[0], d) for d in table.devices]
            bwd[i] += [(tp - 1) * cast_seconds(whole[1], d) for d in table.devices]
    casts = dataclasses.replace(table, fwd_time=tuple(map(tuple, fwd.tolist())), bwd_time=tuple(map(tuple, bwd.tolist())))
    return casts, fwd_left, bwd_left


def _needed_again(gm: fx.GraphModule, table: CostTable) -> frozenset[int]:
    """The nodes of each block whose output a whole block's recomputation makes again: torch's checkpoint
    stops once it has made every tensor the backward needs (``set_checkpoint_early_stop``), so a node none of
    whose users in the block (nor theirs) saves a tensor for the backward — the reduction before a
    pre-norm layer's residual add, its last op — does not run again."""
    nodes = {n.name: n for n in gm.graph.nodes}
    needed: set[int] = set()
    for members in table.block_members:
        inside = {table.nodes[i]: i for i in members}
        for i in sorted(members, reverse=True):  # users after their inputs: a user's answer is known first
            node = nodes.get(table.nodes[i])
            users = [u for u in node.users if u.name in inside] if node is not None else []
            if node is None or any(inside[u.name] in needed or _saves(u) for u in users):
                needed.add(i)
    return frozenset(needed)


def _saves(node: fx.Node) -> bool:
    """Whether ``node`` saves a tensor for its backward (unannotated: assumed to)."""
    if "autosplit" not in node.meta:
        return True
    info = node_info(node)
    return bool(info.saved_inputs) or info.saves_output


def _recomputing(
    table: CostTable, gm: fx.GraphModule, rules: TensorParallelRules, cut: Sequence[float], outputs: Sequence[float],
    ring: np.ndarray, *, tp: int, micro_batches: int, sequence_parallel: bool,
) -> tuple[np.ndarray, list[float], list[float], np.ndarray]:
    """What tensor parallelism adds to recomputing blocks (the module docstring): ([node, device] seconds
    the backward runs again for the blocks ``table`` recomputes, [node] bytes their nodes hold more,
    [block] bytes a recomputing block holds more, [node, device] seconds a node runs again whenever its
    block recomputes). ``cut``: each node's share of its compute, ``outputs``: of its output; ``ring``:
    each node's forward collectives, seconds."""
    keeps = frozenset(table.recompute_keeps)
    n = len(table.nodes)
    needed = _needed_again(gm, table) if table.blocks and not keeps else frozenset()
    if keeps:  # selectively: each reduction kept (its output: 1/tp of the tokens under sequence parallelism)
        again = np.full(n, 0.5 if sequence_parallel else 0.0)  # of each node's ring time: the all-gathers run again
        reduced = [rules.forward_collectives.get(name, 0) / (tp if sequence_parallel else 1) for name in table.nodes]
        held = [r + table.output_bytes[i] * (1 - outputs[i]) * (i in keeps) if r else 0.0 for i, r in enumerate(reduced)]
    else:
        again, held = np.asarray([float(i in needed) for i in range(n)]), [0.0] * n
    fwd = np.asarray(table.fwd_time, dtype=np.float64).reshape(n, -1) * np.asarray(cut)[:, None]
    fwd[sorted(keeps)] = 0.0
    rerun = fwd + again[:, None] * ring
    backward, saved = np.zeros_like(ring), [0.0] * n
    for label, (keep, window) in zip(table.recomputed, table.recompute_kept or [(0, 1)] * len(table.recomputed)):
        share = PartialRecompute(label, keep, window).recomputed(micro_batches) / micro_batches
        for i in table.block_members[table.blocks.index(label)]:
            backward[i] += again[i] * ring[i] * share
            saved[i] += held[i] * (1 - keep / window)
    return backward, saved, [sum(held[i] for i in m) for m in table.block_members], rerun


def tp_laid_out(
    table: CostTable, gm: fx.GraphModule, rules: TensorParallelRules, *, tp: int, micro_batches: int, numel: Mapping[str, int],
    sequence_parallel: bool = False, precision: str = "fp32", async_tp: bool = False, float8_gathered: bool = False,
) -> CostTable:
    """``table`` as one device of a tensor-parallel group of ``tp`` computes, holds and moves it (the
    module docstring); ``table`` itself for ``tp = 1``. ``precision``: where its weights' compute copy is
    held (below). ``async_tp``: each collective overlapped with its node's GEMM, the device's
    :attr:`~autosplit.device_spec.DeviceSpec.tp_overlap` of the shorter of the two hidden. ``float8_gathered``:
    the engine casts its FP8 linears' operands before it gathers them (:func:`_float8_under_tp`)."""
    if tp <= 1:
        return table
    table, fwd_left, bwd_left = _float8_under_tp(table, gm, rules, tp, sequence_parallel=sequence_parallel, gathered=float8_gathered)
    split = [1 / tp if name in rules.split_nodes else 1.0 for name in table.nodes]
    cut = [1 / tp] * len(table.nodes) if sequence_parallel else split
    # what a device holds of a node's output: a reduced one (a row-parallel product, a lookup) is whole but
    # under sequence parallelism, though its compute is split
    outputs = cut if sequence_parallel else [1.0 if name in rules.forward_collectives else c for name, c in zip(table.nodes, cut)]
    held = [1 - f + f / tp for f in split_shares(gm, table, rules.shards, numel)]

    def scaled(values: Sequence[int], by: Sequence[float]) -> tuple[int, ...]:
        return tuple(round(v * k) for v, k in zip(values, by)) if values else ()

    overlap = np.asarray([d.tp_overlap if async_tp else 0.0 for d in table.devices])

    def timed(rows: Sequence[Sequence[float]], comm: np.ndarray) -> np.ndarray:
        times = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(table.devices)) * np.asarray(cut)[:, None]
        return times + comm - overlap * np.minimum(comm, times)

    def rows(times: np.ndarray) -> tuple[tuple[float, ...], ...]:
        return tuple(map(tuple, times.tolist()))

    ring = _ring(table, rules.forward_collectives, tp, micro_batches) * fwd_left[:, None]
    again, cached, block_cached, rerun = _recomputing(table, gm, rules, cut, outputs, ring, tp=tp, micro_batches=micro_batches,
                                                  sequence_parallel=sequence_parallel)

    # a weight's compute copy is saved where autocast casts it, by the linear (or lookup) that reads it,
    # which need not be the node that owns the parameter: it is split where that reader is; FSDP2's policy
    # gathers it where the parameter is owned, split as the parameter is
    buffers = table.buffer_bytes or (0,) * len(table.nodes)
    copies = table.weight_copy_bytes or (0,) * len(table.nodes)
    copied = held if precision in PARAM_CAST else split
    state = tuple(round((s - b - c) * k) + b + round(c * q) for s, b, c, k, q in zip(table.state_bytes, buffers, copies, held, copied))
    saved = scaled(table.saved_bytes, outputs)
    ratio = [sum(saved[i] for i in m) / max(1, sum(table.saved_bytes[i] for i in m)) for m in table.block_members]
    saves = tuple(max(0, s - math.ceil(c)) for s, c in zip(scaled(table.block_saves, ratio), block_cached))
    return dataclasses.replace(
        table,
        fwd_time=rows(timed(table.fwd_time, ring)),
        bwd_time=rows(timed(table.bwd_time, _ring(table, rules.backward_collectives, tp, micro_batches) * bwd_left[:, None]) + again),
        rerun_time=rows(rerun) if table.blocks else (),
        split_cost=tuple(tuple(t * k for t in row) for row, k in zip(table.split_cost, cut)),
        state_bytes=state, saved_bytes=tuple(s + math.ceil(c) for s, c in zip(saved, cached)),
        output_bytes=scaled(table.output_bytes, outputs),
        sent_bytes=scaled(table.sent_bytes, outputs), transient_bytes=scaled(table.transient_bytes, outputs),
        wgrad_bytes=scaled(table.wgrad_bytes, outputs),
        param_bytes=scaled(table.param_bytes, held), step_bytes=scaled(table.step_bytes, held),
        weight_copy_bytes=scaled(table.weight_copy_bytes, copied),
        param_counts=scaled(table.param_counts, held),
        optimizer_time=tuple(tuple(t * k for t in row) for row, k in zip(table.optimizer_time, held)),
        # held again while a block recomputes: as the recomputing nodes' transients are split, by their largest share
        block_saves=saves, block_activations=scaled(table.block_activations, [max((outputs[i] for i in m), default=1.0)
                                                                               for m in table.block_members]),
        block_shared=scaled(table.block_shared, ratio),
        block_transient=round(table.block_transient * max((outputs[i] for m in table.block_members for i in m), default=1.0)),
    )
