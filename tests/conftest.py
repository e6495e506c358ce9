"""Fixtures for every test; the helpers the tests share are in ``tests/helpers.py``."""

from __future__ import annotations

import os

import pytest
import torch

# The ranks the distributed tests spawn inherit this: a rank that aborts in C++ (SIGABRT,
# SIGSEGV) prints where its Python threads were, into the failing test's captured stderr.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

# One intra-op thread, here and in every process a test starts (torchrun's ranks, python -c): the
# tests' models are small, and on this 2-core machine, shared, a second OpenMP thread mostly waits
# for the first (MobileNet's 3 float64 steps took 8 s on 2 threads, 0.4 s on 1). Timings with more
# threads belong to benchmarks/.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_finish(session):
    """What collection imported (torch, autosplit, the test modules) stays for good: moved out of the
    collector's reach, no full collection walks it again (the runtime's ``close()`` runs one per pipeline)."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def gloo():
    """``gloo(world)``: this test file's group of ``world`` gloo processes (:class:`tests.helpers.Gloo`),
    started on first use and kept for the file's other tests; ``timeout``: the process group's, in seconds."""
    from tests.helpers import Gloo

    groups: dict[tuple[int, float], Gloo] = {}

    def group(world: int, *, timeout: float = 60) -> Gloo:
        key = (world, timeout)
        if key not in groups or groups[key].closed:
            groups[key] = Gloo(world, timeout=timeout)
        return groups[key]

    yield group
    for made in groups.values():
        made.close()
