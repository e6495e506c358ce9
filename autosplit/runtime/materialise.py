"""Materialisation: this rank's stage made real, and nothing else of the model.

The stages are cut from a copy of the model on the meta device, so a stage module holds meta
tensors under its own (local) names; :class:`StageNames` maps the model's qualified names (FQNs)
to them. :func:`materialise` then gives the stage real tensors, from one of:

- the user's real model: the stage, cut from the model's own capture, already holds the model's
  tensors (no copy; what it does not use stays the caller's, and autosplit keeps no reference to it);
- a checkpoint, read by name — only this stage's keys: a ``torch.distributed.checkpoint``
  directory, a ``torch.save``d state dict (memory-mapped), a folder of ``safetensors`` files (as
  ``save_pretrained`` writes them, sharded with an index), or a mapping;
- an init function ``init(stage_module)``;
- by default, each module that owns the stage's tensors initialised alone, as the model's classes
  say: ``module.reset_parameters()``, then ``model._init_weights(module)`` where the model has one
  (transformers' convention), seeded by the module's name, so that every rank materialising it (the stages that share a tied
  weight, the data-parallel replicas of a stage) gets the same values. Non-persistent buffers
  (rotary tables, causal masks) are not in checkpoints: they are recomputed this way too.

Every write is recorded (:class:`WriteRecorder`): a tensor of the stage that nothing wrote is a
typed error naming it, never garbage trained on. torchtitan's pattern (meta build → per-stage
module with the original FQNs → ``to_empty`` → init or DCP load), planned rather than hand-written.
"""

from __future__ import annotations

import copy
import json
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autosplit.compat import TorchDispatchMode, pytree
from autosplit.errors import ConstraintError, DistributedError, advice
from autosplit.runtime.checkpoint import open_dcp, read_into
from autosplit.shapes import is_meta

__all__ = ["StageNames", "WeightsLike", "WriteRecorder", "agree_by_name", "materialise", "read_checkpoint"]

WeightsLike = str | os.PathLike | Mapping[str, torch.Tensor] | Callable[[torch.nn.Module], None] | None
"""Where a meta model's stage gets its values: a checkpoint path, a state dict, an ``init(module)``, or None (default init)."""


@dataclass(frozen=True)
class StageNames:
    """The model's names for one stage's tensors."""

    tensors: dict[str, str]
    """Every FQN of a parameter or buffer the stage holds (non-persistent buffers included; a tied
    weight under each of its names) → its name in the stage module."""
    state: dict[str, str]
    """The stage's entries of the model's ``state_dict`` → local names."""
    params: dict[str, str]
    """The stage's parameters, in the model's order → local names."""

    @classmethod
    def of(cls, model: torch.nn.Module, stage: torch.nn.Module) -> StageNames:
        """Names by identity: ``stage`` must hold ``model``'s own tensors (it was cut from it)."""
        local = {id(t): name for name, t in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]}

        def mine(pairs: Iterable[tuple[str, Any]]) -> dict[str, str]:
            return {k: local[id(t)] for k, t in pairs if id(t) in local}

        return cls(
            tensors=mine([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]),
            state=mine(model.state_dict(keep_vars=True).items()),
            params=mine(model.named_parameters()),
        )

    @classmethod
    def merged(cls, parts: Mapping[int, StageNames]) -> tuple[StageNames, dict[str, tuple[str, ...]]]:
        """One rank's stages as one container (``ModuleDict`` keyed by stage index): their names,
        prefixed with the stage's key; a tensor several of them hold (a tied weight on both arms of a
        V) is named by the first, and its copies in the others come back as aliases: the first's
        local name → the copies' local names."""
        tensors: dict[str, str] = {}
        state: dict[str, str] = {}
        params: dict[str, str] = {}
        aliases: dict[str, list[str]] = {}
        for s, names in parts.items():
            for mine, theirs in ((tensors, names.tensors), (state, names.state), (params, names.params)):
                for fqn, local in theirs.items():
                    here = f"{s}.{local}"
                    if fqn not in mine:
                        mine[fqn] = here
                    elif mine is tensors and here not in aliases.get(mine[fqn], ()):
                        aliases.setdefault(mine[fqn], []).append(here)
        return cls(tensors, state, params), {k: tuple(v) for k, v in aliases.items()}

    def fqns(self) -> dict[str, list[str]]:
        """Local name → every FQN the model has for it, in the model's order."""
        out: dict[str, list[str]] = {}
        for fqn, local in self.tensors.items():
            out.setdefault(local, []).append(fqn)
        return out


