"""The data-parallel layout of a plan in its costs (DESIGN §4.9): what a device of the mesh holds
and moves when each stage is replicated or sharded over ``dp_replicate × dp_shard`` copies.

Memory (:func:`laid_out`), per node and device:

- ``dp_shard = 1`` (whole copies, FSDP2's ``replicate``, or no data parallelism): parameters,
  gradients, optimizer state and buffers whole, and under a mixed precision one compute copy of
  the weights autocast casts, made once per step and shared by every micro-batch.
- ``dp_shard = D > 1`` (FSDP2's ``fully_shard``): parameters, gradients and optimizer state ÷ D;
  buffers and the compute copy whole; the optimizer steps its shard only (its time ÷ D). The
  gathered parameters, as held (fp32 master weights under ``"bf16-mixed"``: the runtime casts as
  autocast does, each matmul's weights only — :func:`autosplit.runtime.precision.cast_once`; under
  ``"bf16-fsdp"`` FSDP2's ``MixedPrecisionPolicy`` gathers the bf16 copy of every weight instead, and
  accumulates the gradients in fp32 — on every stage, whatever the degree):
  - under a pipeline, or with several micro-batches, each stage is one unit, gathered for the whole
    step (``reshard_after_forward=False``, torchtitan's choice under pipelining: every micro-batch's
    backward would gather it again), its gradients accumulated whole: + parameters + gradients; on an
    engine whose sharding is Megatron's distributed optimizer (its profile's ``distributed_optimizer``), the
    gradient buffer is that whole one and no shard of it is kept apart: the fp32 master weights and the
    optimizer's moments ÷ D;
  - FSDP alone in one pass (:func:`sharded_alone`): each repeated block the runtime outlines as a
    module of its own (:func:`~autosplit.passes.outline.outlinable_blocks`: a decoder layer, whether
    the graph was traced or exported; torchtitan wraps each block), and each other leaf module the
    graph calls and that owns its parameters (:func:`~autosplit.passes.outline.unit_targets`), is a unit of its own, whole only
    while it runs — its transient: its parameters and gradients, and the next unit's parameters
    gathered ahead (:func:`unit_totals`); the rest are the stage's own unit, as above.

Time (:func:`data_parallel_time`), per step and stage with parameters of ``P`` bytes:

- whole copies over R: one ring all-reduce of the gradients (``2(R−1)/R · P/bw``), the part the
  stage's last backward does not hide exposed (DDP's bucketed overlap);
- sharded over D, a stage's own unit: one all-gather before its first forward and one
  reduce-scatter after its last backward, each ``(D−1)/D · P/bw``, and over dp_replicate the
  all-reduce of the shard. The all-gather hides behind the stage's wait for its first input (the
  stages before it filling the pipeline); the reduce-scatter behind the drain (the stages before it
  finishing their last backward);
- units of their own: gathered for the forward and again for the backward, reduced after it —
  three collectives of their bytes, behind the stage's compute where FSDP2's prefetching hides them.

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
from autosplit.engine_profiles import engine_of
from autosplit.passes.outline import block_path
from autosplit.passes.param_dtype import PARAM_CAST
from autosplit.solver.hybrid import hierarchical_phases, ring_allreduce

__all__ = [
    "FP8_GATHERED", "data_parallel_time", "gathered_share", "gradient_share", "group_time", "laid_out", "sharded_alone", "unit_totals",
]


def sharded_alone(stages: int, micro_batches: int, dp_shard: int, devices: Sequence[DeviceSpec] = ()) -> bool:
    """FSDP alone in one pass — one stage, one micro-batch, sharded: the runtime then makes each
    block it can outline, and each other leaf module it can, a unit of its own, resharded after its forward
    (:func:`~autosplit.runtime.placement.replicate_stage`); otherwise each stage is one unit, gathered
    for the whole step (every micro-batch's backward would gather it again). On ``devices`` whose engine
    gathers its units for every micro-batch (Megatron-FSDP: :attr:`~autosplit.engine_profiles.EngineProfile.units_per_micro_batch`),
    one stage, sharded, whatever the micro-batches; never on an engine whose sharding is Megatron's distributed
    optimizer, which keeps every weight whole."""
    engine = engine_of(devices)
    if engine is not None and engine.distributed_optimizer:
        return False
    per_micro_batch = engine is not None and engine.units_per_micro_batch
    return stages == 1 and (micro_batches == 1 or per_micro_batch) and dp_shard > 1


def gradient_share(devices: Sequence[DeviceSpec], precision: str) -> float:
    """The bytes of a gradient as held and reduced, over those of its fp32 parameter: ½ on an engine reducing bf16
    gradients (:attr:`~autosplit.engine_profiles.EngineProfile.bf16_gradients`) beside fp32 weights (``"bf16-mixed"``,
    ``"bf16-fsdp"``), else 1."""
    engine = engine_of(devices)
    return 0.5 if engine is not None and engine.bf16_gradients and precision in ("bf16-mixed", "bf16-fsdp") else 1.0


FP8_GATHERED = 0.25
"""Bytes of an FP8 weight over its fp32 parameter's: what torchao's ``enable_fsdp_float8_all_gather`` moves."""


def gathered_share(table: CostTable, devices: Sequence[DeviceSpec], precision: str, dp_shard: int, tp: int = 1) -> float:
    """The bytes FSDP's all-gathers move over the fp32 parameters': ½ where FSDP2's policy gathers bf16 copies
    (``"bf16-fsdp"``), else 1; the weights of FP8 linears under tensorwise scaling, which torchao casts before
    FSDP2 gathers them (``enable_fsdp_float8_all_gather``), :data:`FP8_GATHERED`. (A linear's bias, gathered as
    the rest, is counted with its weight: under 0.1% of it at a width of 1,024.) Rowwise scales cannot be
    gathered so; under FSDP2's bf16 policy the runtime gathers bf16 (an FP8 all-gather would cast the fp32
    shards straight to FP8, skipping the policy's cast: another model than the unsplit one under the policy),
    and so are the tp shards of a weight (``tp > 1``); Megatron's engines gather as their profiles say."""
    base = 0.5 if precision in PARAM_CAST else 1.0
    engine = engine_of(devices)
    if table.float8_recipe != "tensorwise" or dp_shard <= 1 or tp > 1 or precision in PARAM_CAST or (
            engine is not None and engine.name.startswith("megatron")):
        return base
    fp8, total = set(table.float8_linears), sum(table.param_bytes)
    in_fp8 = sum(b for b, path in zip(table.param_bytes, table.module_paths) if path in fp8)
    return (base * (total - in_fp8) + FP8_GATHERED * in_fp8) / total if total else base


def laid_out(table: CostTable, *, dp_shard: int, alone: bool = False, precision: str = "fp32") -> CostTable:
    """``table`` with each node's :attr:`~CostTable.state_bytes` and optimizer time as one device
    holds and spends them with its stage sharded over ``dp_shard`` devices (the module docstring);
    ``table`` itself for ``dp_shard = 1`` (but under ``"bf16-fsdp"``). ``alone`` (one stage, one
    micro-batch: FSDP alone): a node whose module is a unit of its own (:attr:`~CostTable.unit_params`)
    holds its parameters and gradients whole only while it runs — its transient: them, and the next
    unit's parameters FSDP2 gathers ahead. ``precision="bf16-fsdp"`` (FSDP2's ``MixedPrecisionPolicy``,
    on every stage whatever the degree): what it gathers is the bf16 copy the table already holds
    (:attr:`~CostTable.weight_copy_bytes`; a unit's only while it runs), and the gradients it
    accumulates whole are fp32."""
    policy = precision in PARAM_CAST
    if (dp_shard <= 1 and not policy) or not table.param_bytes:
        return table
    engine = engine_of(table.devices)
    gradients_whole = engine is not None and engine.distributed_optimizer  # Megatron's: only master weights and moments sharded
    gradient = gradient_share(table.devices, precision)
    n = len(table.nodes)
    copies = table.weight_copy_bytes or (0,) * n
    buffers = table.buffer_bytes or (0,) * n
    units = table.unit_params if alone and table.unit_params else (False,) * n
    totals = unit_totals(table) if any(units) else [0] * n
    transient = list(table.transient_bytes or (0,) * n)
    state = []
    for i, (whole, params, copy, buffer) in enumerate(zip(table.state_bytes, table.param_bytes, copies, buffers)):
        model_state = whole - copy - buffer  # parameters, gradients, optimizer state
        if units[i]:  # gathered (and under the policy in bf16) while the unit runs
            held = buffer + (0 if policy else copy)
            transient[i] = max(transient[i], 3 * totals[i] // (2 if policy else 1))
        else:  # gathered for the step (the distributed optimizer: its weights are the copy), its gradients accumulated whole
            held = buffer + copy + round(params * gradient) + (0 if policy or gradients_whole else params)
        sharded = model_state - (params if gradients_whole and not units[i] else 0)  # its gradient shard is the whole buffer's
        state.append(math.ceil(sharded / dp_shard) + held)
    optimizer = tuple(tuple(t / dp_shard for t in row) for row in table.optimizer_time)
    step = tuple(math.ceil(b / dp_shard) for b in table.step_bytes)  # the optimizer steps the shard each device holds
    return dataclasses.replace(table, state_bytes=tuple(state), optimizer_time=optimizer, step_bytes=step,
                               transient_bytes=tuple(transient) if table.transient_bytes or any(units) else ())


def unit_totals(table: CostTable) -> list[int]:
    """[node] the parameter bytes of the FSDP unit its parameters are in when it is a unit of its own
    (:attr:`~CostTable.unit_params`), else 0: a block's (its nodes by module path,
    :func:`~autosplit.passes.outline.block_path`: one outlined unit), or the node's own (a leaf module)."""
    flags = table.unit_params or (False,) * len(table.nodes)
    keys = [(block_path(path) or i) if flag else None for i, (path, flag) in enumerate(zip(table.module_paths, flags))]
    sums: dict[object, int] = {}
    for key, params in zip(keys, table.param_bytes):
        if key is not None:
            sums[key] = sums.get(key, 0) + params
    return [sums[key] if key is not None else 0 for key in keys]


def group_time(nbytes: float, size: int, device: DeviceSpec, *, allreduce: bool) -> float:
    """Seconds to all-reduce (``allreduce``) or to all-gather / reduce-scatter ``nbytes`` (the whole
    tensor's) over ``size`` consecutive ranks of ``device``'s kind: a ring inside an island, or
    inside each island and then across them (the module docstring)."""
    if size <= 1:
        return 0.0
    local = min(size, device.group_island or size)
    if local == size or size % local:
        bandwidth, latency = device.allreduce_link(device)
        ring = (size - 1) / size * nbytes / bandwidth + (size - 1) * latency
        return 2 * ring if allreduce else ring
    inside, across = hierarchical_phases(nbytes, local=local, nodes=size // local, intra=device.allreduce_link(device),
                                         inter=(device.network_bandwidth, device.network_latency))
    return inside + across if allreduce else (inside + across) / 2


def data_parallel_time(
    param_bytes: Sequence[float], devices: Sequence[DeviceSpec], *, replicas: int, shards: int,
    waits: Sequence[float], drains: Sequence[float], units: Sequence[float] = (), compute: Sequence[float] = (),
    gathered: float = 1.0, reduced: float = 1.0, passes: int = 1,
) -> float:
    """Seconds per step the data-parallel collectives add to the pipeline's step (the module
    docstring): ``param_bytes[s]`` the parameters of stage ``s`` as held, ``waits[s]`` the seconds
    stage ``s`` waits for its first input, ``drains[s]`` the seconds after its last backward that
    the step goes on without it. ``units[s]``: of its parameters, those in units of their own (FSDP
    alone), each gathered for its forward and again for its backward and reduced after it, all of it
    behind the stage's ``compute[s]`` where FSDP2's prefetching can hide it. ``gathered``: the share
    of those bytes an all-gather moves (½ under ``"bf16-fsdp"``, which gathers bf16 and reduces fp32); ``reduced``: the
    share a reduction moves (½ on an engine reducing bf16 gradients); ``passes``: how often the units go through their
    three collectives (every micro-batch's on an engine that gathers them per micro-batch, Megatron-FSDP)."""
    if replicas * shards <= 1:
        return 0.0
    if shards == 1:
        return max(max(0.0, group_time(p * reduced, replicas, d, allreduce=True) - drain)
                   for p, d, drain in zip(param_bytes, devices, drains))
    units = units or [0.0] * len(param_bytes)
    rest = [p - u for p, u in zip(param_bytes, units)]
    gather = max(max(0.0, group_time(p * gathered, shards, d, allreduce=False) - wait) for p, d, wait in zip(rest, devices, waits))
    reduce = max(
        max(0.0, group_time(p * reduced, shards, d, allreduce=False) + _across_replicas(p * reduced / shards, replicas, d) - drain)
        for p, d, drain in zip(rest, devices, drains)
    )
    overlapped = max((max(0.0, passes * (2 * group_time(u * gathered, shards, d, allreduce=False)
                                         + group_time(u * reduced, shards, d, allreduce=False)
                                         + _across_replicas(u * reduced / shards, replicas, d)) - c)
                      for u, d, c in zip(units, devices, compute or [0.0] * len(units)) if u), default=0.0)
    return gather + reduce + overlapped


def _across_replicas(nbytes: float, replicas: int, device: DeviceSpec) -> float:
    """The all-reduce of a shard over ``dp_replicate`` copies: each a whole dp_shard group apart,
    across islands where the groups fill them (HSDP)."""
    if replicas <= 1:
        return 0.0
    return ring_allreduce(nbytes, replicas, device.network_bandwidth, device.network_latency)
