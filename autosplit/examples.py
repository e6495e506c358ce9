"""Built-in models: the GPT-style transformer the demo plans (no download, any size), and
:func:`gpt`, a workload factory the command line takes as ``autosplit.examples:gpt``.

Usage::

    model = GPT(vocab=512, d_model=128, n_layers=4)
    logits = model(tokens, attention_mask=mask)

    autosplit plan autosplit.examples:gpt --devices "cpu*2" --batch 8
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTBlock", "gpt"]


class CausalSelfAttention(nn.Module):
    causal: torch.Tensor
    def __init__(self, d_model: int, n_heads: int, max_len: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the causal mask: a non-persistent buffer, which no checkpoint holds, filled
        again when the module is materialised from the meta device."""
        n = self.causal.shape[0]
        with torch.no_grad():
            self.causal.copy_(torch.tril(torch.ones(n, n, dtype=torch.bool, device=self.causal.device)))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.size(0), x.size(1), x.size(2)
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.n_heads))
        mask = self.causal[:T, :T]
        if key_mask is not None:
            mask = mask & key_mask[:, None, None, :].bool()
        att = att.masked_fill(~mask, -1e4).softmax(dim=-1)  # -1e4: as -inf after softmax, and within fp16 (autocast)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, max_len: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, max_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), key_mask)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2-style decoder with tied input/output embeddings and an optional attention mask.

    Size knobs: ``vocab``, ``d_model``, ``n_layers``, ``n_heads``, ``max_len``; ``tied=False``
    gives the head its own weight.
    """

    def __init__(
        self, vocab: int = 512, d_model: int = 64, n_layers: int = 4, n_heads: int = 4, max_len: int = 64, tied: bool = True,
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads, max_len) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight  # as in GPT-2
        # GPT-2's initialisation (Radford et al. 2019): N(0, 0.02) weights, zero biases. With
        # torch's N(0, 1) embedding the tied head's logits are so large that the softmax
        # gradients underflow to denormal floats, which CPUs compute several times slower.
        for module in self.modules():
            self._init_weights(module)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialisation of one module (the transformers convention, which
        :func:`autosplit.distribute` also follows when it materialises a stage of a meta model)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x, attention_mask)
        return self.head(self.ln_f(x))


def gpt(batch: int = 8, *, seq: int = 64, vocab: int = 512, d_model: int = 64, n_layers: int = 8, seed: int = 0) -> dict:
    """A workload for the command line: the GPT with an attention mask, a batch of random tokens,
    next-token targets and cross-entropy over them (seeded: every process builds the same)."""
    torch.manual_seed(seed)
    model = GPT(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=4, max_len=seq)
    tokens = torch.randint(0, vocab, (batch, seq))
    return {
        "model": model,
        "example_inputs": (tokens,),
        "example_kwargs": {"attention_mask": torch.ones_like(tokens)},
        "target": torch.randint(0, vocab, (batch, seq)),
        "loss_fn": _token_loss,
    }


def _token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())
