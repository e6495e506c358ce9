"""Expert parallelism in a plan's costs: what one device of an ``ep`` group computes, holds and moves.

The groups come from the graph (:mod:`autosplit.passes.experts`). As torchtitan lays experts out
(``expert_tensor_parallel_degree = 1``, Megatron's ``--expert-tensor-parallel-size 1``), the ``ep``
ranks are borrowed from the dense mesh's ``dp_shard × tp`` (``ep`` divides it): each rank holds
``E / ep`` whole experts, and the rest of their state is sharded over the ``efsdp = dp_shard·tp / ep``
ranks that hold the same experts. Per node and device (:func:`ep_laid_out`), applied after
:func:`~autosplit.passes.tp_costs.tp_laid_out` and before :func:`~autosplit.passes.sharding.laid_out`:

- **parameters** of the experts (their share ``f`` of a node's, by bytes): ``1/ep`` of them on each
  rank, which is what FSDP gathers for the step (the ``efsdp`` ranks' shards of the local experts),
  and their compute copy likewise; their sharded state (parameters, gradients, optimizer state) over
  all ``dp_shard · tp`` ranks — :func:`~autosplit.passes.sharding.laid_out` divides by ``dp_shard``,
  so the expert share enters it ``÷ tp``; the optimizer's step over them likewise;
- **compute** of the expert nodes: unchanged per token (balanced routing, as the published MoE
  benchmarks force it: each rank computes ``T·k`` routed rows, now over ``E / ep`` experts); under
  tp, the tokens of a tp group are split over its ranks before they are dispatched (torchtitan's
  ``ReordererSequenceParallel``, Megatron's sequence-parallel MoE input), so ``÷ tp`` unless sequence
  parallelism has already cut every node. A grouped matmul reads every expert's weight it holds once
  per call, whatever its rows: ``1/ep`` of the stacked weight, not ``÷ tp``, not ``÷ cp``
  (:func:`gemm_terms`, :func:`gemm_time`: at a few thousand rows per call the weight's bytes, not its
  FLOPs, bound a DeepSeek-V3 layer's 256 experts on one rank);
- **the token all-to-all**: per MoE layer and micro-batch, a dispatch before the experts and a combine
  after them, in the forward and again in the backward, each moving ``T·k·h·bytes·(1 − 1/ep)`` of a
  rank's routed rows (``T`` its tokens: ``÷ tp``, and ``÷ cp`` of the sequence it holds) to the other ``ep − 1``
  ranks (:func:`alltoall_time`): inside an
  island over each device's link, beyond it the off-island share over its network port, the two at
  once. On the critical path (torch's ``all_to_all_single`` waits), but under ``ep_overlap``
  (Megatron's batch-level overlap): then the engine's fitted share of the shorter of a layer's
  all-to-alls and another micro-batch's compute of that layer is hidden (:func:`_overlapped`).

Usage::

    table = ep_laid_out(table, groups, ep=8, tp=1, micro_batches=4, numel=param_numel, owners=owned)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.engine_profiles import FITTED
from autosplit.passes.annotations import NodeInfo
from autosplit.passes.experts import ExpertGroup
from autosplit.passes.float8 import CAST_KERNELS, CAST_TRAFFIC

__all__ = ["alltoall_time", "ep_laid_out", "expert_shares", "gemm_terms", "gemm_time"]


def gemm_terms(info: NodeInfo, weight: int, spec: DeviceSpec, recipe: str | None) -> tuple[float, ...]:
    """The forward's terms, then the backward's, of one grouped matmul of the experts' rows on ``spec``, in seconds
    over the whole batch: its FLOPs at the peak it computes at, the bytes of its rows (in and out), of the stacked
    weight (``weight`` bytes, every expert's), the casts of its rows and of the weight (in FP8 under ``recipe``:
    :mod:`autosplit.passes.float8`; emulated at the bf16 peak where ``spec`` has no FP8), and its launches.
    :func:`gemm_time` of them at one rank's whole batch and weight is what
    :func:`~autosplit.passes.time_model.node_times` costs the node."""
    bandwidth = spec.memory_bandwidth * (spec.memory_efficiency or spec.efficiency)
    if recipe is not None and spec.peak_flops_fp8 is not None:
        peak = spec.peak_flops_fp8 * (FITTED["float8.rowwise"].value if recipe == "rowwise" else 1.0)
    else:
        peak = (spec.peak_flops_half or spec.peak_flops) if info.half else spec.peak_flops
    fwd_in, bwd_out, bwd_in = CAST_TRAFFIC[recipe] if recipe is not None else (0.0, 0.0, 0.0)
    launches = spec.launch_overhead * (1 + (2 * CAST_KERNELS if recipe is not None else 0))
    rows_in, rows = info.input_bytes - weight, info.input_bytes + info.output_bytes - weight
    speed = peak * spec.efficiency
    return (info.fwd_flops / speed, rows / bandwidth, weight / bandwidth, fwd_in * rows_in / bandwidth, fwd_in * weight / bandwidth,
            launches,
            info.bwd_flops / speed, 2 * rows / bandwidth, 2 * weight / bandwidth,
            (bwd_out * info.output_bytes + bwd_in * rows_in) / bandwidth, bwd_in * weight / bandwidth, launches)


def gemm_time(terms: Sequence[float], rows: float, weight: float) -> tuple[float, float]:
    """(forward, backward) seconds of a grouped matmul of :func:`gemm_terms` that computes ``rows`` of its rows and
    reads ``weight`` of its stacked weight (shares): the roofline of its FLOPs and bytes, then its casts and launches."""
    out = []
    for flops, moved, read, cast, cast_weight, launches in (terms[:6], terms[6:]):
        out.append(max(flops * rows, moved * rows + read * weight) + cast * rows + cast_weight * weight + launches)
    return out[0], out[1]


def alltoall_time(nbytes: float, size: int, device: DeviceSpec, calls: int = 1) -> float:
    """Seconds of ``calls`` all-to-alls over ``size`` consecutive ranks of ``device``'s kind, each rank
    holding ``nbytes`` in all (the whole batch's; an equal share for every rank, its own included):
    ``(local − 1)/size`` of the bytes over the island's links and ``(size − local)/size`` over the
    network at once, ``local`` the ranks of the group on one island; a latency per call."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    local = min(size, device.group_island or size)
    bandwidth, latency = device.link_to(device)
    inside = (local - 1) / size * nbytes / bandwidth
    if local == size:
        return inside + latency * calls
    across = (size - local) / size * nbytes / device.network_bandwidth
    return max(inside, across) + max(latency, device.network_latency) * calls


def expert_shares(
    table: CostTable, groups: Sequence[ExpertGroup], numel: Mapping[str, int], owners: Mapping[str, Sequence[str]],
) -> list[float]:
    """[node] the share of the node's parameters (by elements) that are experts'. ``owners``: node name →
    the parameters it owns (:attr:`~autosplit.passes.annotations.NodeInfo.params`)."""
    stacked = {p for g in groups for p in g.params}
    shares = []
    for name in table.nodes:
        params = owners.get(name, ())
        total = sum(numel.get(p, 0) for p in params)
        shares.append(sum(numel.get(p, 0) for p in params if p in stacked) / total if total else 0.0)
    return shares


def ep_laid_out(
    table: CostTable, groups: Sequence[ExpertGroup], *, ep: int, tp: int, micro_batches: int, numel: Mapping[str, int],
    owners: Mapping[str, Sequence[str]], tokens_cut: bool = False, cp: int = 1, overlap: bool = False,
) -> CostTable:
    """``table`` as one device of an expert-parallel group of ``ep`` holds, computes and moves it (the
    module docstring); ``table`` itself for ``ep = 1``. ``tokens_cut``: tensor parallelism has already cut every node's compute and
    activations by ``tp`` (sequence parallelism); ``cp``: context parallelism has cut them by ``cp``. ``overlap``: the
    all-to-alls overlapped with another micro-batch's layer (:func:`_overlapped`)."""
    if ep <= 1 or not groups:
        return table
    n, index = len(table.nodes), {name: i for i, name in enumerate(table.nodes)}
    expert = expert_shares(table, groups, numel, owners)
    local = [1 - f + f / ep for f in expert]  # of a node's parameters, what a rank holds whole: its experts
    sharded = [1 - f + f / tp for f in expert]  # of its sharded state, before laid_out divides by dp_shard
    cuts = np.ones(n)
    comm_fwd, comm_bwd = np.zeros((n, len(table.devices))), np.zeros((n, len(table.devices)))
    split = 1 if tokens_cut else tp
    spans: list[tuple[int, int]] = []  # (first, last) node of each group's layer
    for group in groups:
        members = [index[name] for name in group.nodes if name in index]
        if not members:
            continue
        # the exchanges beside the experts' work: not at their stacked parameters, which an exported graph takes first
        working = [i for i in members if any(table.fwd_time[i])] or members
        spans.append((spans[-1][1] + 1 if spans else 0, working[-1]))
        cuts[members] = 1 / split
        nbytes = group.dispatched_bytes() / (tp * cp)  # a rank's routed rows: its tp and cp share of the tokens
        for d, device in enumerate(table.devices):
            once = alltoall_time(nbytes, ep, device, micro_batches)
            comm_fwd[working[0], d] += once  # the dispatch, before the first expert node
            comm_fwd[working[-1], d] += once  # the combine, after the last
            comm_bwd[working[0], d] += once  # the combine's gradient back to the experts
            comm_bwd[working[-1], d] += once  # and the dispatch's back to the tokens

    fwd, bwd = (np.asarray(rows, dtype=np.float64).reshape(n, -1) * cuts[:, None] for rows in (table.fwd_time, table.bwd_time))
    rerun = np.asarray(table.rerun_time, dtype=np.float64).reshape(n, -1) * cuts[:, None] if table.rerun_time else None
    _own_experts_read(table, fwd, bwd, rerun, rows=1 / (tp * cp), weight=1 / ep)
    if overlap:
        _overlapped(comm_fwd, comm_bwd, fwd + bwd, spans, [d.ep_overlap for d in table.devices])

    def times(values: np.ndarray, comm: np.ndarray) -> tuple[tuple[float, ...], ...]:
        return tuple(map(tuple, (values + comm).tolist()))

    def scaled(values: Sequence[int], by: Sequence[float]) -> tuple[int, ...]:
        return tuple(round(v * k) for v, k in zip(values, by)) if values else ()

    computing = cuts.tolist()  # [node] the share of its compute and activations a rank runs and holds
    buffers = table.buffer_bytes or (0,) * n
    copies = table.weight_copy_bytes or (0,) * n
    state = tuple(round((s - b - c) * k) + b + round(c * q) for s, b, c, k, q in zip(table.state_bytes, buffers, copies, sharded, local))
    return dataclasses.replace(
        table,
        fwd_time=times(fwd, comm_fwd), bwd_time=times(bwd, comm_bwd),
        rerun_time=times(rerun, comm_fwd) if rerun is not None else (),  # a recomputed forward exchanges again
        split_cost=tuple(tuple(t * c for t in row) for row, c in zip(table.split_cost, computing)),
        saved_bytes=scaled(table.saved_bytes, computing), transient_bytes=scaled(table.transient_bytes, computing),
        output_bytes=scaled(table.output_bytes, computing), sent_bytes=scaled(table.sent_bytes, computing),
        wgrad_bytes=scaled(table.wgrad_bytes, computing),
        state_bytes=state, step_bytes=scaled(table.step_bytes, sharded),  # the optimizer steps a rank's experts, as it holds them
        param_bytes=scaled(table.param_bytes, local), weight_copy_bytes=scaled(table.weight_copy_bytes, local),
        param_counts=scaled(table.param_counts, local),
        optimizer_time=tuple(tuple(t * k for t in row) for row, k in zip(table.optimizer_time, sharded)),
    )


def _overlapped(comm_fwd: np.ndarray, comm_bwd: np.ndarray, compute: np.ndarray, spans: Sequence[tuple[int, int]],
                share: Sequence[float]) -> None:
    """The all-to-alls of each layer (``spans``: its first and last node) overlapped with another micro-batch's compute
    of that layer, as Megatron's batch-level overlap runs them (``--overlap-moe-expert-parallel-comm``: one
    micro-batch's forward beside another's backward, the dispatch and combine of each behind the other's attention and
    experts): ``share`` (per device, :attr:`~autosplit.device_spec.DeviceSpec.ep_overlap`) of the shorter of the
    two hidden. ``comm_fwd``, ``comm_bwd`` ([node, device], in place); ``compute``: [node, device] forward and
    backward seconds."""
    for first, last in spans:
        layer = slice(first, last + 1)
        comm = comm_fwd[layer].sum(axis=0) + comm_bwd[layer].sum(axis=0)
        hidden = np.asarray(share) * np.minimum(comm, compute[layer].sum(axis=0))
        kept = np.divide(comm - hidden, comm, out=np.ones_like(comm), where=comm > 0)
        comm_fwd[layer] *= kept
        comm_bwd[layer] *= kept


def _own_experts_read(table: CostTable, fwd: np.ndarray, bwd: np.ndarray, rerun: np.ndarray | None, *, rows: float, weight: float) -> None:
    """The experts' grouped matmuls (:attr:`~autosplit.costtable.CostTable.expert_gemms`) in ``fwd``, ``bwd`` and
    ``rerun`` ([node, device], in place) costed anew as a rank runs them: ``rows`` of the batch's routed rows, and
    ``weight`` of the stacked weights (its own experts'); a recomputing block's backward runs the forward again."""
    for i, again, terms in table.expert_gemms:
        for d, row in enumerate(terms):
            f, b = gemm_time(row, rows, weight)
            fwd[i, d], bwd[i, d] = f, b + again * f
            if rerun is not None and rerun[i, d] > 0:
                rerun[i, d] = f
