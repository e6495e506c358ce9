"""Timers and memory: the memory tracker counts each storage once and sees it freed; the steady
allocator sets glibc's thresholds."""

from __future__ import annotations

import torch

import autosplit
from autosplit.timers import MemoryTracker


def test_memory_tracker_counts_storages_once_and_sees_them_freed():
    with MemoryTracker() as mem:
        a = torch.zeros(1024, 256)  # 1 MiB
        view = a[:10]
        b = a + 1
        del b
    assert mem.peak == 2 * 2**20
    assert mem.current == 2**20
    del a, view
    assert mem.current == 0


def test_steady_allocator_sets_glibcs_thresholds():
    assert autosplit.timers.steady_allocator() is True  # Linux, glibc: both mallopt calls accepted
