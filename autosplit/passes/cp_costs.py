"""Context parallelism in a plan's costs: what one device of a ``cp`` group computes, holds and moves.

Each of the ``cp`` devices holds ``1/cp`` of every sequence (torchtitan's and Megatron's context parallelism,
head-tail load-balanced so that causal attention's work is even). Per node and device (:func:`cp_laid_out`),
applied after tensor parallelism's layout; the model state is sharded over ``dp_shard × cp`` by FSDP
(:func:`~autosplit.passes.sharding.laid_out` with that degree), as torchtitan shards it:

- **compute** of every node ÷ cp (its tokens), attention's too (load-balanced: each rank computes ``1/cp`` of the
  causal score blocks), but for each kernel's launch, which every rank pays whole;
- **activations** (saved, sent, transient, kept for a split backward) ÷ cp;
- **the key/value ring** (:func:`ring_time`): per attention node and micro-batch, the keys and values of the other
  ``cp − 1`` shards pass round the ring in the forward, ``2·b·s·kv·d·bytes·(cp − 1)/cp``, and in the backward again
  with their gradients in fp32 (as torch's ring attention accumulates dK and dV), each exchange overlapped with the
  attention block it feeds: only what the rank's attention compute does not cover is exposed. A ring inside an island
  (``cp × tp`` devices, cp outside tp) runs at the link's bandwidth, beyond it at the network's.

Usage::

    table = cp_laid_out(table, gm, cp=2, tp=1, micro_batches=4)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch.fx as fx

from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.passes.annotations import node_info

__all__ = ["attention_nodes", "cp_laid_out", "exposed_ring", "ring_time", "sequence_length"]

GRADIENT_BYTES = 4
"""Bytes of a key or value gradient as the ring passes it back (fp32 accumulation)."""


def attention_nodes(gm: fx.GraphModule) -> dict[str, tuple[int, float, float]]:
    """Each scaled-dot-product attention node → (its sequence length, the bytes of its keys and values together, the
    bytes of one of their values)."""
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or "scaled_dot_product" not in str(n.target) or len(n.args) < 3:
            continue
        key, value = n.args[1], n.args[2]
        if not all(isinstance(a, fx.Node) and "autosplit" in a.meta for a in (key, value)):
            continue
        shape, nbytes = node_info(key).output_shapes[0], node_info(key).output_bytes
        out[n.name] = (shape[-2], float(nbytes + node_info(value).output_bytes), nbytes / max(1, math.prod(shape)))
    return out


def sequence_length(gm: fx.GraphModule) -> int | None:
    """The sequence the graph's attention runs over (its keys' second to last dimension), or None without attention."""
    lengths = {s for s, _, _ in attention_nodes(gm).values()}
    return max(lengths) if lengths else None


def ring_time(nbytes: float, cp: int, tp: int, device: DeviceSpec, calls: int) -> float:
    """Seconds for ``calls`` passes of ``nbytes`` (the whole sequence's, all calls together) round a ring of ``cp``
    devices, each receiving the other ``cp − 1`` shards: at the link's bandwidth inside an island of ``cp · tp``
    devices, at the network's beyond it, a latency per hop."""
    if cp <= 1 or nbytes <= 0:
        return 0.0
    inside = not device.island_size or cp * tp <= device.island_size
    bandwidth, latency = device.link_to(device) if inside else (device.network_bandwidth, device.network_latency)
    return (cp - 1) / cp * nbytes / bandwidth + (cp - 1) * latency * calls


def exposed_ring(table: CostTable, gm: fx.GraphModule, *, cp: int, tp: int, micro_batches: int) -> float:
    """Seconds per step (on the first device) of the K/V ring the attention work over cp does not cover, forward and
    backward: what the plan says of its ring (0: hidden)."""
    if cp <= 1:
        return 0.0
    forward, backward = _exposed(table, gm, cp=cp, tp=tp, micro_batches=micro_batches)
    return float(forward[:, 0].sum() + backward[:, 0].sum())


def _exposed(table: CostTable, gm: fx.GraphModule, *, cp: int, tp: int, micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
    """[node, device] seconds of the ring each attention node's forward and its backward expose beyond the attention
    work over cp they overlap (the blocks it feeds)."""
    fwd, bwd = _over_cp(table.fwd_time, table, cp), _over_cp(table.bwd_time, table, cp)
    out_f, out_b = np.zeros_like(fwd), np.zeros_like(bwd)
    index = {name: i for i, name in enumerate(table.nodes)}
    for name, (_, kv, itemsize) in attention_nodes(gm).items():
        if name not in index:
            continue
        i = index[name]
        for d, device in enumerate(table.devices):
            out_f[i, d] = max(0.0, ring_time(kv / tp, cp, tp, device, micro_batches) - fwd[i, d])
            out_b[i, d] = max(0.0, ring_time(kv / tp * (1 + GRADIENT_BYTES / itemsize), cp, tp, device, micro_batches) - bwd[i, d])
    return out_f, out_b


def _over_cp(rows: Sequence[Sequence[float]], table: CostTable, cp: int) -> np.ndarray:
    """[node, device] seconds of ``rows`` on one rank of cp: the work over cp, each kernel's launch paid on every rank."""
    launch = np.asarray([d.launch_overhead for d in table.devices])
    times = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(table.devices))
    fixed = np.minimum(times, launch[None, :]) * (times > 0)
    return (times - fixed) / cp + fixed


def cp_laid_out(table: CostTable, gm: fx.GraphModule, *, cp: int, tp: int, micro_batches: int) -> CostTable:
    """``table`` as one device of a context-parallel group of ``cp`` computes, holds and moves it (the module
    docstring); ``table`` itself for ``cp = 1``. ``tp``: the tensor-parallel degree inside the ring (its span)."""
    if cp <= 1:
        return table
    ring_f, ring_b = _exposed(table, gm, cp=cp, tp=tp, micro_batches=micro_batches)  # overlapped with the blocks it feeds
    fwd, bwd = _over_cp(table.fwd_time, table, cp) + ring_f, _over_cp(table.bwd_time, table, cp) + ring_b

    def rows(values: np.ndarray) -> tuple[tuple[float, ...], ...]:
        return tuple(map(tuple, values.tolist()))

    def cut(values: Sequence[int]) -> tuple[int, ...]:
        return tuple(-(-v // cp) for v in values)

    return dataclasses.replace(
        table, fwd_time=rows(fwd), bwd_time=rows(bwd),
        rerun_time=rows(_over_cp(table.rerun_time, table, cp)) if table.rerun_time else (),
        split_cost=tuple(tuple(t / cp for t in row) for row in table.split_cost),
        saved_bytes=cut(table.saved_bytes), output_bytes=cut(table.output_bytes), sent_bytes=cut(table.sent_bytes),
        transient_bytes=cut(table.transient_bytes), wgrad_bytes=cut(table.wgrad_bytes), block_saves=cut(table.block_saves),
        block_activations=cut(table.block_activations), block_shared=cut(table.block_shared),
        block_transient=-(-table.block_transient // cp),
    )

