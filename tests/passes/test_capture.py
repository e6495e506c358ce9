"""Capture: symbolic tracing first, torch.export as the fallback, typed errors."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.devices import resolve_devices
from autosplit.examples import GPT
from autosplit.passes.annotate import annotate
from autosplit.passes.annotations import node_info
from autosplit.passes.capture import capture, flat_inputs
from autosplit.passes.costs import estimate
from tests.helpers import assert_trains_like


class DataDependent(nn.Module):
    """Python control flow on a tensor value: symbolic tracing cannot follow it, export can."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 2)

    def forward(self, x):
        h = self.a(x)
        if x.shape[0] > 1 and bool(torch.sym_not(x.shape[0] < 1)):  # shape logic is fine for export
            h = h.relu()
        for _ in range(int(x.shape[0])):  # loop count from a shape: traced with a concrete batch
            h = self.b(h)
        return self.c(h)


class Unsupported(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # depends on tensor data: neither tracer can capture it
            return x * 2
        return x


def test_export_fallback_when_symbolic_tracing_fails():
    model = DataDependent()
    split = assert_trains_like(model, ["cpu"] * 2, (torch.randn(3, 6),))
    assert split.plan.capture == "export"


def test_uncapturable_model_gets_a_typed_error_with_advice():
    with pytest.raises(autosplit.errors.CaptureError) as err:
        autosplit.plan(Unsupported(), ["cpu"] * 2, example_inputs=(torch.randn(2, 2),))
    message = str(err.value)
    assert "symbolic_trace" in message and "torch.export" in message and "Try:" in message


def test_every_node_keeps_its_module_path():
    model = GPT(vocab=30, d_model=16, n_layers=2, n_heads=2, max_len=8)
    captured = capture(model, (torch.randint(0, 30, (2, 8)),))
    paths = captured.module_paths
    qkv = [n.name for n in captured.gm.graph.nodes if n.op == "call_module" and n.target.endswith("attn.qkv")]
    assert [paths[n] for n in qkv] == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
    softmax = [n.name for n in captured.gm.graph.nodes if "softmax" in str(n.target)]
    assert [paths[n] for n in softmax] == ["blocks.0.attn", "blocks.1.attn"]


def test_tied_parameter_is_a_single_graph_node():
    model = GPT(vocab=30, d_model=16, n_layers=1, n_heads=2, max_len=8)
    captured = capture(model, (torch.randint(0, 30, (2, 8)),))
    readers_of_tied = [
        n for n in captured.gm.graph.nodes if n.op == "get_attr" and operator.attrgetter(n.target)(captured.gm) is model.wte.weight
    ]
    assert len(readers_of_tied) == 1
    assert len(readers_of_tied[0].users) == 2  # the embedding lookup and the output projection


def test_annotations_count_flops_params_and_saved_activations():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    captured = capture(model, (x,))
    annotate(captured, flat_inputs(captured, (x,), {}))
    first = node_info(next(n for n in captured.gm.graph.nodes if n.op == "call_module"))
    assert first.fwd_flops == 2 * 5 * 8 * 16
    assert first.bwd_flops == first.fwd_flops  # the weight's gradient; the input data needs none
    assert first.param_count == 8 * 16 + 16 and first.param_bytes == 4 * first.param_count
    assert first.output_shapes == ((5, 16),) and first.output_bytes == 5 * 16 * 4
    # It saves its input (the weight is a parameter, not an activation) and makes nothing it keeps.
    assert first.saved_bytes == 0 and first.saved_inputs == ("input_1",) and not first.saves_output
    relu = node_info(next(n for n in captured.gm.graph.nodes if n.target == "1"))
    assert relu.saves_output and relu.saved_bytes == 5 * 16 * 4
    table = estimate(captured.gm, resolve_devices(["cpu"]))
    # The graph input is charged to its first saver; the model output lives until the loss uses it.
    assert table.saved_bytes == (5 * 8 * 4, 5 * 16 * 4, 5 * 4 * 4)


def test_a_tensor_saved_by_several_consumers_counts_once():
    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = x * 2  # saves nothing: the factor is a constant
            return (self.q(h) * self.k(h)).tanh() + self.v(h)

    model, x = QKV(), torch.randn(5, 8)
    captured = capture(model, (x,))
    annotate(captured, flat_inputs(captured, (x,), {}))
    table = estimate(captured.gm, resolve_devices(["cpu"]))
    saved = dict(zip(table.nodes, table.saved_bytes))
    size = 5 * 8 * 4
    # h once (read by q, k, v), q and k (read by the product), tanh's output, the model output.
    assert saved == {"mul": size, "q": size, "k": size, "mul_1": 0, "tanh": size, "v": 0, "add": size}
    # Sent to another stage, a tensor nobody saves is held by its sender until its gradient returns.
    assert dict(zip(table.nodes, table.sent_bytes)) == {"mul": 0, "q": 0, "k": 0, "mul_1": size, "tanh": 0, "v": size, "add": 0}


def test_memoised_annotations_equal_measuring_every_node(monkeypatch):
    from autosplit.passes import annotate as annotate_module

    model = GPT(vocab=30, d_model=16, n_layers=3, n_heads=2, max_len=8)
    x = torch.randint(0, 30, (2, 8))
    memoised = capture(model, (x,))
    annotate(memoised, flat_inputs(memoised, (x,), {}))
    monkeypatch.setattr(annotate_module._Annotator, "_signature", lambda self, n, a, k: None)
    fresh = capture(model, (x,))
    annotate(fresh, flat_inputs(fresh, (x,), {}))
    pairs = list(zip(memoised.gm.graph.nodes, fresh.gm.graph.nodes))
    assert all(a.meta.get("autosplit") == b.meta.get("autosplit") for a, b in pairs)
    assert sum(node_info(a).fwd_flops for a, _ in pairs if "autosplit" in a.meta) > 0
