"""The time model of the estimate pass (DESIGN §4.1): seconds per node × device.

An analytic roofline on a :class:`DeviceSpec`::

    t = max(flops / (peak · efficiency), bytes / (bandwidth · efficiency)) + launch overhead

with FLOPs from ``torch.utils.flop_counter`` and bytes from tensor sizes (annotate pass).
Backward moves about twice the forward bytes (it reads output gradients and saved
tensors and writes input gradients). On a device with a
:class:`~autosplit.passes.profile.Profile`, the node's measured seconds replace the roofline
(profiles hold one micro-batch; the table the whole batch). The optimizer step is memory-bound
passes over the parameters (:data:`~autosplit.costtable.OPTIMIZER_STEP_TRAFFIC`), scaled on a
profiled device to the step the profile measured; a transfer is ``latency + bytes / bandwidth``.

Usage::

    seconds = roofline(flops, nbytes, spec, half=True)
    fwd, bwd = node_times(nodes, infos, kinds, kind_of, profiles, micro_batches, row_sharer(kind_of))
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch.fx as fx

from autosplit.costtable import OPTIMIZER_SPARSE_STEP, OPTIMIZER_STEP_TRAFFIC
from autosplit.devices import DeviceSpec
from autosplit.passes.annotations import NodeInfo
from autosplit.passes.float8 import Float8Choice, cast_times, float8_times
from autosplit.passes.profile import Profile

__all__ = [
    "link_time", "node_roofline", "node_step_time", "node_times", "optimizer_step_time", "optimizer_times", "roofline", "row_sharer",
    "split_costs", "wgrad_shares",
]


# Nodes that move no data and launch nothing: they only name a value.
_FREE_TARGETS = {operator.getitem}


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


def node_roofline(node: fx.Node, info: NodeInfo, spec: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) seconds of one node on ``spec``, by the roofline, in the precision it computes in."""
    if node.op not in ("call_function", "call_method", "call_module") or node.target in _FREE_TARGETS:
        return 0.0, 0.0
    has_backward = info.bwd_flops or info.saved_bytes or info.saved_inputs
    if info.moves_nothing:  # a view: no kernel; a CPU, which runs ops as it dispatches them, pays the dispatch
        dispatch = spec.launch_overhead if spec.device_type == "cpu" else 0.0
        return dispatch, dispatch if has_backward else 0.0
    nbytes = info.input_bytes + info.output_bytes
    if spec.attention_share != 1.0 and "scaled_dot_product" in str(node.target):  # a flash kernel: its own share of the peak
        spec = dataclasses.replace(spec, efficiency=spec.efficiency * spec.attention_share,
                                   memory_efficiency=spec.memory_efficiency or spec.efficiency)
    fwd = roofline(info.fwd_flops, nbytes, spec, half=info.half)
    bwd = roofline(info.bwd_flops, 2 * nbytes, spec, half=info.half) if has_backward else 0.0
    return fwd, bwd


def optimizer_times(
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
        if prof is None or prof.optimizer_step <= 0:
            continue
        total = sum(optimizer_step_time(info.param_bytes, len(info.params), optimizer, kinds[kind_of[d]]) for info in infos)
        if total > 0:
            scale[d] = prof.optimizer_step / total
    if all(x == 1.0 for x in scale):
        return tuple(per_device(row) for row in analytic)
    return tuple(tuple(row[k] * x for k, x in zip(kind_of, scale)) for row in analytic)


def row_sharer(kind_of: list[int]) -> Callable[[tuple], tuple]:
    """A function that turns one value per device kind into a row over devices (``kind_of[d]`` is
    device ``d``'s kind); equal rows come back as one shared tuple, as deep models repeat them."""
    expanded: dict[tuple, tuple] = {}

    def per_device(per_kind: tuple) -> tuple:
        if per_kind not in expanded:
            expanded[per_kind] = tuple(per_kind[k] for k in kind_of)
        return expanded[per_kind]

    return per_device


def node_times(
    nodes: list[fx.Node], infos: list[NodeInfo], kinds: list[DeviceSpec], kind_of: list[int], profiles: list[Profile | None],
    micro_batches: int, per_device: Callable[[tuple], tuple], float8: Float8Choice | None = None,
) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
    """[node][device] forward and backward seconds: the roofline per device kind (``float8``: the linears
    and grouped matmuls that run in FP8, :func:`~autosplit.passes.float8.float8_times`; emulated on a device without FP8 tensor
    cores, the bf16 GEMM and its casts), replaced on a profiled device by the node's measured times (one
    micro-batch, scaled to the whole batch) but for the FP8 linears, which the profile timed unconverted."""
    chosen = float8.costed if float8 is not None else frozenset()

    def node_time(i: int, n: fx.Node, info: NodeInfo, d: DeviceSpec) -> tuple[float, float]:
        if i not in chosen:
            return node_roofline(n, info, d)
        assert float8 is not None and float8.recipe is not None
        if d.peak_flops_fp8 is not None:
            return float8_times(info, d, float8.recipe)
        (f, b), (cf, cb) = node_roofline(n, info, d), cast_times(info, d, float8.recipe)
        return f + cf, b + cb

    by_kind = [[node_time(i, n, info, d) for i, (n, info) in enumerate(zip(nodes, infos))] for d in kinds]
    fwd, bwd = [], []
    for i, n in enumerate(nodes):
        times = [by_kind[k][i] for k in range(len(kinds))]
        # a profile times the captured linear as it is, not in FP8: an FP8 linear keeps its costed times
        got = [] if i in chosen else [(d, prof.nodes[n.name]) for d, prof in enumerate(profiles)
                                      if prof is not None and n.name in prof.nodes]
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


def split_costs(nodes: list[fx.Node], profiles: list[Profile | None], micro_batches: int) -> tuple[tuple[float, ...], ...]:
    """[node][device] what splitting the backward costs (whole batch), measured where a profile timed
    torch's split backward against a whole one; empty when none did."""
    rows = tuple(
        tuple(p.nodes[n.name].split_cost * micro_batches if p is not None and n.name in p.nodes else 0.0 for p in profiles)
        for n in nodes
    )
    return rows if any(any(row) for row in rows) else ()


def wgrad_shares(nodes: list[fx.Node], infos: list[NodeInfo], profiles: list[Profile | None]) -> tuple[float, ...]:
    """[node] the weight pass's share of its backward: measured by the first profile that timed torch's
    split backward (a zero-bubble schedule's), else from flops (annotate)."""
    measured = next((p for p in profiles if p is not None and any(n.wgrad_share is not None for n in p.nodes.values())), None)
    shares = []
    for n, info in zip(nodes, infos):
        node = measured.nodes.get(n.name) if measured is not None else None
        shares.append(node.wgrad_share if node is not None and node.wgrad_share is not None else info.wgrad_share)
    return tuple(shares)
