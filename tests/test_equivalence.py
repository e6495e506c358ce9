"""Split vs unsplit: outputs, gradients and three optimizer steps agree (issue #2, item 7)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autosplit.examples import GPT
from benchmarks.models import GNMT, MLP, ConvBN, InceptionA, InceptionE, ResNet
from conftest import assert_trains_like

DEVICES = [2, 3, 4]


class InceptionNet(nn.Module):
    """Stem conv, two Inception blocks with parallel towers joined by concat, classifier."""

    def __init__(self):
        super().__init__()
        self.stem = ConvBN(3, 8, 3, padding=1)
        self.a = InceptionA(8, 8, 0.125)
        self.e = InceptionE(self.a.out, 0.0625)
        self.fc = nn.Linear(self.e.out, 5)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.e(self.a(self.stem(x))), 1), 1))


class LSTMTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 12)
        self.lstm = nn.LSTM(12, 16, num_layers=2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 7)

    def forward(self, tokens):
        h, _ = self.lstm(self.emb(tokens))
        return self.out(self.norm(h))


class MultiHead(nn.Module):
    """Returns a dict holding a tensor and a tuple; in-place ops and a module used twice."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)  # called twice: its calls must share a device
        self.act = nn.ReLU(inplace=True)
        self.cls = nn.Linear(16, 3)
        self.reg = nn.Linear(16, 1)

    def forward(self, x, scale: float = 1.0):
        h = self.act(self.inp(x))
        h = self.shared(h)
        h.add_(1.0)  # a real in-place write (fx traces `h += 1` as an out-of-place add)
        g = self.shared(torch.tanh(h)) * scale
        return {"logits": self.cls(g), "aux": (self.reg(h), g.sum(-1))}


def _mask(batch: int, seq: int) -> torch.Tensor:
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - 3 :] = 0  # right padding in the last row
    return mask


ZOO = {
    "mlp": lambda: (MLP((10, 24, 24, 24, 24, 3)), (torch.randn(6, 10),), {}),
    "cnn_batchnorm": lambda: (ResNet(blocks=(1, 1), width=4, num_classes=5), (torch.randn(3, 3, 16, 16),), {}),
    "inception": lambda: (InceptionNet(), (torch.randn(2, 3, 12, 12),), {}),
    "gpt_tied_mask": lambda: (
        GPT(vocab=40, d_model=16, n_layers=2, n_heads=2, max_len=8),
        (torch.randint(0, 40, (2, 8)),),
        {"attention_mask": _mask(2, 8)},
    ),
    "lstm": lambda: (LSTMTagger(), (torch.randint(0, 50, (3, 5)),), {}),
    "gnmt": lambda: (GNMT(vocab=30, hidden=8, layers=3), (torch.randint(0, 30, (2, 5)), torch.randint(0, 30, (2, 4))), {}),
    "dict_tuple_output": lambda: (MultiHead(), (torch.randn(4, 8),), {"scale": 0.5}),
}


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_trains_like_original(name, devices):
    model, inputs, kwargs = ZOO[name]()
    split = assert_trains_like(model, ["cpu"] * devices, inputs, kwargs)
    assert split.plan.capture == "symbolic_trace"


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=60, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg)


def _bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=60,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    cfg._attn_implementation = "eager"
    return BertModel(cfg)


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("factory", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_transformers_models_train_like_original(factory, devices):
    pytest.importorskip("transformers")
    model = factory()
    ids = torch.randint(0, 60, (2, 8))
    split = assert_trains_like(model, ["cpu"] * devices, (ids,), {"attention_mask": _mask(2, 8)})
    assert split.plan.capture == "export"  # symbolic tracing cannot follow these models


def test_tied_embedding_is_one_parameter_on_one_device():
    model = GPT(vocab=40, d_model=16, n_layers=2, n_heads=2, max_len=8)
    split = assert_trains_like(model, ["cpu"] * 3, (torch.randint(0, 40, (2, 8)),), steps=1)
    assert split.wte.weight is split.head.weight
    owners = [s for s, stage in enumerate(split.stages) if any(p is split.wte.weight for p in stage.parameters())]
    first = split.plan.stage_of["embedding"]
    assert owners == [first], "the tied weight lives on the stage of its first reader only"
    # The head's stage receives the weight as an input (a transfer), and autograd sums its gradient.
    owner = split.stages[first]
    (tied,) = [n for n in owner.graph.find_nodes(op="get_attr") if operator.attrgetter(n.target)(owner) is split.wte.weight]
    head_stage = split.plan.stage_of["linear"]  # the head: F.linear(x, wte.weight), traced through
    received = {n.name for n in split.stages[head_stage].graph.find_nodes(op="placeholder")}
    assert head_stage == first or tied.name in received, "the head's stage has the weight or receives it (a transfer)"


def test_module_called_twice_and_in_place_writes_stay_with_their_tensor():
    model, inputs, kwargs = ZOO["dict_tuple_output"]()
    split = assert_trains_like(model, ["cpu"] * 4, inputs, kwargs, steps=1)
    a = split.plan.assignment
    assert a["shared"] == a["shared_1"], "both calls of the shared module use its one set of parameters"
    assert a["add_"] == a["shared"], "h.add_(1) writes h where h lives"
    assert a["act"] == a["inp"], "ReLU(inplace=True) writes its input where it lives"
    from autosplit.devices import resolve_devices
    from autosplit.passes.annotate import annotate
    from autosplit.passes.capture import capture, flat_inputs
    from autosplit.passes.costs import estimate

    model, inputs, kwargs = ZOO["dict_tuple_output"]()
    captured = capture(model, inputs, kwargs)
    annotate(captured, flat_inputs(captured, model, inputs, kwargs))
    table = estimate(captured.gm, resolve_devices(["cpu"] * 2))
    groups = [{table.nodes[i] for i in g} for g in table.colocate]
    assert {"shared", "shared_1", "add_"} <= next(g for g in groups if "shared" in g)
    assert {"inp", "act"} in groups
