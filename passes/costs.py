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

Usage::

    table = estimate(gm, devices, optimizer="adam")
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx
from networkx.utils import UnionFind

from autosplit.devices import DeviceSpec
from autosplit.errors import CostModelError
from autosplit.passes.annotate import NodeInfo, node_info
from autosplit.passes.capture import mutated_input

__all__ = ["CostTable", "estimate", "roofline", "link_time", "OPTIMIZER_STATE_BYTES"]

# Optimizer state bytes per parameter (fp32 moments, whatever the parameter dtype).
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd_momentum": 4, "sgd": 0, "none": 0}

# Nodes that move no data and launch nothing: they only name a value.
_FREE_TARGETS = {operator.getitem}


@dataclass(frozen=True)
class CostTable:
    """Per-node costs on every device, plus the graph facts the solver needs. Plain data."""

    devices: tuple[DeviceSpec, ...]
    nodes: tuple[str, ...]
    """Placeable nodes in graph (topological) order: everything but placeholders and output."""
    module_paths: tuple[str, ...]
    fwd_time: tuple[tuple[float, ...], ...]
    """[node][device] forward seconds for the example batch."""
    bwd_time: tuple[tuple[float, ...], ...]
    state_bytes: tuple[int, ...]
    """Parameters + gradients + optimizer state + buffers each node owns."""
    saved_bytes: tuple[int, ...]
    output_bytes: tuple[int, ...]
    edges: tuple[tuple[int, int], ...]
    """Data edges (producer index, consumer index) between placeable nodes."""
    order_edges: tuple[tuple[int, int], ...]
    """Precedence without data (around in-place writes)."""
    colocate: tuple[tuple[int, ...], ...]
    """Groups of node indices that must share a device."""
    param_counts: tuple[int, ...]
    source: str = "analytic"


def roofline(flops: float, nbytes: float, spec: DeviceSpec, *, half: bool = False) -> float:
    """Seconds for one op of ``flops`` FLOPs touching ``nbytes`` bytes on ``spec``."""
    if flops == 0 and nbytes == 0:
        return 0.0
    peak = (spec.peak_flops_half or spec.peak_flops) if half else spec.peak_flops
    return max(flops / (peak * spec.efficiency), nbytes / (spec.memory_bandwidth * spec.efficiency)) + spec.launch_overhead


def link_time(nbytes: float, a: DeviceSpec, b: DeviceSpec) -> float:
    """Seconds to move ``nbytes`` from ``a`` to ``b``: latency + bytes / bandwidth (slower end)."""
    bandwidth, latency = a.link_to(b)
    return latency + nbytes / bandwidth


def _times(node: fx.Node, info: NodeInfo, spec: DeviceSpec) -> tuple[float, float]:
    if node.op not in ("call_function", "call_method", "call_module") or node.target in _FREE_TARGETS:
        return 0.0, 0.0
    nbytes = info.input_bytes + info.output_bytes
    fwd = roofline(info.fwd_flops, nbytes, spec, half=info.half)
    bwd = roofline(info.bwd_flops, 2 * nbytes, spec, half=info.half) if (info.bwd_flops or info.saved_bytes) else 0.0
    return fwd, bwd


def estimate(gm: fx.GraphModule, devices: tuple[DeviceSpec, ...], *, optimizer: str = "adam") -> CostTable:
    """Build the :class:`CostTable` of an annotated graph for ``devices``."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise CostModelError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATE_BYTES)}")
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    index = {n: i for i, n in enumerate(nodes)}
    infos = [node_info(n) for n in nodes]
    times = [[_times(n, info, d) for d in devices] for n, info in zip(nodes, infos)]

    edges = sorted({(index[u], index[v]) for v in nodes for u in v.all_input_nodes if u in index})

    colocate = UnionFind(range(len(nodes)))
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
        written = mutated_input(n, gm)
        if written is None:
            continue
        if written in index:
            colocate.union(i, index[written])
        for reader in written.users:
            if reader is not n and reader in index:
                order_edges.add((index[reader], i) if index[reader] < i else (i, index[reader]))

    state = [
        2 * info.param_bytes + OPTIMIZER_STATE_BYTES[optimizer] * info.param_count + info.buffer_bytes
        for info in infos
    ]
    return CostTable(
        devices=tuple(devices),
        nodes=tuple(n.name for n in nodes),
        module_paths=tuple(info.module_path for info in infos),
        fwd_time=tuple(tuple(t[0] for t in row) for row in times),
        bwd_time=tuple(tuple(t[1] for t in row) for row in times),
        state_bytes=tuple(state),
        saved_bytes=tuple(info.saved_bytes for info in infos),
        output_bytes=tuple(info.output_bytes for info in infos),
        edges=tuple(edges),
        order_edges=tuple(sorted(order_edges - set(edges))),
        colocate=tuple(sorted(tuple(sorted(g)) for g in colocate.to_sets() if len(g) > 1)),
        param_counts=tuple(info.param_count for info in infos),
    )
