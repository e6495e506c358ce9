"""Timers and memory: the memory tracker counts each storage once and sees it freed; the steady
allocator's reserve lets a step's heap grow without page faults (in a fresh process, against one
without it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

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


_PROBE = textwrap.dedent("""
    import resource, sys
    import torch
    from autosplit.timers import steady_allocator
    assert steady_allocator(reserve=int(sys.argv[1]))  # the same thresholds, with and without a reserve
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.ones(4 << 20) for _ in range(12)]  # 12 x 16 MiB, below the mmap threshold: heap
    del held
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_steady_allocator_faults_its_reserve_in_ahead():
    probes = {reserve: subprocess.Popen([sys.executable, "-c", _PROBE, str(reserve)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True) for reserve in (0, 256 << 20)}  # both at once: each imports torch first
    faults = {}
    try:
        for reserve, probe in probes.items():
            out, err = probe.communicate(timeout=120)
            assert probe.returncode == 0, err
            faults[reserve] = int(out.split()[-1])
    finally:  # neither outlives the test (a timeout or a failed probe leaves the other running)
        for probe in probes.values():
            probe.kill()
    assert faults[0] > 30_000  # 192 MiB of fresh heap, 4 KiB a page
    assert faults[256 << 20] < 1_000
