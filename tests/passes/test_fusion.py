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