class WriteRecorder(TorchDispatchMode):
    """Records the storages every eager op writes into (by the op's schema), to tell which of a
    stage's freshly allocated tensors were filled."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[StorageWeakRef] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    for t in pytree.tree_leaves(value):
                        if isinstance(t, torch.Tensor):
                            self.written.add(StorageWeakRef(t.untyped_storage()))
        return func(*args, **kwargs)

    def wrote(self, t: torch.Tensor) -> bool:
        return StorageWeakRef(t.untyped_storage()) in self.written


def _tensor(module: torch.nn.Module, local: str) -> torch.Tensor:
    owner, _, name = local.rpartition(".")
    sub = module.get_submodule(owner)
    return sub._parameters[name] if name in sub._parameters else sub._buffers[name]  # type: ignore[return-value]


def materialise(
    stage: torch.nn.Module, names: StageNames, device: torch.device, *, model: torch.nn.Module, weights: WeightsLike, seed: int = 0,
) -> str:
    """Give ``stage`` (meta tensors) real ones on ``device``; returns how, in words.

    ``model``: the user's model — when real, the stage already holds its tensors (``weights`` must be None);
    when on the meta device, ``weights`` says where the values come from (module docstring).
    """
    fqns = names.fqns()
    if not is_meta(model):
        if weights is not None:
            raise ConstraintError(advice(
                "weights= was given for a model whose weights are already real",
                "weights= fills a model built on the meta device, stage by stage",
                "build the model under `with torch.device('meta'):`, or leave weights= out",
            ))
        return "the model's own tensors"  # the stage was cut from the model's capture: they are its tensors
    stage.to_empty(device=device)
    recorder = WriteRecorder()
    with torch.no_grad(), recorder:
        if callable(weights):
            weights(stage)
            how = f"init function {getattr(weights, '__name__', repr(weights))}"
        else:
            missing = dict(fqns)
            if weights is not None:
                loaded = _load(stage, fqns, weights)
                persistent = set(names.state.values())
                lacking = [names_of[0] for local, names_of in fqns.items() if local in persistent and local not in loaded]
                if lacking:
                    raise ConstraintError(advice(
                        f"{_source(weights)} lacks {len(lacking)} entries this stage needs (first: {lacking[:5]})",
                        "it was saved from another model or configuration, or its names differ from the model's",
                        "load a checkpoint of this model (its state_dict, saved with torch.save, DCP or save_pretrained)",
                    ))
                # Non-persistent buffers are in no checkpoint: their modules compute them.
                missing = {local: names_of for local, names_of in fqns.items() if local not in loaded}
            _default_init(stage, missing, model, seed)
            how = _source(weights) if weights is not None else "each module's own init"
    blank = [names_of[0] for local, names_of in fqns.items() if not recorder.wrote(_tensor(stage, local))]
    if blank:
        raise ConstraintError(advice(
            f"{len(blank)} tensors of this stage were never given a value (first: {blank[:5]})",
            f"materialising from {how}: "
            + ("the init function does not write them" if callable(weights)
               else "their modules have no reset_parameters() (nor a transformers _init_weights) that fills them"),
            "pass weights= a checkpoint that holds them, or an init(module) that fills every parameter and buffer",
        ))
    return how


def agree_by_name(stage: torch.nn.Module, names: StageNames) -> None:
    """Collective: every rank that holds a tensor under the same name holds the same values (the
    stages sharing a tied weight, the replicas of a stage); a :class:`DistributedError` on every
    rank names the first that differ."""
    import torch.distributed as dist

    with torch.no_grad():
        mine = {fqns[0]: f"{float(_tensor(stage, local).double().sum()):.6g}" for local, fqns in names.fqns().items()}
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    differ = sorted({fqn for part in seen for fqn, value in part.items()
                     if any(other.get(fqn, value) != value for other in seen)})
    if differ:
        holders = {fqn: [r for r, part in enumerate(seen) if fqn in part] for fqn in differ[:3]}
        raise DistributedError(advice(
            f"{len(differ)} tensors differ between the ranks that hold them (first: {holders})",
            "the ranks built or initialised the model differently (another seed, another checkpoint, an init that draws "
            "different random numbers on each rank)",
            "seed the model's construction the same on every rank, load one checkpoint, or pass an init that is deterministic",
        ))


def _source(weights: Any) -> str:
    return "the state dict given as weights=" if isinstance(weights, Mapping) else f"the checkpoint {weights}"


# -- checkpoints, read by name -----------------------------------------------------------------------


def _load(stage: torch.nn.Module, fqns: Mapping[str, list[str]], weights: str | os.PathLike | Mapping[str, torch.Tensor]) -> set[str]:
    """Fill the stage's tensors from what ``weights`` holds under any of their names; the local names filled."""
    targets = {fqn: _tensor(stage, local) for local, names_of in fqns.items() for fqn in names_of}
    wrong: list[str] = []
    found = read_checkpoint(weights, targets, wrong)
    if wrong:
        raise ConstraintError(advice(
            f"{len(wrong)} tensors of {_source(weights)} "
            f"have the wrong shape: {wrong[:3]}",
            "the checkpoint was saved from another model or configuration",
            "load a checkpoint of this model (its state_dict saved with torch.save, DCP or save_pretrained)",
        ))
    return {local for local, names_of in fqns.items() if found & set(names_of)}


