"""Tensor-parallel rules read from the captured graph (DESIGN §4.9): column/row pairs found by
following the split through the ops, on a traced GPT, an exported ``transformers`` Llama and small
planted models; the shards they give compute the unsplit output (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autosplit.compiler.trace import trace
from autosplit.errors import ConstraintError
from autosplit.options import PlanOptions
from autosplit.passes.tensor_parallel import TensorParallelRules, check_degree, tensor_parallel_rules
from tests.helpers import seeded_gpt

BATCH, SEQ, HIDDEN, VOCAB = 2, 8, 64, 128


def _rules(model: nn.Module, inputs: tuple, config=None):
    traced = trace(model, inputs, {}, method="auto")
    return traced.captured, tensor_parallel_rules(traced.captured, config)


def _node(captured, path: str, op: str = "") -> str:
    """The one node of module ``path`` whose name starts with ``op`` (a linear, an embedding)."""
    found = [n.name for n in captured.gm.graph.nodes
             if captured.module_paths.get(n.name) == path and n.name.startswith(op) and n.op != "get_attr"]
    assert len(found) == 1, (path, found)
    return found[0]


@pytest.fixture(scope="module")
def llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    captured, rules = _rules(model, (torch.randint(0, VOCAB, (BATCH, SEQ)),), model.config)
    assert captured.method == "export"
    return captured, rules


def test_llama_pairs_attention_and_mlp_and_splits_the_vocabulary(llama):
    captured, rules = llama
    expected = {"model.embed_tokens.weight": 0, "lm_head.weight": 0}
    for i in range(2):
        at = f"model.layers.{i}."
        expected.update({f"{at}self_attn.{p}_proj.weight": 0 for p in "qkv"})
        expected.update({f"{at}mlp.{p}_proj.weight": 0 for p in ("gate", "up")})
        expected.update({f"{at}self_attn.o_proj.weight": 1, f"{at}mlp.down_proj.weight": 1})
    assert dict(rules.shards) == expected
    norms = {f"model.layers.{i}.{n}_layernorm" for i in range(2) for n in ("input", "post_attention")}
    assert set(rules.replicated) == {"model.norm", *norms}
    split = {captured.module_paths[n] for n in rules.split_nodes}
    assert "model.layers.0.self_attn" in split and not any("layernorm" in p or p == "model.norm" for p in split)


def test_llama_collectives_reduce_each_pair_once(llama):
    captured, rules = llama
    graph = {n.name: n for n in captured.gm.graph.nodes}
    row, fp32 = BATCH * SEQ * HIDDEN * 4, 4
    forward = {_node(captured, f"model.layers.{i}.{p}", "linear"): row
               for i in range(2) for p in ("self_attn.o_proj", "mlp.down_proj")}
    forward[_node(captured, "model.embed_tokens", "embedding")] = row
    forward[_node(captured, "lm_head", "linear")] = BATCH * SEQ * VOCAB * fp32  # all-gathered logits
    assert dict(rules.forward_collectives) == forward
    backward = {}
    for i in range(2):
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            inputs = {graph[_node(captured, f"model.layers.{i}.{p}", "linear")].args[0].name for p in group}
            assert len(inputs) == 1, inputs  # q, k, v read one normed state: one all-reduce
            backward[inputs.pop()] = row
    backward[graph[_node(captured, "lm_head", "linear")].args[0].name] = row
    assert dict(rules.backward_collectives) == backward


def test_llama_degree_must_divide_the_heads_by_their_config_names(llama):
    _, rules = llama
    divisors = dict(rules.divisors)
    assert divisors["num_attention_heads"] == 4 and divisors["num_key_value_heads"] == 2
    assert divisors["intermediate_size"] == 128 and divisors["vocab_size"] == VOCAB
    with pytest.raises(ConstraintError, match="num_key_value_heads 2 is not divisible by tp 4") as e:
        check_degree(rules, 4)
    assert "num_attention_heads" not in str(e.value) and "[1, 2]" in str(e.value)
    check_degree(rules, 2)
    check_degree(rules, 1)
    with pytest.raises(ConstraintError, match="tensor_parallel"):  # a degree below 1 never reaches the rules
        PlanOptions(tensor_parallel=0)


def test_gpt_fused_qkv_stays_replicated_and_its_mlp_shards():
    model, inputs = seeded_gpt(2)
    _, rules = _rules(model, inputs)
    assert "fused projection" in rules.replicated["blocks.0.attn.qkv"]
    assert "row-parallel partner" in rules.replicated["blocks.0.attn.proj"]
    assert not any(".attn." in p for p in rules.shards)
    for i in range(2):
        assert rules.shards[f"blocks.{i}.fc.weight"] == rules.shards[f"blocks.{i}.fc.bias"] == 0
        assert rules.shards[f"blocks.{i}.out.weight"] == 1 and f"blocks.{i}.out.bias" not in rules.shards
        assert f"blocks_{i}_out" in rules.forward_collectives and f"blocks_{i}_ln2" in rules.backward_collectives
    # wte is tied: looked up (vocabulary-parallel) and read by the head (column-parallel): dim 0 in both
    assert rules.shards["wte.weight"] == 0 and "wpe" in rules.replicated and "ln_f" in rules.replicated
    assert {"embedding", "linear"} <= set(rules.forward_collectives)
    assert dict(rules.divisors) == {"the 64 output features of blocks.0.fc": 64, "the 64-row vocabulary of head": 64}


def _shard(model: nn.Module, rules: TensorParallelRules, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s parameters: split ones sliced along their dimension; whole ones on rank 0 only
    (a row-parallel bias is added once, after the all-reduce)."""
    return {n: p.chunk(tp, rules.shards[n])[rank] if n in rules.shards else p * (rank == 0)
            for n, p in model.named_parameters()}


