"""Fixtures for every test; the helpers the tests share are in ``tests/helpers.py``."""

from __future__ import annotations

import os

import pytest
import torch

# The ranks the distributed tests spawn inherit this: a rank that aborts in C++ (SIGABRT,
# SIGSEGV) prints where its Python threads were, into the failing test's captured stderr.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
