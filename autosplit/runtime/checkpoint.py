"""Layout-free checkpoints: model and optimizer state, flat and keyed by the model's own names.

A checkpoint is a ``torch.distributed.checkpoint`` folder of entries ``model.<fqn>`` (the
model's ``state_dict``) and ``optimizer.<fqn>.<key>`` (each parameter's optimizer state, and its
group's hyper-parameters, under the parameter's qualified name). Nothing in it says how the model
was split, so a checkpoint written by one plan's stages loads under another plan — another cut,
another number of stages or replicas — and into the unsplit model: each process reads only the
entries of the tensors it holds.

Saving goes to a fresh folder beside the target, renamed over it only once every process has
written its part: a failed save leaves the last good checkpoint where it was.

Usage::

    pipe.save("ckpt", optimizer=opt)                    # every rank; DistributedModel.save
    pipe.load("ckpt", optimizer=opt)                    # under this plan or another
    save_checkpoint("ckpt", model, opt)                 # the unsplit model, one process
    load_checkpoint("ckpt", model, opt)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autosplit.errors import ConstraintError, DistributedError, advice

__all__ = ["StageState", "load_checkpoint", "load_entries", "open_dcp", "read_into", "save_checkpoint", "save_entries",
           "single_process_dcp", "state_entries"]


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """DCP without its warning that it runs in one process: here every rank reads (or the unsplit
    model writes) its own entries alone, on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning)
        yield


def state_entries(
    state: Mapping[str, Any], params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
) -> dict[str, Any]:
    """The flat entries of a model's ``state`` and of ``optimizer``'s state for ``params`` (FQN → parameter)."""
    out: dict[str, Any] = {f"model.{k}": v for k, v in state.items()}
    if optimizer is None:
        return out
    fqn = {id(p): name for name, p in params.items()}
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            if id(p) not in fqn:
                raise ConstraintError(advice(
                    "the optimizer holds a parameter the model does not have",
                    "it was made for another model (or for the model before distribute split it)",
                    "make the optimizer from pipe.parameters()",
                ))
            name = fqn[id(p)]
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"optimizer.{name}.state.{k}"] = v
            for k, v in hyper.items():
                number = _as_tensor(v)
                if number is not None:
                    out[f"optimizer.{name}.group.{k}"] = number
    return out


