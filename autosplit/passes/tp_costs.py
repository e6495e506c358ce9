"""Tensor parallelism in a plan's costs: what one device of a ``tp`` group computes, holds and moves.

The rules come from the graph (:mod:`autosplit.passes.tensor_parallel`): which parameters are split
and along which dimension, which nodes compute a ``1/tp`` slice (the column-parallel linears, what
lies between them and their row-parallel partner, that partner), and which tensors are reduced.
Per node and device of a group of ``tp`` (:func:`tp_laid_out`):

- **compute** (forward, backward, the split backward's cost) ÷ tp on a split node; whole on a
  replicated one (norms, residuals, the loss: every tp rank runs them on the whole activation, as
  the runtime does, :mod:`autosplit.runtime.tensor_parallel`) — or ÷ tp too with ``sequence_parallel``,
  where they run on ``1/tp`` of the sequence (torchtitan's ``SequenceParallel``; costed, not run);
- **activations** (saved, sent, transient, kept for a split backward) likewise ÷ tp;
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

Usage::

    table = tp_laid_out(table, gm, rules, tp=8, micro_batches=4, numel=param_numel)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch.fx as fx

from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.passes.annotations import node_info
from autosplit.passes.param_dtype import PARAM_CAST
from autosplit.passes.tensor_parallel import TensorParallelRules

__all__ = ["split_shares", "tp_collective_time", "tp_laid_out"]


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


def tp_laid_out(
    table: CostTable, gm: fx.GraphModule, rules: TensorParallelRules, *, tp: int, micro_batches: int, numel: Mapping[str, int],
    sequence_parallel: bool = False, precision: str = "fp32", async_tp: bool = False,
) -> CostTable:
    """``table`` as one device of a tensor-parallel group of ``tp`` computes, holds and moves it (the
    module docstring); ``table`` itself for ``tp = 1``. ``precision``: where its weights' compute copy is
    held (below). ``async_tp``: each collective overlapped with its node's GEMM, the device's
    :attr:`~autosplit.device_spec.DeviceSpec.tp_overlap` of the shorter of the two hidden."""
    if tp <= 1:
        return table
    split = [1 / tp if name in rules.split_nodes else 1.0 for name in table.nodes]
    cut = [1 / tp] * len(table.nodes) if sequence_parallel else split
    held = [1 - f + f / tp for f in split_shares(gm, table, rules.shards, numel)]

    def scaled(values: Sequence[int], by: Sequence[float]) -> tuple[int, ...]:
        return tuple(round(v * k) for v, k in zip(values, by)) if values else ()

    def timed(rows: Sequence[Sequence[float]], extra: Mapping[str, int]) -> tuple[tuple[float, ...], ...]:
        times = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(table.devices)) * np.asarray(cut)[:, None]
        for i, name in enumerate(table.nodes):
            if extra.get(name, 0):
                comm = [tp_collective_time(extra[name], tp, d, micro_batches) for d in table.devices]
                hidden = [d.tp_overlap * min(c, t) if async_tp else 0.0 for c, t, d in zip(comm, times[i], table.devices)]
                times[i] += np.asarray(comm) - np.asarray(hidden)
        return tuple(map(tuple, times.tolist()))

    # a weight's compute copy is saved where autocast casts it, by the linear (or lookup) that reads it,
    # which need not be the node that owns the parameter: it is split where that reader is; FSDP2's policy
    # gathers it where the parameter is owned, split as the parameter is
    buffers = table.buffer_bytes or (0,) * len(table.nodes)
    copies = table.weight_copy_bytes or (0,) * len(table.nodes)
    copied = held if precision in PARAM_CAST else split
    state = tuple(round((s - b - c) * k) + b + round(c * q) for s, b, c, k, q in zip(table.state_bytes, buffers, copies, held, copied))
    saved = scaled(table.saved_bytes, cut)
    ratio = [sum(saved[i] for i in m) / max(1, sum(table.saved_bytes[i] for i in m)) for m in table.block_members]
    return dataclasses.replace(
        table,
        fwd_time=timed(table.fwd_time, rules.forward_collectives),
        bwd_time=timed(table.bwd_time, rules.backward_collectives),
        split_cost=tuple(tuple(t * k for t in row) for row, k in zip(table.split_cost, cut)),
        state_bytes=state, saved_bytes=saved, output_bytes=scaled(table.output_bytes, cut),
        sent_bytes=scaled(table.sent_bytes, cut), transient_bytes=scaled(table.transient_bytes, cut),
        wgrad_bytes=scaled(table.wgrad_bytes, cut),
        param_bytes=scaled(table.param_bytes, held), weight_copy_bytes=scaled(table.weight_copy_bytes, copied),
        param_counts=scaled(table.param_counts, held),
        optimizer_time=tuple(tuple(t * k for t in row) for row, k in zip(table.optimizer_time, held)),
        block_saves=scaled(table.block_saves, ratio), block_activations=scaled(table.block_activations, ratio),
        block_shared=scaled(table.block_shared, ratio),
        block_transient=round(table.block_transient * max((cut[i] for m in table.block_members for i in m), default=1.0)),
    )
