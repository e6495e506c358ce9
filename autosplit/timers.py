"""Timers and trackers: what running a piece of code actually costs (DESIGN §2: a *measurement*).

- :func:`timed` — seconds of a call, warm-up then repeats, the median: CUDA events on a GPU,
  the monotonic ``perf_counter_ns`` clock on the CPU.
- :class:`MemoryTracker` — live and peak bytes of tensor storages on the CPU (a dispatch
  mode; GPUs use the caching allocator's statistics instead). Written here because
  ``torch.distributed._tools.MemTracker`` is private, refuses a module called twice (every
  pipeline does that, once per micro-batch) and rounds sizes to the CUDA allocator's blocks.
- :func:`pinned` — run with the threads (and CPU cores) a stage will have, so that a
  profile is taken under the conditions of the run.
- :func:`steady_allocator` — keep glibc from returning freed memory between steps, and fault in
  heap ahead of them.

Usage::

    fwd = timed(lambda: layer(x), device="cpu", warmup=2, repeats=5)
    with MemoryTracker() as mem:
        loss(model(x)).backward()
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from autosplit.compat import TorchDispatchMode, pytree

__all__ = ["MemoryTracker", "pinned", "steady_allocator", "timed"]


def timed(
    fn: Callable[..., Any], *, device: str = "cpu", warmup: int = 2, repeats: int = 5,
    setup: Callable[[], Any] | None = None,
) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs.

    ``setup`` runs untimed before every call and its result is passed to ``fn``.
    """
    cuda = torch.device(device).type == "cuda"
    samples = []
    for i in range(warmup + repeats):
        args = (setup(),) if setup is not None else ()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn(*args)
            end.record()
            torch.cuda.synchronize(device)
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter_ns()
            fn(*args)
            elapsed = (time.perf_counter_ns() - t0) / 1e9
        if i >= warmup:
            samples.append(elapsed)
    return statistics.median(samples)


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created inside it (plus those given to :meth:`track`).

    Every op's outputs are seen through ``__torch_dispatch__``; a storage counts once
    (views share it) and stops counting when it is freed (a weak reference to it dies).
    Backward on the CPU runs on the calling thread, so gradients are seen too.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def track(self, *values: Any) -> None:
        """Count tensors that already exist (parameters, inputs) as live."""
        for t in pytree.tree_leaves(values):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage())

    def reset_peak(self) -> None:
        self.peak = self.current

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key == 0 or key in self._live:
            return
        self._live[key] = storage.nbytes()
        self.current += self._live[key]
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage())
        return out


def steady_allocator(trim_threshold: int = 1 << 30, mmap_threshold: int = 32 << 20, reserve: int = 0) -> bool:
    """Keep freed memory in this process instead of handing it back to the kernel (glibc's
    ``mallopt``; the same as starting with ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_``),
    and with ``reserve`` bytes fault in that much heap now.

    A CPU training step frees and reallocates the same large tensors every micro-batch. By
    default glibc returns memory above 128 KiB to the kernel when it is freed and faults it in
    again on the next use, which on this project's 2-core VM made a process that had planned
    first run its training steps measurably slower (``benchmarks/pipeline_runtime.py`` calls
    this for every process it times).

    Kept memory is not all: a heap that fragments still grows now and then, and every page it
    grows by faults in on first touch. Rank 0 of a Llama pipeline (zero-bubble V, M = 4, two
    plans run by turns) faulted 10,255 pages in 9 of 20 steps of one plan and 20,806 in 8 of 20
    of the other, all in its last stage's input pass (``benchmarks/investigations/heap_faults.py``): which
    plan's steps pay, and how much, is chance, where the planner's splits differ by 1–3%. With a
    reserve, none did. ``reserve`` grows the heap by that much now, in pieces
    below the mmap threshold, writes it and frees it: glibc keeps it at the top of the heap (the
    trim threshold is raised above it), and the steps' growth up to it faults nothing. The
    process holds it from then on.

    Process-wide, so it is the caller's choice; returns ``False`` where there is no glibc ``mallopt``.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    trim_threshold = max(trim_threshold, 2 * reserve)
    if not (mallopt(m_trim_threshold, trim_threshold) and mallopt(m_mmap_threshold, mmap_threshold)):
        return False
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    piece = max(1 << 20, min(16 << 20, mmap_threshold // 2))  # on the heap, not mmap()ed apart
    held = []
    for _ in range(-(-reserve // piece)):
        address = libc.malloc(piece)
        if not address:
            break
        ctypes.memset(address, 0, piece)  # a write faults each page in
        held.append(address)
    for address in reversed(held):
        libc.free(address)
    return True


@contextlib.contextmanager
def pinned(threads: int | None, cores: Sequence[int] | None = None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads on ``cores`` (Linux), restoring both after."""
    old_threads = torch.get_num_threads()
    old_cores = os.sched_getaffinity(0) if cores is not None and hasattr(os, "sched_getaffinity") else None
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        if old_cores is not None and cores is not None:
            os.sched_setaffinity(0, set(cores))
        yield
    finally:
        torch.set_num_threads(old_threads)
        if old_cores is not None:
            os.sched_setaffinity(0, old_cores)