def read_checkpoint(
    weights: str | os.PathLike | Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor], wrong: list[str],
) -> set[str]:
    """Copy into ``targets`` (FQN → tensor) the entries the checkpoint holds, read by name, one
    tensor at a time (a DCP checkpoint straight into them): no other entry is read, and at most
    one entry is held beside its target. Returns the names found; a shape that differs is listed
    in ``wrong`` and not copied."""
    def fill(key: str, value: torch.Tensor) -> bool:
        target = targets[key]
        if tuple(value.shape) != tuple(target.shape):
            wrong.append(f"{key}: {tuple(value.shape)} in the checkpoint, {tuple(target.shape)} in the model")
            return False
        target.copy_(value)
        return True

    if isinstance(weights, Mapping):
        return {k for k, v in weights.items() if k in targets and fill(k, v)}
    path = Path(weights)
    if path.is_dir() and (path / ".metadata").exists():
        return _read_dcp(path, targets, wrong)
    if path.is_dir():
        return {k for k, v in _safetensors(path, set(targets)) if fill(k, v)}
    if path.is_file():
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            raise ConstraintError(advice(
                f"cannot read the checkpoint {path}: {type(e).__name__}: {e}",
                "it is not a state dict saved with torch.save", "pass a torch.save(model.state_dict()) file, a DCP or safetensors folder",
            )) from e
        if not isinstance(state, Mapping):
            raise ConstraintError(advice(
                f"the checkpoint {path} holds a {type(state).__name__}, not a state dict", "weights= reads tensors by name",
                "save model.state_dict(), not the model",
            ))
        return {k for k, v in state.items() if k in targets and fill(k, v)}  # memory-mapped: only these entries are read
    raise ConstraintError(advice(
        f"weights={str(weights)!r} is neither a file nor a folder", "the path is wrong",
        "pass a torch.save file, a torch.distributed.checkpoint folder or a folder of safetensors files",
    ))