def _ranks_sum(model: nn.Module, rules: TensorParallelRules, x: torch.Tensor, tp: int) -> torch.Tensor:
    return sum(torch.func.functional_call(model, _shard(model, rules, tp, r), (x,)) for r in range(tp))


def test_planted_mlp_is_one_pair_and_its_shards_compute_the_output():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    _, rules = _rules(model, (x,))
    assert dict(rules.shards) == {"0.weight": 0, "0.bias": 0, "2.weight": 1}
    assert dict(rules.forward_collectives) == {"_2": 3 * 8 * 8}
    assert dict(rules.backward_collectives) == {"input_1": 3 * 8 * 8}
    assert rules.split_nodes == {"_0", "_1", "_2"} and rules.divisors == (("the 32 output features of 0", 32),)
    torch.testing.assert_close(_ranks_sum(model, rules, x, 2), model(x), rtol=1e-12, atol=1e-12)


class Attention(nn.Module):
    """Separate q, k, v projections and torch's fused attention: heads split over tp."""

    def __init__(self, width: int = 16, head_dim: int = 4):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.head_dim = head_dim

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, s, -1))


def test_planted_attention_splits_its_heads_and_computes_the_output():
    torch.manual_seed(0)
    model = Attention().double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    _, rules = _rules(model, (x,))
    assert dict(rules.shards) == {"q.weight": 0, "k.weight": 0, "v.weight": 0, "o.weight": 1}
    assert dict(rules.divisors)["the 4 heads of the root"] == 4
    assert list(rules.backward_collectives) == ["x"]
    check_degree(rules, 4)
    with pytest.raises(ConstraintError, match="the 4 heads of the root 4 is not divisible by tp 8"):
        check_degree(rules, 8)
    # every rank adds the whole residual x to its partial output: count it once, as the row bias above
    torch.testing.assert_close(_ranks_sum(model, rules, x, 2) - x, model(x), rtol=1e-12, atol=1e-12)


class SharedWeight(nn.Module):
    """One weight read as a column-parallel linear and again as its row-parallel partner."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return F.linear(torch.relu(self.a(x)), self.a.weight)


def test_a_parameter_split_two_ways_stays_replicated():
    _, rules = _rules(SharedWeight(), (torch.randn(2, 8),))
    assert dict(rules.shards) == {} and not rules.split_nodes and not rules.forward_collectives
    assert "inconsistently" in rules.replicated["a"]
    check_degree(rules, 3)  # nothing split: any degree


def test_tied_llama_with_fused_attention_names_its_table_as_named_parameters_does():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa", tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    captured, rules = _rules(model, (torch.randint(0, VOCAB, (BATCH, SEQ)),), model.config)
    assert any("scaled_dot_product_attention" in str(n.target) for n in captured.gm.graph.nodes)
    assert set(rules.shards) <= dict(model.named_parameters()).keys()
    assert rules.shards["model.embed_tokens.weight"] == 0 and rules.shards["model.layers.0.self_attn.o_proj.weight"] == 1
    assert all(rules.shards[f"model.layers.0.self_attn.{p}_proj.weight"] == 0 for p in "qkv")
    assert dict(rules.divisors)["num_key_value_heads"] == 2
