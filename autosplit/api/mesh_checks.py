"""What :func:`~autosplit.api.distributed.distribute` checks before any work, on every rank alike: its
arguments (the degrees, ``replicate``, the schedule) and the process group against the mesh the devices or
a given plan make (the devices are the whole mesh: one rank each).

Usage::

    data_parallel, replicate = degrees(given, data_parallel, replicate)
    check_arguments(replicate, data_parallel, schedule)
    shard = check_mesh(given, len(devices), data_parallel, replicate)
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from autosplit import schedules
from autosplit.errors import ConstraintError, DeviceError, DistributedError, advice
from autosplit.plans import Plan

__all__ = ["REPLICATE", "check_arguments", "check_mesh", "check_replicate", "degrees", "runnable"]


def degrees(given: Plan | None, data_parallel: int | None, replicate: str | None) -> tuple[Any, Any]:
    """``data_parallel`` and ``replicate``, where not given, from a given plan made for data-parallel
    copies (its mesh), else 1 and ``"replicate"``."""
    if given is not None and given.data_parallel > 1:
        data_parallel = given.data_parallel if data_parallel is None else data_parallel
        replicate = ("fully_shard" if given.dp_shard > 1 else "replicate") if replicate is None else replicate
    return (1 if data_parallel is None else data_parallel), ("replicate" if replicate is None else replicate)


def runnable() -> tuple[list[str], str]:
    """The schedules ``distribute`` runs, and those of them torch's pipelining runs, as words."""
    runnable = [name for name in schedules.SCHEDULES if schedules.REGISTRY[name].distributed]
    return runnable, " and ".join(name for name in runnable if schedules.REGISTRY[name].torch_class is not None)


REPLICATE = ("replicate", "fully_shard")
"""``distribute(replicate=...)``'s values: torch's names for the FSDP2 API that keeps the replicas in step."""
_FORMER = {"ddp": "replicate", "fsdp": "fully_shard"}


def check_replicate(replicate: Any) -> None:
    """Refuse a ``replicate=`` that is not one of torch's names (:data:`REPLICATE`): the former
    ``"ddp"`` / ``"fsdp"`` with the name that replaced each, anything else with both."""
    if replicate in REPLICATE:
        return
    if isinstance(replicate, str) and replicate.lower() in _FORMER:
        new = _FORMER[replicate.lower()]
        raise ConstraintError(advice(
            f"replicate={replicate!r} is a former name",
            f"distribute takes torch's names for what runs: {new!r} (FSDP2's {new}) replaced {replicate!r}",
            f"pass replicate={new!r} (the values are {' and '.join(map(repr, REPLICATE))})",
        ))
    raise ConstraintError(advice(
        f"replicate={replicate!r} is not supported",
        "replicas are kept in step by FSDP2's replicate (whole parameters, gradients all-reduced) or fully_shard (sharded)",
        f"pass replicate={REPLICATE[0]!r} or {REPLICATE[1]!r}",
    ))


def check_arguments(replicate: str, data_parallel: Any, schedule: str | None) -> None:
    """Refuse, before any work, a process group that cannot run the split and arguments out of range
    (``schedule``: the one asked for when no plan is given); ``replicate`` first, which needs no process group."""
    check_replicate(replicate)
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            advice("autosplit.distribute needs an initialised process group", "torch.distributed is not initialised in this process",
                   "call torch.distributed.init_process_group('gloo' or 'nccl') first, e.g. under torchrun")
        )
    if not isinstance(data_parallel, int) or data_parallel < 1:
        raise ConstraintError(advice(
            f"data_parallel={data_parallel!r} is out of range",
            "it counts replicas of the pipeline",
            "pass an integer ≥ 1",
        ))
    if schedule is None:
        return
    try:
        asked: schedules.Schedule | None = schedules.lookup(schedule)
    except ConstraintError:
        asked = None
    if asked is not None:  # torch's schedules autosplit cannot run yet are refused as such, before any work
        asked.require_runnable(f"schedule={schedule!r}")
    if asked is None or not asked.distributed:
        runs, on_torch = runnable()
        raise ConstraintError(advice(
            f"schedule={schedule!r} cannot run pipelined",
            f"torch.distributed.pipelining runs {on_torch}, and autosplit's own loop the asynchronous ones",
            f"pass one of {runs}",
        ))


def check_mesh(given: Plan | None, devices: int | None, data_parallel: int, replicate: str) -> int:
    """The ``dp_shard`` degree of the mesh to run (:attr:`~autosplit.plans.Plan.mesh`); refused on every
    rank alike, before any work, unless the process group has one rank per device (``devices``: how many
    were given, the whole mesh; None: a given plan's) and a ``given`` plan's mesh has as many
    (:class:`DistributedError`), and a ``given`` plan made for data-parallel copies was made for these
    degrees (:class:`ConstraintError`); a plan made for one copy runs under the arguments' degrees. HSDP
    (both degrees above 1) comes from a given plan only."""
    shard = data_parallel if replicate == "fully_shard" else 1
    if given is not None and given.data_parallel > 1:
        if given.data_parallel != data_parallel or (given.dp_shard > 1) != (replicate == "fully_shard" and data_parallel > 1):
            made_for = "fully_shard" if given.dp_shard > 1 else "replicate"
            raise ConstraintError(advice(
                f"the plan was made for the mesh {given.mesh} (data_parallel={given.data_parallel}, replicate={made_for!r}), "
                f"but distribute was given data_parallel={data_parallel}, replicate={replicate!r}",
                "a plan records the data-parallel degrees it was costed for",
                f"pass data_parallel={given.data_parallel}, replicate={made_for!r}, or re-plan for these degrees",
            ))
        shard = given.dp_shard
    world = dist.get_world_size()
    if given is not None:
        mesh = {"pp": len(given.devices), "dp_replicate": data_parallel // shard, "dp_shard": shard, "tp": given.tensor_parallel}
        needed = math.prod(mesh.values())
        if world != needed or devices not in (None, needed):
            raise DistributedError(advice(
                f"the process group has {world} ranks{f' and {devices} devices were given' if devices is not None else ''}, "
                f"but the plan needs pp × dp_replicate × dp_shard × tp = {' × '.join(str(d) for d in mesh.values())} = {needed}",
                "each rank runs one stage of one data-parallel copy, at one place of the mesh ('pp', 'dp_replicate', 'dp_shard', 'tp')",
                f"launch {needed} processes (torchrun --nproc-per-node {needed}) with devices=None or {needed} devices, "
                "or pass another plan" + (" or data_parallel" if given.data_parallel == 1 else ""),
            ))
    elif devices is None:
        raise DeviceError(advice("devices=None needs a plan to take the devices from", "no plan was given",
                                 f"pass the mesh's {world} devices (e.g. ['cpu'] * {world}), or plan=..."))
    elif world != devices:
        raise DistributedError(advice(
            f"the process group has {world} ranks, but {devices} devices were given",
            "devices are the whole mesh: world size = len(devices) = pp × data_parallel × tensor_parallel, the planner "
            f"choosing pp = {devices} / (data_parallel {data_parallel} × tensor_parallel)",
            f"pass {world} devices (e.g. ['cpu'] * {world}), or launch {devices} processes (torchrun --nproc-per-node {devices})",
        ))
    return shard
