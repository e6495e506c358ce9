"""The FLOP formulas torch's ``FlopCounterMode`` lacks, given to it by annotation (:mod:`autosplit.passes.annotate`).

Annotation replays every node on CPU fake tensors, whatever devices the plan is for, so the kernels it
counts are the CPU ones: the fused oneDNN RNN layer, the CPU flash-attention kernel, torch's grouped matmul and
transformers' CPU fallback of it (the experts') have no formula in torch, and would count as no work at all.

Usage::

    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        ...
"""

from __future__ import annotations

import math

import torch

__all__ = ["FLOP_FORMULAS", "RNN_FLOPS", "causal_share", "flop_formulas"]

aten = torch.ops.aten


def _rnn_layer_flops(input_shape, w_ih, w_hh, *_args, out_shape=None, **_kwargs) -> int:
    """One LSTM/GRU layer's gate matmuls over every time step: 2 · tokens · (|W_ih| + |W_hh|)."""
    tokens = input_shape[0] * input_shape[1]
    return 2 * tokens * (w_ih[0] * w_ih[1] + w_hh[0] * w_hh[1])


def _rnn_layer_backward_flops(input_shape, w_ih, w_hh, *args, out_shape=None, **kwargs) -> int:
    """Gradients of the inputs and of the weights: twice the forward's matmuls."""
    return 2 * _rnn_layer_flops(input_shape, w_ih, w_hh)


RNN_FLOPS = {aten.mkldnn_rnn_layer: _rnn_layer_flops, aten.mkldnn_rnn_layer_backward: _rnn_layer_backward_flops}
"""FlopCounterMode has no formula for the fused CPU RNN kernel that ``nn.LSTM`` runs (oneDNN; an
LSTM with projections runs decomposed into matmuls, which it counts): without these, analytic
costs would see no LSTM compute at all."""


def causal_share(s_q: int, s_k: int) -> float:
    """The share of the ``s_q × s_k`` score blocks a causal kernel computes: the query ``i`` sees the keys ``0..i``
    (``is_causal``, aligned at the top left as torch aligns it), and the flash kernels skip the blocks it masks
    whole — about half of a square, which is what they run (FlopCounterMode counts every block)."""
    seen = s_q * (s_q + 1) / 2 if s_q <= s_k else s_k * (s_k + 1) / 2 + (s_q - s_k) * s_k
    return seen / (s_q * s_k)


def _cpu_flash_flops(query, key, value, dropout_p=0.0, is_causal=False, *_args, out_shape=None, **_kwargs) -> int:
    """The CPU flash-attention kernel's forward, counted as torch counts its GPU flash kernel: the two
    matmuls of attention, ``4·b·h·s_q·s_k·d``, of the score blocks the kernel runs (:func:`causal_share` of them
    under ``is_causal``; an explicit mask hides no block from the kernel)."""
    from torch.utils.flop_counter import sdpa_flop_count

    share = causal_share(query[-2], key[-2]) if is_causal else 1.0
    return round(sdpa_flop_count(query, key, value) * share)


def _cpu_flash_backward_flops(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *_args,
                              out_shape=None, **_kwargs) -> int:
    """Its backward as torch counts the GPU flash kernel's: the scores recomputed and four matmuls, ``10·b·h·s_q·s_k·d``,
    of the blocks its forward ran."""
    from torch.utils.flop_counter import sdpa_backward_flop_count

    share = causal_share(query[-2], key[-2]) if is_causal else 1.0
    return round(sdpa_backward_flop_count(grad_out, query, key, value) * share)


def _grouped_mm_flops(input, weight, *_args, out_shape=None, **_kwargs) -> int:
    """A grouped matmul of the experts' rows, ``(S, K) × (E, K, N)``: each row meets one expert, ``2·S·K·N``
    whatever the routing; batched ``(E, M, K) × (E, K, N)`` the same per output element, ``2·|out|·K``."""
    return 2 * math.prod(out_shape) * input[-1]


def _grouped_mm_backward_flops(input, weight, *_args, out_shape=None, **_kwargs) -> int:
    """The gradients of its rows and of its experts' weights: twice the forward."""
    return 2 * _grouped_mm_flops(input, weight, out_shape=(input[0], weight[-1]))


def _aten_grouped_mm_flops(input, mat2, *_args, out_shape=None, **_kwargs) -> int:
    """torch's ``_grouped_mm`` (what transformers runs its experts with on a GPU, and on fake tensors): ``2·|out|·K``
    where a 3-D operand holds the groups — rows ``(S, K) × (E, K, N)``, batched ``(E, M, K) × (E, K, N)`` — and
    ``2·K·S·N`` for two 2-D operands split by offsets into ``(E, K, N)`` (the experts' weight gradients: each row
    in one group, not in all ``E``)."""
    if len(input) == 2 and len(mat2) == 2:
        return 2 * input[0] * input[1] * mat2[1]
    return 2 * math.prod(out_shape) * input[-1]


FLOP_FORMULAS = {**RNN_FLOPS, aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
                 aten._grouped_mm: _aten_grouped_mm_flops}


def flop_formulas() -> dict:
    """:data:`FLOP_FORMULAS`, and the grouped matmul that transformers' mixture-of-experts layers run on a CPU
    (``torch.ops.transformers.grouped_mm_fallback``) where transformers has registered it by now: asked at
    annotation, since a model's library may be imported after autosplit."""
    if not hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        return FLOP_FORMULAS
    return {**FLOP_FORMULAS, torch.ops.transformers.grouped_mm_fallback: _grouped_mm_flops,
            torch.ops.transformers.grouped_mm_fallback_backward: _grouped_mm_backward_flops}
"""What FlopCounterMode lacks, given to it: the RNN kernels above, and the flash-attention kernel that
``scaled_dot_product_attention`` runs on CPU tensors, which annotation's fake tensors are whatever the
plan's devices. Without it every captured graph counted no attention FLOPs, a large share of a long
sequence's work (``benchmarks/plan_llms.py`` reports each model's as ``attention_flops_share``)."""
