"""Outlining the repeated blocks of a stage graph (:mod:`autosplit.passes.outline`): each block of an
exported transformers Llama's one-stage graph becomes one ``call_module`` to a sub-``GraphModule`` at the
block's own path, and the stage computes the same outputs and gradients (float64) with the same
parameter names and objects and the same state-dict keys, its recomputed blocks' checkpointed regions
inside their units; the cost model marks those blocks' parameter reads as units of their own; a block
that reads a tied weight, or whose container holds a parameter its nodes never read, is refused and
left as it was."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import autosplit
from autosplit.compiler.costs import cost_table
from autosplit.microbatch import split_batch
from autosplit.passes.capture import capture
from autosplit.passes.chain import generate_chain
from autosplit.passes.outline import outlinable_blocks, outline_blocks, refused_blocks
from tests.helpers import NO_SEARCH

LAYERS = ("model.layers.0", "model.layers.1")


@pytest.fixture(scope="module")
def llama() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).double()
    planner = autosplit.Planner(model, ["cpu"], example_inputs=(torch.randint(0, 64, (2, 8)),), **NO_SEARCH)
    return planner, planner.plan()


def _stage(planner: Any, plan: Any, recompute: tuple[str, ...]) -> tuple[fx.GraphModule, dict[str, Any]]:
    captured = planner.traced.captured
    micro = split_batch(planner.traced.inputs, None, 1)[0][0]
    chain = generate_chain(captured, plan.stage_of, 1, micro, recompute=recompute)
    for p in chain.stages[0].parameters():
        p.grad = None
    return chain.stages[0], dict(zip(chain.input_names, micro))


@pytest.mark.parametrize("recompute", [(), ("model.layers.0",)])
def test_outlined_blocks_compute_as_the_stage_did_under_the_same_names(llama, recompute):
    planner, plan = llama
    assert planner.traced.captured.method == "export"
    stage, inputs = _stage(planner, plan, recompute)
    reference = copy.deepcopy(stage)
    named, keys = [(q, id(p)) for q, p in stage.named_parameters()], list(stage.state_dict())
    assert outline_blocks(stage) == list(LAYERS)
    assert [(q, id(p)) for q, p in stage.named_parameters()] == named and list(stage.state_dict()) == keys
    assert [str(n.target) for n in stage.graph.nodes if n.op == "call_module" and n.target != "_guards_fn"] == list(LAYERS)
    assert not any(str(n.target).startswith("model.layers.") for n in stage.graph.nodes if n.op == "get_attr")
    for layer in LAYERS:
        unit = stage.get_submodule(layer)
        assert isinstance(unit, fx.GraphModule)
        assert all(not str(n.target).startswith("model.") for n in unit.graph.nodes if n.op == "get_attr")
    regions = [q for q, _ in stage.named_modules() if "recompute_" in q]
    assert regions == [f"{b}.recompute_{b.replace('.', '_')}" for b in recompute], regions  # the unit wraps the region
    out, expected = stage(**inputs)[0], reference(**inputs)[0]
    torch.testing.assert_close(out, expected)
    (out.square().mean()).backward()
    (expected.square().mean()).backward()
    ref = dict(reference.named_parameters())
    for q, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, ref[q].grad, msg=q)


def test_the_cost_model_marks_the_outlined_blocks_parameters_as_units(llama):
    """The cost model's ``unit_params`` are the runtime's outlined blocks (one predicate): every read of a
    block's parameter, and nothing outside the blocks (the embedding, the norm, the head: the stage's own unit)."""
    planner, _ = llama
    table, _ = cost_table(planner.traced, planner.specs(), planner.options, micro_batches=1)
    gm = planner.traced.captured.gm
    reads = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and n.users}
    flagged = {name for name, flag in zip(table.nodes, table.unit_params) if flag}
    assert {name for name, target in reads.items() if target.startswith("model.layers.")} <= flagged
    assert not {name for name, target in reads.items() if not target.startswith("model.layers.")} & flagged
    assert all(b in LAYERS for b in outlinable_blocks(gm))
    params = sum(b for b, flag in zip(table.param_bytes, table.unit_params) if flag)
    assert params == sum(p.numel() * 8 for q, p in planner.traced.model.named_parameters() if q.startswith("model.layers."))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, tied: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.linear(h))
        return h if tied is None else h + h @ tied.T @ tied


class _Net(nn.Module):
    """Three blocks; block 1 reads the embedding's weight (a tied weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = block(h, self.embed.weight if i == 1 else None)
        return h


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_a_tied_read_or_an_unread_parameter_keeps_the_block_in_its_stage(method):
    torch.manual_seed(0)
    model, x = _Net().double(), torch.randint(0, 10, (2, 3))
    gm = capture(model, (x,), method=method).gm
    gm.get_submodule("blocks.2").register_parameter("extra", nn.Parameter(torch.zeros(1, dtype=torch.float64)))
    why = refused_blocks(gm)
    assert "tied" in why["blocks.1"] and "embed.weight" in why["blocks.1"], why
    assert "blocks.2.extra" in why["blocks.2"] and "never read" in why["blocks.2"], why
    named = [(q, id(p)) for q, p in gm.named_parameters()]
    assert outline_blocks(gm) == ["blocks.0"]
    assert [(q, id(p)) for q, p in gm.named_parameters()] == named
    assert isinstance(gm.get_submodule("blocks.0"), fx.GraphModule) and not isinstance(gm.get_submodule("blocks.1"), fx.GraphModule)
    torch.testing.assert_close(gm(x), model(x))


class _Written(nn.Module):
    """Block 0's output is written in place after it (``h.mul_(2)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        h.mul_(2)
        return self.blocks[1](h)


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_a_block_whose_output_is_written_in_place_after_it_stays_in_its_stage(method):
    gm = capture(_Written(), (torch.randn(2, 8),), method=method).gm
    assert "writes in place into its output" in refused_blocks(gm)["blocks.0"]
    assert list(outlinable_blocks(gm)) == ["blocks.1"]


class _Unused(nn.Module):
    """Each block holds a parameter its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        for block in self.blocks:
            block.register_parameter("unused", nn.Parameter(torch.ones(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x))


def test_an_exported_blocks_unused_parameter_goes_into_its_unit_under_its_name():
    """torch.export reads every parameter, used or not: the unit holds it (the cost model and the runtime agree)."""
    model, x = _Unused(), torch.randn(2, 8)
    gm = capture(model, (x,), method="export").gm
    named = [(q, id(p)) for q, p in gm.named_parameters()]
    assert outline_blocks(gm) == ["blocks.0", "blocks.1"]
    assert [(q, id(p)) for q, p in gm.named_parameters()] == named and "blocks.1.unused" in dict(named)
    torch.testing.assert_close(gm(x), model(x))
