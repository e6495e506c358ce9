"""Capture keeps what forward means, or refuses.

The training-code patterns of ``tests/helpers.py`` (frozen backbones under ``no_grad``, autocast
regions, custom autograd Functions, root hooks, weights updated inside forward, ``None``
arguments, tensor defaults, structured outputs), ``torch.distributed.pipelining``'s own test
models, and a ``transformers`` causal LM with its default config each train split exactly like
the unsplit model (float64; autocast against the same autocast), or are refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.passes.capture import capture
from autosplit.passes.fidelity import ModelSnapshot
from tests.helpers import (
    PATTERNS,
    PIPELINING,
    AutocastRegion,
    D,
    DataclassOutput,
    DomainAdversarial,
    EMATeacher,
    FrozenBackbone,
    MomentumEncoder,
    OptionalMask,
    Output,
    RootHooks,
    StructuredOutput,
    TensorDefault,
    TupleOutput,
    assert_trains_like,
    pipelining_inputs,
)

X = torch.randn(4, D)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_training_patterns_train_like_the_model(name):
    torch.manual_seed(0)
    split = assert_trains_like(PATTERNS[name](), ["cpu"] * 2, (X,))
    expected = {"gradient reversal": "symbolic_trace", "frozen backbone": "export", "root hooks": "export",
                "EMA teacher": "export"}
    assert split.plan.capture == expected.get(name, "symbolic_trace")


@pytest.mark.parametrize("kind, cls", [("dict", Output), ("dataclass", DataclassOutput), ("namedtuple", TupleOutput)])
def test_outputs_come_back_as_the_models_own_type(kind, cls):
    model = StructuredOutput(kind)
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(X,))
    out, expected = split(X), model(X)
    assert type(out) is cls
    torch.testing.assert_close(out[0] if kind == "namedtuple" else out.logits if kind == "dataclass" else out["logits"],
                               expected[0] if kind == "namedtuple" else expected.logits if kind == "dataclass" else expected["logits"])


def test_none_argument_takes_the_branch_the_call_takes():
    model = OptionalMask()
    split = assert_trains_like(model, ["cpu"] * 2, (X, None))
    assert split.plan.capture == "symbolic_trace"
    with pytest.raises(AssertionError, match="specialized to have value None"):
        split(X.double(), torch.ones(4, D, dtype=torch.float64))  # captured for None: a mask is refused, not ignored


def test_tensor_default_is_an_input_and_can_be_passed():
    model = TensorDefault().double()
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(X.double(),))
    shift = torch.arange(3, dtype=torch.float64)
    torch.testing.assert_close(split(X.double(), shift), model(X.double(), shift))
    assert not hasattr(model, "_tensor_constant0")


def test_autocast_region_computes_in_bf16_like_the_model():
    torch.manual_seed(0)
    model = AutocastRegion()
    reference = copy.deepcopy(model)
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(X,))
    assert split.plan.capture == "export"
    opt, opt_ref = torch.optim.Adam(split.parameters(), lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(3):
        out, expected = split(X), reference(X)
        assert out.dtype == expected.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected)
        out.float().square().mean().backward()
        expected.float().square().mean().backward()
        for p, q in zip(split.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()


@pytest.mark.parametrize("factory, construct", [
    (FrozenBackbone, "torch.no_grad()"),
    (AutocastRegion, "torch.autocast('cpu', dtype=torch.bfloat16)"),
    (RootHooks, "forward pre hooks, forward hooks on the root module"),
    (EMATeacher, "in-place update of teacher.0.weight"),
    (MomentumEncoder, "assignment to key.0.weight.data"),
])
def test_symbolic_trace_refuses_what_it_would_drop(factory, construct):
    model = factory()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(autosplit.errors.CaptureError, match="would silently drop") as err:
        autosplit.plan(model, ["cpu"] * 2, example_inputs=(X,), capture="symbolic_trace")
    assert construct in str(err.value) and "capture='export'" in str(err.value)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed while planning"


def test_a_weight_update_through_data_is_refused_by_name():
    model = MomentumEncoder()
    snapshot, before = ModelSnapshot.of(model), copy.deepcopy(model.state_dict())
    with pytest.raises(autosplit.errors.CaptureError, match=r"(?s)faithfully.*assignment to key.0.weight.data.*training loop"):
        autosplit.plan(model, ["cpu"] * 2, example_inputs=(X,))
    assert snapshot.changes(model) == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_export_refuses_a_custom_autograd_function():
    with pytest.raises(autosplit.errors.CaptureError, match=r"GradReverse.*backward would be lost"):
        capture(DomainAdversarial(), (X,), method="export")


class WritesThenBranches(nn.Module):
    """Writes a buffer at trace time, then branches on data: neither tracer can capture it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.steps = nn.Buffer(torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        h = self.a(x)
        return h * 2 if h.sum() > 0 else h


def test_a_failed_capture_leaves_the_model_as_it_was():
    model = WritesThenBranches()
    snapshot = ModelSnapshot.of(model)
    with pytest.raises(autosplit.errors.CaptureError):
        capture(model, (X,))
    assert snapshot.changes(model) == []
    assert model.steps.item() == 0


def test_causal_lm_with_its_default_config_drops_the_kv_cache():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16,
    )
    assert config.use_cache
    ids = torch.randint(0, 64, (2, 8))
    split = assert_trains_like(transformers.LlamaForCausalLM(config), ["cpu"] * 2, (ids,))
    out = split(ids)
    assert type(out).__name__ == "CausalLMOutputWithPast" and out.past_key_values is None


@pytest.mark.parametrize("name", list(PIPELINING))
def test_pipelining_test_models_train_like_the_model(name):
    torch.manual_seed(0)
    factory, _ = PIPELINING[name]
    assert_trains_like(factory(), ["cpu"] * 2, pipelining_inputs(name))