def _as_tensor(value: Any) -> torch.Tensor | None:
    """A hyper-parameter that is a number or a tuple of numbers (``lr``, ``betas``) as a float64
    tensor; None for flags and names, which the optimizer the user builds already holds."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if number(value):
        return torch.tensor(float(value), dtype=torch.float64)
    if isinstance(value, tuple) and value and all(number(v) for v in value):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    return None


def save_entries(path: str | os.PathLike, entries: dict[str, Any], *, distributed: bool) -> Path:
    """Write ``entries`` as a DCP checkpoint at ``path`` through a fresh sibling folder, renamed over
    ``path`` once complete (``distributed``: every rank of the process group calls it, collectively)."""
    import torch.distributed.checkpoint as dcp

    target = Path(path).resolve()
    token = [uuid.uuid4().hex[:12]]
    if distributed:
        dist.broadcast_object_list(token, src=0)
    fresh = target.with_name(f".{target.name}.saving-{token[0]}")
    try:
        with single_process_dcp():
            dcp.save(entries, checkpoint_id=fresh, no_dist=not distributed)
    except Exception as e:
        shutil.rmtree(fresh, ignore_errors=True)
        raise DistributedError(advice(
            f"saving the checkpoint {target} failed: {type(e).__name__}: {e}",
            "a process could not write its part (disk full, permissions, a peer that failed)",
            f"fix the cause and save again; the last checkpoint at {target}, if any, is untouched",
        )) from e
    if distributed:
        dist.barrier()
    if not distributed or dist.get_rank() == 0:
        old = target.with_name(f".{target.name}.old-{token[0]}")
        if target.exists():
            target.rename(old)
        fresh.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    if distributed:
        dist.barrier()
    return target


def load_entries(
    path: str | os.PathLike, state: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None, *, strict: bool = True, optional: Mapping[str, torch.Tensor] | None = None,
) -> set[str]:
    """Read into ``state`` (FQN → this process's tensors, loaded in place) and ``optimizer`` the
    entries of a checkpoint that are theirs — no other entry is read, and no collective runs —
    and into ``optional`` (entry key → tensor) those of its entries the checkpoint holds; returns
    the keys of ``optional`` it read."""
    folder = Path(path)
    if not (folder / ".metadata").exists():
        raise ConstraintError(advice(
            f"{folder} is not a checkpoint (no .metadata file)", "pipe.load reads what pipe.save (DCP) wrote",
            "pass the folder pipe.save or save_checkpoint wrote",
        ))
    reader, stored = open_dcp(folder)
    wanted: dict[str, Any] = {f"model.{k}": v for k, v in state.items()}
    missing = sorted(k[len("model."):] for k in wanted if k not in stored)
    wrong = [f"{k[len('model.'):]}: {tuple(stored[k].size)} saved, {tuple(v.shape)} here" for k, v in wanted.items()
             if k in stored and tuple(stored[k].size) != tuple(v.shape)]
    if (missing and strict) or wrong:
        raise ConstraintError(advice(
            f"the checkpoint {folder} " + (f"lacks {len(missing)} entries this process holds (first: {missing[:5]})" if missing else "")
            + ("; " if missing and wrong else "") + (f"holds {len(wrong)} tensors of another shape ({wrong[:3]})" if wrong else ""),
            "it was saved from another model or configuration", "load a checkpoint of this model, or pass strict=False for missing entries",
        ))
    wanted = {k: v for k, v in wanted.items() if k in stored}
    present = {k: v for k, v in (optional or {}).items() if k in stored}
    slots = _optimizer_slots(optimizer, params, stored) if optimizer is not None else {}
    read_into(reader, {**wanted, **slots, **present})
    if optimizer is not None:
        _set_optimizer(optimizer, params, slots)
    return set(present)


def open_dcp(folder: Path) -> tuple[Any, dict[str, Any]]:
    """A reader of the DCP checkpoint in ``folder``, and its tensor entries' metadata (key → size, dtype)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    stored = reader.read_metadata().state_dict_metadata
    return reader, {k: m for k, m in stored.items() if isinstance(m, TensorStorageMetadata)}


def read_into(reader: Any, state: dict[str, torch.Tensor]) -> None:
    """Load ``state``'s entries in place, in this process alone: the ranks' key sets differ, and a
    rank that fails must not leave the others waiting in a collective load."""
    import torch.distributed.checkpoint as dcp

    with single_process_dcp():
        dcp.load(state, storage_reader=reader, planner=dcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=True)


def _optimizer_slots(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor], stored: Mapping[str, Any]) -> dict[str, Any]:
    """A target for every saved optimizer entry of ``params``: a tensor shaped like the parameter
    (a DTensor for a sharded one) for its state, else as saved (a step count, a hyper-parameter)."""
    slots: dict[str, Any] = {}
    absent = []
    for name, p in params.items():
        keys = [k for k in stored if k.startswith(f"optimizer.{name}.")]
        if not keys:
            absent.append(name)
        for k in keys:
            meta = stored[k]
            if tuple(meta.size) == tuple(p.shape) and k.startswith(f"optimizer.{name}.state."):
                slots[k] = torch.zeros_like(p, dtype=meta.properties.dtype)
            else:
                slots[k] = torch.zeros(meta.size, dtype=meta.properties.dtype)
    if absent:
        raise ConstraintError(advice(
            f"the checkpoint holds no optimizer state for {len(absent)} parameters (first: {absent[:5]})",
            "it was saved without optimizer=, or from another model",
            "save with pipe.save(path, optimizer=opt), or load without optimizer=",
        ))
    return slots


def _set_optimizer(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor], slots: Mapping[str, Any]) -> None:
    fqn = {id(p): name for name, p in params.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = f"optimizer.{fqn[id(p)]}."
            entries = {k[len(prefix):]: v for k, v in slots.items() if k.startswith(prefix)}
            state = {k[len("state."):]: v for k, v in entries.items() if k.startswith("state.")}
            if state:
                optimizer.state[p] = state
            for k, v in entries.items():
                key = k[len("group."):]
                if k.startswith("group.") and key in group:
                    old = group[key]
                    group[key] = tuple(type(o)(x) for o, x in zip(old, v.tolist())) if isinstance(old, tuple) else type(old)(v.item())


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Path:
    """The unsplit ``model`` (and ``optimizer``) as a checkpoint any plan's stages load, from one process."""
    return save_entries(path, state_entries(model.state_dict(), dict(model.named_parameters()), optimizer), distributed=False)


def load_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, strict: bool = True,
) -> None:
    """A checkpoint written by any plan's stages (or :func:`save_checkpoint`) into the unsplit ``model`` and ``optimizer``."""
    state = model.state_dict()  # tensors sharing the model's storage: loaded in place
    with torch.no_grad():
        load_entries(path, state, dict(model.named_parameters()), optimizer, strict=strict)


