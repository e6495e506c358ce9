"""Hooks a forward registers while it is captured: a library's observers installed once are
accepted (and removed again), anything else is refused by name (:func:`autosplit.passes.fidelity.installed_once`).

``Recorder`` is ``transformers``' output recording in miniature: on its first call it registers a
forward hook per layer that appends the layer's output to a collector its forward returns, and
marks itself so that it never registers them again.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.passes.capture import capture
from autosplit.passes.fidelity import ModelSnapshot
from tests.helpers import D, assert_trains_like, says

X = torch.randn(4, D)
_COLLECTORS: list[list[torch.Tensor]] = []


def _record(module, args, output):
    if _COLLECTORS:
        _COLLECTORS[-1].append(output)


class Recorder(nn.Module):
    """Records each layer's output through hooks it installs on its first call (a new attribute marks
    it, as ``transformers`` does; ``mark_in_init``: an attribute set in ``__init__`` and rebound)."""

    def __init__(self, *, mark_in_init: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        if mark_in_init:
            self.hooks_installed = False

    def forward(self, x):
        if not getattr(self, "hooks_installed", False):
            for layer in self.layers:
                layer.register_forward_hook(_record)
            self.hooks_installed = True
        _COLLECTORS.append([])
        try:
            for layer in self.layers:
                x = torch.tanh(layer(x))
        finally:
            recorded = _COLLECTORS.pop()
        return {"out": x, "recorded": tuple(recorded)}


class HookPerCall(nn.Module):
    """Registers one more hook on every call."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        self.a.register_forward_hook(_record)
        return self.b(self.a(x))


class ScalesOnce(nn.Module):
    """Installs, once, a hook that doubles a layer's output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        if not hasattr(self, "_scaled"):
            self.a.register_forward_hook(lambda module, args, output: 2 * output)
            self._scaled = True
        return self.b(self.a(x))


class LateRecorder(nn.Module):
    """Installs its recording hook after the layer ran: the first call records nothing, later calls do."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        _COLLECTORS.append([])
        try:
            h = self.b(self.a(x))
            if not hasattr(self, "_hooked"):
                self.a.register_forward_hook(_record)
                self._hooked = True
        finally:
            recorded = _COLLECTORS.pop()
        return h + sum(recorded) if recorded else h


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_observers_installed_on_the_first_call_are_captured_and_removed():
    torch.manual_seed(0)
    model = Recorder().double()
    fresh, snapshot = copy.deepcopy(model), ModelSnapshot.of(model)
    split = assert_trains_like(model, ["cpu"] * 2, (X,))
    assert split.plan.capture == "export"  # symbolic tracing does not run hooks: it would record nothing
    assert len(split(X.double())["recorded"]) == 3
    assert snapshot.changes(model, versions=False) == [] and _hook_count(model) == 0
    assert not hasattr(model, "hooks_installed")
    model(X.double()), fresh(X.double())  # the next call hooks it once, as the first call would have
    assert _hook_count(model) == _hook_count(fresh) == 3


def test_a_mark_the_model_already_has_is_put_back_and_refused():
    """torch.export puts a module's own attributes back after tracing (not new ones): a model that
    marks itself through an attribute it has from ``__init__`` registers its hooks again on every
    export, so it is refused; the symbolic trace's rebinding of the mark is undone too."""
    model = Recorder(mark_in_init=True)
    snapshot = ModelSnapshot.of(model)
    with pytest.raises(autosplit.errors.CaptureError, match="changes the model on every call"):
        capture(model, (X,))
    assert snapshot.changes(model) == [] and _hook_count(model) == 0 and model.hooks_installed is False


def test_symbolic_tracing_refuses_hooks_installed_while_tracing():
    model = Recorder()
    with pytest.raises(autosplit.errors.CaptureError, match=r"registered hooks on layers\.0") as err:
        capture(model, (X,), method="symbolic_trace")
    says(err, "capture='export'")
    assert _hook_count(model) == 0 and not hasattr(model, "hooks_installed")


@pytest.mark.parametrize("factory, message", [
    (HookPerCall, r"changes the model on every call.*hooks of a changed"),
    (ScalesOnce, r"hooks that change values: a forward hook on a returned a value"),
    (LateRecorder, r"first call computes another graph than its second"),
])
def test_hooks_that_change_what_forward_computes_are_refused(factory, message):
    model = factory()
    snapshot, before = ModelSnapshot.of(model), copy.deepcopy(model.state_dict())
    with pytest.raises(autosplit.errors.CaptureError, match=message) as err:
        autosplit.plan(model, ["cpu"] * 2, example_inputs=(X,))
    says(err)
    assert snapshot.changes(model) == [] and _hook_count(model) == 0, "a refused capture leaves the model as it was"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
