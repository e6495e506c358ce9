"""Fused kernels in the memory model (``autosplit.passes.fusion``): a norm saves its input once, a gated
activation its two operands, an FP8 linear an FP8 copy of its input, each checked by hand."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autosplit.passes.annotate import annotate
from autosplit.passes.annotations import node_info
from autosplit.passes.capture import capture, flat_inputs
from autosplit.passes.fusion import UNFUSED, Fusion, fused, norm_paths
from autosplit.passes.memory_model import saved_bytes

ROWS, W, F_ = 64, 32, 96


class EagerRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, op by op: upcast, square, mean, rsqrt, scale, cast back, weight."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(W))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = EagerRMSNorm()
        self.gate, self.up, self.down = nn.Linear(W, F_, bias=False), nn.Linear(W, F_, bias=False), nn.Linear(F_, W, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.gate(self.norm(x))) * self.up(self.norm(x)))


def _saved(fusion, float8=()):
    x = torch.randn(ROWS, W, requires_grad=True)
    model = Block()
    captured = capture(model, (x,), method="symbolic_trace")
    gm = annotate(captured, flat_inputs(captured, (x,), {}))
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    infos = fused(nodes, [node_info(n) for n in nodes], fusion, float8)
    own = [i.saved_bytes - i.weight_copy_bytes for i in infos]
    return model, nodes, sum(saved_bytes(gm, nodes, infos, own)[0])


def test_fused_norm_gated_activation_and_fp8_inputs_save_what_the_kernels_keep():
    model, nodes, eager = _saved(UNFUSED)
    assert norm_paths(model) == {"norm"}
    act = ROWS * F_ * 4  # one fp32 activation of the MLP's width
    _, _, norm = _saved(Fusion(norms=norm_paths(model)))
    _, _, both = _saved(Fusion(norms=norm_paths(model), gated=True))
    assert both == norm - act  # the product keeps gate and up, not silu(gate)
    # the fused norm (called twice: one module, one region) keeps x, which nothing else saved; the eager one keeps
    # its fp32 copy, the scaled fp32 product and more: fusing saves bytes
    assert norm < eager
    linears = [i for i, n in enumerate(nodes) if n.op == "call_module" and n.target in ("gate", "up", "down")]
    _, _, fp8 = _saved(Fusion(norms=norm_paths(model), gated=True, fp8_inputs=True), linears)
    # gate and up each read a call of the norm: an FP8 copy of each (ROWS·W bytes) instead of the fp32 one
    # (4·ROWS·W); down's input: ROWS·F_ bytes instead of 4·ROWS·F_
    assert fp8 == both - 2 * 3 * ROWS * W - 3 * ROWS * F_


class GroupedAttention(nn.Module):
    """Grouped-query attention in one call, 8 query heads over 2 key/value heads, each read as a transformer's
    projections make them: (batch, sequence, heads, dim) viewed as (batch, heads, sequence, dim)."""

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2


def test_fused_attention_keeps_grouped_heads_in_place_and_a_log_sum_exp_per_row():
    """B=2, H=8 query heads, 2 key/value heads, L=16, d=8, bf16. A GPU's fused kernel keeps q, k and v as given, its
    output and an fp32 log-sum-exp per (b, h, row): 2·B·H·L·d + 2·2·B·2·L·d + 2·B·H·L·d + 4·B·H·L bytes, whatever
    the CPU kernel annotation replays keeps."""
    B, H, KV, L, D = 2, 8, 2, 16, 8
    q = torch.randn(B, L, H, D, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, L, KV, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    captured = capture(GroupedAttention(), (q, k, v), method="symbolic_trace")
    gm = annotate(captured, flat_inputs(captured, (q, k, v), {}))
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]

    def total(fusion):
        infos = fused(nodes, [node_info(n) for n in nodes], fusion)
        made = {n.name: i.output_bytes for n, i in zip(nodes, infos)}
        attention = next(i for n, i in zip(nodes, infos) if "scaled_dot_product" in str(n.target))
        return attention.saved_bytes + sum(made[name] for name in attention.saved_inputs)

    expected = 2 * B * H * L * D + 2 * 2 * B * KV * L * D + 2 * B * H * L * D + 4 * B * H * L
    assert total(Fusion(attention=True)) == expected