class StageState:
    """A stage's parameters and state under the model's own names, and its checkpoints: the part of
    :class:`~autosplit.runtime.distributed.DistributedModel` that reads and writes weights."""

    module: torch.nn.Module
    layout: Any
    _param_names: dict[str, str]
    _state_names: dict[str, str]
    scaler: Any
    """The fp16 loss scaler (:class:`~autosplit.runtime.precision.LossScaler`), or None."""
    _aliases: dict[str, tuple[str, ...]]
    """A tensor several of this rank's stages hold (a tied weight on both arms of a V): the local
    name it is read and written by → its copies' local names, kept equal to it."""

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under the model's own qualified names, in the model's order (a
        parameter two of its stages hold: once, by its first copy)."""
        own = dict(self.module.named_parameters(remove_duplicate=False))
        return ((name, own[local]) for name, local in self._param_names.items())

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """Every parameter this rank trains — give them all to the optimizer: a tied weight two of its
        stages hold is one copy per stage, both with the summed gradient, so both take the same step."""
        own = dict(self.module.named_parameters(remove_duplicate=False))
        for local in self._param_names.values():
            yield own[local]
            yield from (own[copy] for copy in self._aliases.get(local, ()))

    def _copy_to_aliases(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Give each copy of a tensor two stages hold the first copy's value and optimizer state."""
        own = {**dict(self.module.named_parameters(remove_duplicate=False)), **dict(self.module.named_buffers(remove_duplicate=False))}
        with torch.no_grad():
            for first, copies in self._aliases.items():
                for name in copies:
                    own[name].copy_(own[first])
                    if optimizer is not None and own[first] in optimizer.state:
                        optimizer.state[own[name]] = {
                            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[own[first]].items()
                        }

    def state_dict(self) -> dict[str, Any]:
        """This stage's entries of the model's ``state_dict``, under the model's names (a tied
        weight under each of its names, as the model lists it). DTensors when replicated with
        FSDP2; :meth:`full_state_dict` gathers plain tensors."""
        own = self.module.state_dict()
        return {name: own[local] for name, local in self._state_names.items()}

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load this stage's entries from a whole model's ``state_dict`` (or a stage's)."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        if strict and missing:
            raise DistributedError(
                advice(
                    f"state dict lacks {len(missing)} entries of stages {list(self.layout.held)} (first: {missing[:3]})",
                    "it was saved from another model or another version of it",
                    "save it from this model (its state_dict() or full_state_dict()), or pass strict=False",
                )
            )
        with torch.no_grad():
            for name, value in own.items():
                if name in state:
                    _copy_into(value, state[name])
        self._copy_to_aliases()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state (every stage of replica 0, each tensor whole: gathered over FSDP2's shards
        and the tp ranks) on every rank, in CPU memory, under the model's names:
        ``unsplit.load_state_dict(pipe.full_state_dict())`` works."""
        mine = {k: _full(v).detach().cpu() for k, v in self.state_dict().items()}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine if self.layout.replica == 0 and self.layout.tp_rank == 0 else None)
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part or {})
        return merged

    def save(self, path: str | os.PathLike, *, optimizer: torch.optim.Optimizer | None = None) -> Path:
        """Collective (every rank): the model's state and ``optimizer``'s as one layout-free checkpoint
        at ``path`` (module docstring), which any plan's stages or the unsplit model load; with an
        fp16 loss scaler, its state too (``scaler.<key>``, the same on every rank)."""
        entries = state_entries(self.state_dict(), dict(self.named_parameters()), optimizer)
        if self.scaler is not None:
            entries.update({f"scaler.{k}": torch.tensor(float(v), dtype=torch.float64) for k, v in self.scaler.state_dict().items()})
        return save_entries(path, entries, distributed=True)

    def load(self, path: str | os.PathLike, *, optimizer: torch.optim.Optimizer | None = None, strict: bool = True) -> None:
        """This stage's entries of a checkpoint written under any plan (or by :func:`save_checkpoint`),
        into its parameters, buffers and ``optimizer``; each rank reads only its own entries. A loss
        scaler takes the saved one's state where the checkpoint has one (else it keeps its own)."""
        keys = self.scaler.state_dict() if self.scaler is not None else {}
        scaler = {f"scaler.{k}": torch.zeros((), dtype=torch.float64) for k in keys}
        with torch.no_grad():
            read = load_entries(path, self.state_dict(), dict(self.named_parameters()), optimizer, strict=strict, optional=scaler)
        self._copy_to_aliases(optimizer)
        if self.scaler is not None and read == set(scaler):
            self.scaler.load_state_dict({k[len("scaler."):]: v.item() for k, v in scaler.items()})


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (collective: every rank of its mesh must call it); a tensor as is."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a whole value into a tensor or into this rank's part of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        part = distribute_tensor(value.to(target.device, target.dtype), target.device_mesh, target.placements)
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(value)
