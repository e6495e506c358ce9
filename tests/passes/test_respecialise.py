"""An exported graph respecialised to another batch is the graph torch.export gives there, and planning
costs a share with it instead of a third export; where it cannot be sound it is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autosplit.compiler.trace import trace
from autosplit.passes.annotations import node_info
from autosplit.passes.capture import capture
from autosplit.passes.respecialise import respecialised

SEQ = 8


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def _at(model: torch.nn.Module, rows: int):
    return capture(model, (torch.zeros(rows, SEQ, dtype=torch.long),), {}, method="export")


def _args(captured) -> list:
    named = lambda value: torch.fx.node.map_arg(value, lambda n: n.name)  # noqa: E731 — nodes of two graphs, by name
    return [(n.name, named(n.args), named(n.kwargs)) for n in captured.gm.graph.nodes]


def test_respecialised_is_the_export_at_those_rows(llama: LlamaForCausalLM) -> None:
    eight, four, two, six = (_at(llama, r) for r in (8, 4, 2, 6))
    moved = [respecialised(eight, 8, four, 4, rows) for rows in (2, 6)]
    assert _args(eight) != _args(two)  # the batch is baked in: something moves
    assert [_args(m) for m in moved] == [_args(two), _args(six)]
    assert respecialised(eight, 8, four, 4, 1) is None  # one row: export may specialise a size-1 dimension
    assert respecialised(eight, 8, eight, 8, 2) is None  # two captures at one batch fix no line


def test_refused_where_the_graphs_differ_otherwise(llama: LlamaForCausalLM) -> None:
    eight, four = _at(llama, 8), _at(llama, 4)
    node = next(n for n in four.gm.graph.nodes if n.op == "call_function" and any(isinstance(a, float) for a in n.args))
    node.args = tuple(a * 2 if isinstance(a, float) else a for a in node.args)  # a float the batch does not move
    assert respecialised(eight, 8, four, 4, 2) is None


def test_shares_plan_on_respecialised_graphs_with_real_costs(llama: LlamaForCausalLM) -> None:
    traced = trace(llama, (torch.zeros(16, SEQ, dtype=torch.long),), {}, method="export")
    assert traced.captured.method == "export"
    traced.at_batch(2)  # the second real capture (8 rows)
    assert sorted(traced._exports) == [8, 16]
    share = traced.at_batch(4)  # 4 rows: respecialised, not exported
    assert sorted(traced._exports) == [8, 16] and share.fingerprint == traced.fingerprint
    real = trace(llama, (torch.zeros(4, SEQ, dtype=torch.long),), {}, method="export")
    infos = {n.name: node_info(n) for n in real.captured.gm.graph.nodes if "autosplit" in n.meta}
    assert infos and {n.name: node_info(n) for n in share.captured.gm.graph.nodes if "autosplit" in n.meta} == infos
    run, _ = share.at_micro_batch(2)  # a graph that runs is a real capture (2 rows), kept
    assert sorted(traced._exports) == [2, 8, 16] and run is traced._exports[2]
    one = traced.at_batch(16)  # one row: captured for real, the share's own graph whatever export specialises there
    assert one.batch == 1 and one.captured is traced._exports[1]
