"""A model that asks whether autocast is on computes another function under it than its graph,
captured with autocast off, does: a mixed precision refuses it by name; others plan it."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import autosplit
from autosplit.errors import ConstraintError
from autosplit.passes.autocast_reads import autocast_reads
from autosplit.passes.capture import capture

X = torch.randn(4, 8)


def keep_fp32(device_type: str) -> contextlib.AbstractContextManager:
    """transformers 5.17's ``maybe_autocast(device_type, enabled=False)``: autocast off, only where it is on."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class AsksAutocast(nn.Module):
    """A layer, then a product kept in fp32 the way a rotary embedding keeps its tables."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.table = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.proj(x))
        with keep_fp32("cpu"):
            t = h.float() @ self.table.weight.float().t()
        return h + t


class Plain(AsksAutocast):
    def forward(self, x):
        h = torch.relu(self.proj(x))
        return h + h.float() @ self.table.weight.float().t()


def test_the_model_under_autocast_is_not_its_graph_under_autocast():
    """Why the refusal: the graph, captured with autocast off, has no autocast-off region, so its
    product runs in bf16 where the model's runs in fp32."""
    torch.manual_seed(0)
    model = AsksAutocast()
    gm = capture(model, (X,), method="symbolic_trace").gm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(gm(X), model(X))


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_a_capture_records_the_models_reads_of_the_autocast_state_and_not_torchs(method):
    assert capture(AsksAutocast(), (X,), method=method).reads_autocast == (f"{__name__}.keep_fp32",)
    assert capture(Plain(), (X,), method=method).reads_autocast == ()
    asked = torch.is_autocast_enabled
    with autocast_reads() as reads:
        assert torch.is_autocast_enabled is not asked
        torch.is_autocast_enabled("cpu")  # read from here: this module is neither torch's nor autosplit's
    assert reads == [f"{__name__}.test_a_capture_records_the_models_reads_of_the_autocast_state_and_not_torchs"]
    assert torch.is_autocast_enabled is asked  # the spy is gone


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_a_mixed_precision_refuses_a_model_that_asks_and_plans_one_that_does_not(precision):
    with pytest.raises(ConstraintError) as refused:
        autosplit.plan(AsksAutocast(), ["cpu"] * 2, example_inputs=(X,), precision=precision, time_limit=2)
    message = str(refused.value)
    assert f"precision={precision!r}" in message and f"{__name__}.keep_fp32 calls torch.is_autocast_enabled" in message
    assert "Try: plan with precision='bf16-fsdp'" in message
    assert autosplit.plan(Plain(), ["cpu"] * 2, example_inputs=(X,), precision=precision, time_limit=2).precision == precision
    assert autosplit.plan(AsksAutocast(), ["cpu"] * 2, example_inputs=(X,), time_limit=2).precision == "fp32"
