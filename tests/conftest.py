"""Fixtures for every test; the helpers the tests share are in ``tests/helpers.py``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
