"""The makespan runtime trains like the unsplit model: two towers, an Inception block and in-place
residual branches, each branch pinned to a device of its own."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.runtime.makespan import MakespanRunner
from tests.helpers import TwoTowers


def _inception():
    from benchmarks.workloads.models import InceptionA

    return InceptionA(8, 4, 0.125), torch.randn(4, 8, 9, 9), {"b1": 0, "b3": 1}


def _towers():
    return TwoTowers(32), torch.randn(16, 32), {"left": 0, "right": 1}


class _Residual(nn.Module):
    """Two residual branches writing in place (``ReLU(inplace=True)``, ``out += identity``)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, width))
        self.b = nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, width))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = self.act(x * 1.0)
        out = self.a(identity)
        out += identity
        other = self.b(identity)
        other += out
        return self.act(other)


def _residual():
    return _Residual(), torch.randn(8, 16), {"a": 0, "b": 1}


@pytest.mark.parametrize("make", [_towers, _inception, _residual], ids=["two towers", "inception block", "in-place residual"])
def test_the_makespan_runtime_trains_like_the_unsplit_model(make):
    torch.manual_seed(0)
    model, x, pin = make()
    model, x = model.double(), x.double()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        target = torch.randn_like(copy.deepcopy(model)(x))  # a copy: BatchNorm's running statistics move
    loss_fn = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    runner = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(x,), objective="makespan", pin=pin, time_limit=5)
    assert isinstance(runner, MakespanRunner) and len(runner.plan.stage_devices) == 2
    opt, ref_opt = runner.optimizer(torch.optim.Adam, lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
    assert len(opt.optimizers) == 2, "one optimizer per device"
    assert sum(len(g["params"]) for o in opt.optimizers.values() for g in o.param_groups) == len(list(model.parameters()))
    for step in range(3):
        loss = runner.step(x, target=target, loss_fn=loss_fn)
        expected = loss_fn(reference(x), target)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}, {name}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=name)
    torch.testing.assert_close(runner(x), reference(x))
