"""What a stage's forward leaves alive for its backward, measured: every storage an op returns while
:class:`Alive` is active, weakly (a DTensor's by its local tensor), and the functional collectives the
ops ran (those a selective checkpoint's cache answers never reach it). Used by the memory tests of
selective recomputation, alone and under tensor parallelism."""

from __future__ import annotations

import collections
import gc
import time
from collections.abc import Collection
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Alive", "held", "storages"]


def _storage(t: torch.Tensor) -> Any:
    """``t``'s storage (a DTensor's local tensor's), or None for a wrapper without one (a collective's
    pending result: its plain output is seen when the collective runs)."""
    from torch.distributed.tensor import DTensor

    t = t._local_tensor if isinstance(t, DTensor) else t
    try:
        storage = t.untyped_storage()
        storage.data_ptr()
    except RuntimeError:
        return None
    return storage


class Alive(TorchDispatchMode):
    """Storages made while active, but those in ``before`` (parameters, inputs: a view of a weight is the
    weight's), and ``collectives``: the ``_c10d_functional`` ops run, by name (waits left out)."""

    def __init__(self, before: Collection[int] = frozenset()):
        super().__init__()
        self.before = before
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}
        self.collectives: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name not in ("wait_tensor", "_wrap_tensor_autograd"):
            self.collectives[name] += 1
        for t in tree_leaves(out):
            storage = _storage(t) if isinstance(t, torch.Tensor) else None
            if storage is None or storage.data_ptr() in self.before:
                continue
            seen = self.made.get(storage.data_ptr())
            if seen is None or seen[0].expired():  # an address freed and taken again is a new storage
                self.made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive(self) -> int:
        """Bytes of the storages made and still alive. A collective's output outlives its wait for a moment: gloo's
        worker thread drops its reference to the finished work only when the scheduler runs it again, which on a
        busy machine can be milliseconds later (seen as a gathered output counted alive in one run of three). Such a
        reference only adds, so the count is the least of three taken over a quarter of a second."""
        counts = []
        for pause in (0.01, 0.05, 0.2):
            time.sleep(pause)
            gc.collect()
            counts.append(sum(n for ref, n in self.made.values() if not ref.expired()))
        return min(counts)


def storages(tensors: Any) -> set[int]:
    """The addresses of the storages ``tensors`` hold (what :class:`Alive` leaves out)."""
    return {s.data_ptr() for t in tensors if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None}


def held(stage: torch.nn.Module, received: tuple, named: dict[str, Any]) -> tuple[int, Any]:
    """Bytes a stage's forward leaves alive for its backward, its outputs included (the pipeline keeps
    them for the backward too), and its outputs."""
    mode = Alive(storages((*stage.parameters(), *stage.buffers(), *received, *named.values())))
    with mode:
        out = stage(*received, **named)
    return mode.alive(), out
