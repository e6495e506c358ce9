"""The data-parallel layout of a plan in its costs (DESIGN §4.9): what a device of the mesh holds
and moves when each stage is replicated or sharded over ``dp_replicate × dp_shard`` copies.

Memory (:func:`laid_out`), per node and device:

- ``dp_shard = 1`` (whole copies, FSDP2's ``replicate``, or no data parallelism): parameters,
  gradients, optimizer state and buffers whole, and under a mixed precision one compute copy of
  the weights autocast casts, made once per step and shared by every micro-batch.
- ``dp_shard = D > 1`` (FSDP2's ``fully_shard``, one unit per stage, ``reshard_after_forward=False``
  as torchtitan runs it under a pipeline): parameters, gradients and optimizer state ÷ D; buffers
  whole; and for the whole step the stage's unsharded parameters with their unsharded gradients
  (accumulated over the micro-batches before the one reduce-scatter), as held (fp32 master
  weights under a mixed precision), and autocast's one compute copy per step — the runtime casts
  as autocast does rather than with FSDP2's ``MixedPrecisionPolicy``, which would round every
  weight (norms and embeddings too) to bf16 and train differently from the autocast reference
  (:func:`autosplit.runtime.precision.cast_once`). The optimizer steps its shard only: its time ÷ D.

Time (:func:`data_parallel_time`), per step and stage with parameters of ``P`` bytes:

- whole copies over R: one ring all-reduce of the gradients (``2(R−1)/R · P/bw``), the part the
  stage's last backward does not hide exposed (DDP's bucketed overlap);
- sharded over D: one all-gather of the parameters as held before the stage's first forward and one reduce-scatter of the gradients (fp32) after its last backward, each
  ``(D−1)/D · bytes/bw``, and over dp_replicate the all-reduce of the shard. The all-gather hides
  behind the stage's wait for its first input (the stages before it filling the pipeline); the
  reduce-scatter behind the drain (the stages before it finishing their last backward).

A data-parallel group is D (or R) consecutive ranks of the mesh (pp outermost): inside one island
(a node's NVLink domain) up to :attr:`~autosplit.devices.DeviceSpec.island_size` devices, ring at
the link's bandwidth; beyond, hierarchical: inside each island, then across islands over each
device's network share (:func:`~autosplit.solver.hybrid.hierarchical_phases`).

Usage::

    table = laid_out(table, dp_shard=8)
    seconds = data_parallel_time(stage_param_bytes, device, replicas=1, shards=8, ...)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.solver.hybrid import hierarchical_phases, ring_allreduce

__all__ = ["data_parallel_time", "group_time", "laid_out"]


def laid_out(table: CostTable, *, dp_shard: int) -> CostTable:
    """``table`` with each node's :attr:`~CostTable.state_bytes` and optimizer time as one device
    holds and spends them with its stage sharded over ``dp_shard`` devices (the module docstring);
    ``table`` itself for ``dp_shard = 1``."""
    if dp_shard <= 1 or not table.param_bytes:
        return table
    n = len(table.nodes)
    copies = table.weight_copy_bytes or (0,) * n
    buffers = table.buffer_bytes or (0,) * n
    state = []
    for whole, params, copy, buffer in zip(table.state_bytes, table.param_bytes, copies, buffers):
        model_state = whole - copy - buffer  # parameters, gradients, optimizer state
        state.append(math.ceil(model_state / dp_shard) + buffer + 2 * params + copy)
    optimizer = tuple(tuple(t / dp_shard for t in row) for row in table.optimizer_time)
    return dataclasses.replace(table, state_bytes=tuple(state), optimizer_time=optimizer)


def group_time(nbytes: float, size: int, device: DeviceSpec, *, allreduce: bool) -> float:
    """Seconds to all-reduce (``allreduce``) or to all-gather / reduce-scatter ``nbytes`` (the whole
    tensor's) over ``size`` consecutive ranks of ``device``'s kind: a ring inside an island, or
    inside each island and then across them (the module docstring)."""
    if size <= 1:
        return 0.0
    local = min(size, device.island_size or size)
    if local == size or size % local:
        bandwidth, latency = device.allreduce_link(device)
        ring = (size - 1) / size * nbytes / bandwidth + (size - 1) * latency
        return 2 * ring if allreduce else ring
    inside, across = hierarchical_phases(nbytes, local=local, nodes=size // local, intra=device.allreduce_link(device),
                                         inter=(device.network_bandwidth, device.network_latency))
    return inside + across if allreduce else (inside + across) / 2


def data_parallel_time(
    param_bytes: Sequence[float], devices: Sequence[DeviceSpec], *, replicas: int, shards: int,
    waits: Sequence[float], drains: Sequence[float],
) -> float:
    """Seconds per step the data-parallel collectives add to the pipeline's step (the module
    docstring): ``param_bytes[s]`` the parameters of stage ``s`` as held, ``waits[s]`` the seconds
    stage ``s`` waits for its first input, ``drains[s]`` the seconds after its last backward that
    the step goes on without it."""
    if replicas * shards <= 1:
        return 0.0
    if shards == 1:
        return max(max(0.0, group_time(p, replicas, d, allreduce=True) - drain)
                   for p, d, drain in zip(param_bytes, devices, drains))
    gather = max(max(0.0, group_time(p, shards, d, allreduce=False) - wait) for p, d, wait in zip(param_bytes, devices, waits))
    reduce = max(
        max(0.0, group_time(p, shards, d, allreduce=False) + _across_replicas(p / shards, replicas, d) - drain)
        for p, d, drain in zip(param_bytes, devices, drains)
    )
    return gather + reduce


def _across_replicas(nbytes: float, replicas: int, device: DeviceSpec) -> float:
    """The all-reduce of a shard over ``dp_replicate`` copies: each a whole dp_shard group apart,
    across islands where the groups fill them (HSDP)."""
    if replicas <= 1:
        return 0.0
    return ring_allreduce(nbytes, replicas, device.network_bandwidth, device.network_latency)
