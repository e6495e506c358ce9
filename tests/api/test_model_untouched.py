"""Planning never changes the user's model: after every verb, the parameters, buffers, hooks,
attributes and requires_grad flags of each training-code pattern and of each of
``torch.distributed.pipelining``'s test models are what they were."""

from __future__ import annotations

import pytest
import torch

import autosplit
from autosplit.passes.fidelity import ModelSnapshot
from tests.helpers import PATTERNS, PIPELINING, AutocastRegion, D, OptionalMask, output_loss, pipelining_inputs

X = torch.randn(4, D)


def _zoo():
    for name, factory in PATTERNS.items():
        yield name, factory(), (X,)
    yield "autocast", AutocastRegion(), (X,)
    yield "optional mask", OptionalMask(), (X, None)
    for name, (factory, _) in PIPELINING.items():
        yield name, factory(), pipelining_inputs(name)


def _values(model):
    return {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}


VERBS = {
    "plan": lambda model, inputs: autosplit.plan(model, ["cpu"] * 2, example_inputs=inputs),
    "autosplit": lambda model, inputs: autosplit.autosplit(model, ["cpu"] * 2, example_inputs=inputs),
    "plan with measured costs": lambda model, inputs: autosplit.plan(
        model, ["cpu"] * 2, example_inputs=inputs, costs=autosplit.options.ProfileOptions(use_cache=False, repeats=1), micro_batches=2
    ),
    "compare, measured": lambda model, inputs: autosplit.compare(
        model, ["cpu"] * 2, example_inputs=inputs, manual={"halves": [1, 1]}, measure=True, steps=1,
        loss_fn=lambda out, target: output_loss(out), target=torch.zeros(4), micro_batches=2,
    ),
}


@pytest.mark.parametrize("verb", list(VERBS))
def test_planning_never_changes_the_users_model(verb):
    """Parameters, buffers, hooks, attributes and requires_grad flags are identical before and after."""
    for name, model, inputs in _zoo():
        snapshot, values = ModelSnapshot.of(model), _values(model)
        VERBS[verb](model, inputs)
        assert snapshot.changes(model, versions=False) == [], name
        for key, value in _values(model).items():
            assert torch.equal(value, values[key]), f"{name}: {key} changed by {verb}"
