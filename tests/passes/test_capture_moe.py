"""A mixture-of-experts causal LM (``transformers``' Mixtral, real weights, CPU) trains split like
the unsplit model, router outputs included.

``transformers`` registers its output-recording hooks on the layers, attention and routers the
first time ``output_router_logits`` asks for them; capture tells those apart from hooks that change
what forward computes (:func:`autosplit.passes.fidelity.installed_once`) and leaves the model as
it was. Float64 with the ``batched_mm`` experts kernel (the default ``grouped_mm`` kernel is
float32-only on CPU; it is checked in float32).
"""

from __future__ import annotations

import copy

import pytest
import torch

import autosplit
from autosplit.passes.fidelity import ModelSnapshot
from tests.helpers import NO_SEARCH, leaves, where

transformers = pytest.importorskip("transformers")

VOCAB = 64


def mixtral(*, router: bool = True, experts: str = "batched_mm", seed: int = 0):
    """A tiny ``MixtralForCausalLM`` (2 layers, 4 experts, top-2), seeded, never called."""
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=router, experts_implementation=experts,
    )
    return transformers.MixtralForCausalLM(config)


def _hooks(model) -> dict[str, int]:
    return {q: len(m._forward_hooks) + len(m._forward_pre_hooks) for q, m in model.named_modules()}


def _ids(seed: int = 1):
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("devices", [2, 4])
def test_mixtral_trains_split_like_the_unsplit_model(devices):
    """Outputs (loss, aux loss, logits, router logits), gradients and parameters after 3 AdamW steps."""
    model = mixtral().double()
    reference = copy.deepcopy(model)
    ids = _ids()
    split = autosplit.autosplit(model, ["cpu"] * devices, example_inputs=(ids,), example_kwargs={"labels": ids}, **NO_SEARCH)
    assert split.plan.capture == "export"
    assert len(set(split.plan.assignment.values())) == devices
    names = [n for n, _ in reference.named_parameters()]
    assert [n for n, _ in split.named_parameters()] == names
    opt, ref_opt = torch.optim.AdamW(split.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        ids = _ids(seed=step)
        out, expected = split(ids, labels=ids), reference(ids, labels=ids, use_cache=False)
        assert type(out) is type(expected) and type(out).__name__ == "MoeCausalLMOutputWithPast"
        assert sorted(k for k in out.keys()) == sorted(k for k in expected.keys() if k != "past_key_values")
        assert len(out.router_logits) == 2 and out.aux_loss is not None
        for key in ("loss", "aux_loss", "logits", "router_logits"):
            for a, b in zip(leaves(out[key]), leaves(expected[key]), strict=True):
                torch.testing.assert_close(a, b, msg=where(f"step {step} {key}"))
        out.loss.backward()
        expected.loss.backward()
        for (name, p), q in zip(split.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=where(f"step {step} gradient of {name}"))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for (name, a), b in zip(split.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, msg=where(f"{name} after 3 AdamW steps"))


def test_planning_leaves_the_model_as_it_was_and_a_call_hooks_it_once():
    """Planning removes the recording hooks it made the library install, and the library's mark with
    them: the next call installs them once, as the first would have (after planning and one call the
    model is as after one call)."""
    model, ids = mixtral().double(), _ids()
    fresh = copy.deepcopy(model)
    snapshot = ModelSnapshot.of(model)
    autosplit.plan(model, ["cpu"] * 2, example_inputs=(ids,), **NO_SEARCH)
    assert snapshot.changes(model) == []
    assert sum(_hooks(model).values()) == 0
    out, expected = model(ids, use_cache=False), fresh(ids, use_cache=False)
    assert _hooks(model) == _hooks(fresh) and sum(_hooks(fresh).values()) == 6  # layers, attention, routers
    assert ModelSnapshot.of(model).attributes == ModelSnapshot.of(fresh).attributes
    assert len(out.router_logits) == len(expected.router_logits) == 2  # recorded once, not twice
    for a, b in zip(leaves(out), leaves(expected), strict=True):
        torch.testing.assert_close(a, b)


def test_a_model_called_before_planning_keeps_its_hooks():
    model, ids = mixtral().double(), _ids()
    model(ids, use_cache=False)
    hooks, snapshot = _hooks(model), ModelSnapshot.of(model)
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(ids,), **NO_SEARCH)
    assert snapshot.changes(model) == [] and _hooks(model) == hooks
    torch.testing.assert_close(split(ids).router_logits, model(ids, use_cache=False).router_logits)


def test_without_router_outputs_no_hooks_are_installed():
    model, ids = mixtral(router=False).double(), _ids()
    snapshot = ModelSnapshot.of(model)
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(ids,), **NO_SEARCH)
    assert snapshot.changes(model) == [] and sum(_hooks(model).values()) == 0
    out = split(ids)
    assert out.router_logits is None and out.aux_loss is None
    torch.testing.assert_close(out.logits, model(ids, use_cache=False).logits)


def test_the_default_grouped_mm_experts_kernel_in_float32():
    model, ids = mixtral(experts="grouped_mm"), _ids()
    assert model.config._experts_implementation == "grouped_mm"
    reference = copy.deepcopy(model)
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(ids,), example_kwargs={"labels": ids}, **NO_SEARCH)
    out, expected = split(ids, labels=ids), reference(ids, labels=ids, use_cache=False)
    for key in ("loss", "aux_loss", "logits", "router_logits"):
        for a, b in zip(leaves(out[key]), leaves(expected[key]), strict=True):
            torch.testing.assert_close(a, b, msg=where(key))
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(split.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=where(f"gradient of {name}"))