def _read_dcp(path: Path, targets: Mapping[str, torch.Tensor], wrong: list[str]) -> set[str]:
    reader, stored = open_dcp(path)
    # A plain state dict saved with DCP is keyed by FQN; a checkpoint of DistributedModel.save by "model.<fqn>".
    prefix = "model." if not set(targets) & set(stored) and any(k.startswith("model.") for k in stored) else ""
    state, seen = {}, set()
    for key, target in targets.items():
        meta = stored.get(prefix + key)
        if meta is None or id(target) in seen:
            continue
        if tuple(meta.size) != tuple(target.shape):
            wrong.append(f"{key}: {tuple(meta.size)} in the checkpoint, {tuple(target.shape)} in the model")
            continue
        seen.add(id(target))  # a tied weight: loaded once, under its first name
        state[prefix + key] = target
    read_into(reader, state)
    loaded = {id(t) for t in state.values()}
    return {key for key, target in targets.items() if id(target) in loaded}


def _safetensors(path: Path, keys: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``keys``' entries of a folder of safetensors files (an index names each key's file), one at a time."""
    from safetensors import safe_open

    index = next(iter(sorted(path.glob("*.safetensors.index.json"))), None)
    files: dict[str, list[str]] = {}
    if index is not None:
        for key, file in json.loads(index.read_text())["weight_map"].items():
            if key in keys:
                files.setdefault(file, []).append(key)
    else:
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise ConstraintError(advice(
                f"the folder {path} holds no checkpoint (no .metadata, no *.safetensors)", "weights= reads one of those",
                "pass the folder save_pretrained or torch.distributed.checkpoint.save wrote, or a torch.save file",
            ))
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                files[shard.name] = [k for k in f.keys() if k in keys]
    for file, names in files.items():
        with safe_open(str(path / file), framework="pt") as f:
            for key in names:
                yield key, f.get_tensor(key)


# -- default init: each owning module alone, seeded by its name ------------------------------------


def _default_init(stage: torch.nn.Module, missing: Mapping[str, list[str]], model: torch.nn.Module, seed: int) -> None:
    """Fill ``missing`` (local name → FQNs) by initialising each module that owns one, alone: a
    copy of it holding only its own tensors on the CPU, ``model._init_weights`` (transformers) or
    its ``reset_parameters()`` then the model's ``_init_weights(module)`` (the transformers
    convention) when it has one, under a seed from its name; what they wrote is copied in."""
    owners: dict[str, dict[str, str]] = {}
    for local, names_of in missing.items():
        owner, _, name = names_of[0].rpartition(".")
        owners.setdefault(owner, {})[name] = local
    hf_init = getattr(model, "_init_weights", None)
    for owner, tensors in owners.items():
        module = model.get_submodule(owner)
        alone = _alone(module)
        recorder = WriteRecorder()
        state = torch.random.get_rng_state()
        torch.manual_seed((seed + zlib.crc32(owner.encode())) % 2**63)
        try:
            with recorder:
                if callable(reset := getattr(alone, "reset_parameters", None)):
                    reset()
                if callable(hf_init):  # the model's own policy, over the module's defaults
                    hf_init(alone)
        except (AttributeError, RuntimeError, TypeError) as e:
            raise DistributedError(advice(
                f"initialising module {owner or '(root)'} ({type(module).__name__}) alone failed: {type(e).__name__}: {e}",
                "its init reads other modules than its own tensors",
                "pass weights= a checkpoint, or an init(module) function that fills the stage",
            )) from e
        finally:
            torch.random.set_rng_state(state)
        for name, local in tensors.items():
            value: torch.Tensor | None = alone._parameters.get(name)
            value = value if value is not None else alone._buffers.get(name)
            if value is not None and recorder.wrote(value):
                _tensor(stage, local).copy_(value)


def _alone(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` with only its own parameters and buffers, allocated on the CPU."""
    alone = copy.copy(module)
    alone._modules = {}
    alone._parameters = dict(module._parameters)
    alone._buffers = dict(module._buffers)
    return alone.to_empty(device="cpu")
