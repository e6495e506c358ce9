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
  (``cp × tp`` devices, cp outside tp) runs at the link's bandwidth, beyond it at the network's;
- or, with ``comm="a2a"`` (Megatron's ``--cp-comm-type a2a``, DeepSpeed-Ulysses), **all-to-alls** (:func:`a2a_time`):
  per attention node and micro-batch, the query, key and value from the rank's tokens to its ``1/cp`` of the heads
  before attention and the output back after, and in the backward their gradients the other way; a rank sends
  ``(cp − 1)/cp`` of what it holds, ``(q + k + v + o)/(tp·cp)``, at the same link or network as the ring. Attention
  waits for them: all of it is exposed. Every head count a tp rank holds must divide by cp (:func:`check_heads`).

Usage::

    table = cp_laid_out(table, gm, cp=2, tp=1, micro_batches=4)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch.fx as fx

from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.errors import ConstraintError, advice
from autosplit.passes.annotations import node_info

__all__ = ["Attention", "a2a_time", "attention_nodes", "check_heads", "cp_laid_out", "exposed_ring", "ring_time", "sequence_length"]

GRADIENT_BYTES = 4
"""Bytes of a key or value gradient as the ring passes it back (fp32 accumulation)."""


class Attention(NamedTuple):
    """One scaled-dot-product attention node's shape, as the graph runs it (the whole sequence, every head)."""

    sequence: int
    kv_bytes: float
    """Its keys' and values' bytes together."""
    itemsize: float
    """Bytes of one of their values."""
    qo_bytes: float
    """Its query's and output's bytes together."""
    heads: int
    kv_heads: int


def attention_nodes(gm: fx.GraphModule) -> dict[str, Attention]:
    """Each scaled-dot-product attention node → its :class:`Attention`."""
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or "scaled_dot_product" not in str(n.target) or len(n.args) < 3:
            continue
        query, key, value = n.args[:3]
        if not all(isinstance(a, fx.Node) and "autosplit" in a.meta for a in (query, key, value)) or "autosplit" not in n.meta:
            continue
        shape, nbytes = node_info(key).output_shapes[0], node_info(key).output_bytes
        q = node_info(query)
        out[n.name] = Attention(shape[-2], float(nbytes + node_info(value).output_bytes), nbytes / max(1, math.prod(shape)),
                                float(q.output_bytes + node_info(n).output_bytes), q.output_shapes[0][-3], shape[-3])
    return out


def sequence_length(gm: fx.GraphModule) -> int | None:
    """The sequence the graph's attention runs over (its keys' second to last dimension), or None without attention."""
    lengths = {a.sequence for a in attention_nodes(gm).values()}
    return max(lengths) if lengths else None


def check_heads(gm: fx.GraphModule, cp: int, tp: int) -> None:
    """Refuse the all-to-all form where a tp rank's query or key/value heads do not divide over cp (each cp rank
    attends with ``1/cp`` of them over the whole sequence)."""
    for name, a in attention_nodes(gm).items():
        local = (a.heads // tp, max(1, a.kv_heads // tp))
        if any(h % cp for h in local):
            raise ConstraintError(advice(
                f"cp_comm='a2a' over cp {cp}: attention {name!r} has {local[0]} query and {local[1]} key/value heads per tp "
                f"rank (of {a.heads} and {a.kv_heads}, tp {tp}), which cp {cp} does not divide",
                "the all-to-all gives each cp rank the whole sequence of 1/cp of the heads",
                "plan with cp_comm='p2p' (the ring), or a cp dividing both head counts",
            ))


def ring_time(nbytes: float, cp: int, tp: int, device: DeviceSpec, calls: int) -> float:
    """Seconds for ``calls`` passes of ``nbytes`` (the whole sequence's, all calls together) round a ring of ``cp``
    devices, each receiving the other ``cp − 1`` shards: at the link's bandwidth inside an island of ``cp · tp``
    devices, at the network's beyond it, a latency per hop."""
    return _exchange(nbytes, cp, tp, device, latencies=(cp - 1) * calls)


def a2a_time(nbytes: float, cp: int, tp: int, device: DeviceSpec, calls: int) -> float:
    """Seconds for ``calls`` all-to-alls among ``cp`` devices, each holding ``nbytes`` (all calls together) and sending
    ``(cp − 1)/cp`` of them, over the ring's link or network (:func:`ring_time`), a latency per call."""
    return _exchange(nbytes, cp, tp, device, latencies=calls)


def _exchange(nbytes: float, cp: int, tp: int, device: DeviceSpec, *, latencies: int) -> float:
    """``(cp − 1)/cp`` of ``nbytes`` at the link's bandwidth inside an island of ``cp · tp`` devices, at the network's
    beyond it, and ``latencies`` of its latency."""
    if cp <= 1 or nbytes <= 0:
        return 0.0
    inside = not device.island_size or cp * tp <= device.island_size
    bandwidth, latency = device.link_to(device) if inside else (device.network_bandwidth, device.network_latency)
    return (cp - 1) / cp * nbytes / bandwidth + latency * latencies


def exposed_ring(table: CostTable, gm: fx.GraphModule, *, cp: int, tp: int, micro_batches: int, comm: str = "p2p") -> float:
    """Seconds per step (on the first device) of the exchange the attention work over cp does not cover, forward and
    backward: what the plan says of its ring (0: hidden), or of its all-to-alls (``comm="a2a"``: all of them)."""
    if cp <= 1:
        return 0.0
    forward, backward = _exposed(table, gm, cp=cp, tp=tp, micro_batches=micro_batches, comm=comm)
    return float(forward[:, 0].sum() + backward[:, 0].sum())


def _exposed(table: CostTable, gm: fx.GraphModule, *, cp: int, tp: int, micro_batches: int,
             comm: str = "p2p") -> tuple[np.ndarray, np.ndarray]:
    """[node, device] seconds of the exchange each attention node's forward and its backward expose: the ring's beyond
    the attention work over cp it overlaps (the blocks it feeds); the all-to-alls' whole, two calls each way."""
    fwd, bwd = _over_cp(table.fwd_time, table, cp), _over_cp(table.bwd_time, table, cp)
    out_f, out_b = np.zeros_like(fwd), np.zeros_like(bwd)
    index = {name: i for i, name in enumerate(table.nodes)}
    for name, a in attention_nodes(gm).items():
        if name not in index:
            continue
        i = index[name]
        for d, device in enumerate(table.devices):
            if comm == "a2a":  # q, k, v to heads and the output back; their gradients the other way
                out_f[i, d] = out_b[i, d] = a2a_time((a.kv_bytes + a.qo_bytes) / (tp * cp), cp, tp, device, 2 * micro_batches)
                continue
            out_f[i, d] = max(0.0, ring_time(a.kv_bytes / tp, cp, tp, device, micro_batches) - fwd[i, d])
            out_b[i, d] = max(0.0, ring_time(a.kv_bytes / tp * (1 + GRADIENT_BYTES / a.itemsize), cp, tp, device, micro_batches)
                              - bwd[i, d])
    return out_f, out_b


def _over_cp(rows: Sequence[Sequence[float]], table: CostTable, cp: int) -> np.ndarray:
    """[node, device] seconds of ``rows`` on one rank of cp: the work over cp, each kernel's launch paid on every rank."""
    launch = np.asarray([d.launch_overhead for d in table.devices])
    times = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(table.devices))
    fixed = np.minimum(times, launch[None, :]) * (times > 0)
    return (times - fixed) / cp + fixed


def cp_laid_out(table: CostTable, gm: fx.GraphModule, *, cp: int, tp: int, micro_batches: int, comm: str = "p2p") -> CostTable:
    """``table`` as one device of a context-parallel group of ``cp`` computes, holds and moves it (the module
    docstring); ``table`` itself for ``cp = 1``. ``tp``: the tensor-parallel degree inside the ring (its span);
    ``comm``: the ring (``"p2p"``) or the all-to-alls (``"a2a"``)."""
    if cp <= 1:
        return table
    ring_f, ring_b = _exposed(table, gm, cp=cp, tp=tp, micro_batches=micro_batches, comm=comm)
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

