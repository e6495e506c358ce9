"""Shared test helpers: the split-vs-unsplit equivalence check (torchgpipe's "transparency")."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

import autosplit


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _leaves(out):
    """Tensors of an output in a fixed order (dicts and transformers' ModelOutput by key)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "keys"):
        return [t for k in sorted(out.keys()) for t in _leaves(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _leaves(o)]
    if dataclasses.is_dataclass(out):
        return [t for f in dataclasses.fields(out) for t in _leaves(getattr(out, f.name))]
    return []


def _loss(out) -> torch.Tensor:
    return sum(t.float().pow(2).mean() for t in _leaves(out) if t.is_floating_point())


def assert_same_step(out, expected, named_params, ref_params) -> None:
    """Outputs equal; after backward of the same loss on each, every gradient equal."""
    for a, b in zip(_leaves(out), _leaves(expected), strict=True):
        torch.testing.assert_close(a, b)
    _loss(out).backward()
    _loss(expected).backward()
    for (name, p), q in zip(named_params, ref_params):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"gradient of {name}: {m}")


def assert_trains_like(model, devices, inputs, kwargs=None, *, steps: int = 3, **options):
    """Split ``model`` and check outputs, gradients, parameters and buffers after ``steps`` Adam steps.

    Runs in float64, so the split and the original agree to rounding (they sum gradients
    in a different order) and default tolerances apply.
    """
    kwargs = kwargs or {}
    model = model.double()
    as64 = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    inputs = tuple(as64(t) for t in inputs)
    kwargs = {k: as64(v) for k, v in kwargs.items()}
    reference = copy.deepcopy(model)
    split = autosplit.autosplit(model, devices, example_inputs=inputs, example_kwargs=kwargs, time_limit=2.0, **options)
    assert isinstance(split, autosplit.SplitModule)
    assert len(set(split.plan.assignment.values())) == len(devices), "every device gets a stage"

    names = [n for n, _ in reference.named_parameters()]
    assert [n for n, _ in split.named_parameters()] == names
    assert list(split.state_dict()) == list(reference.state_dict())
    opt_split = torch.optim.Adam(split.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(steps):
        assert_same_step(split(*inputs, **kwargs), reference(*inputs, **kwargs), split.named_parameters(), reference.parameters())
        opt_split.step(), opt_ref.step()
        opt_split.zero_grad(), opt_ref.zero_grad()
    for (name, a), b in zip(split.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name} after {steps} steps: {m}")
    return split
