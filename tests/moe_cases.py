"""Tiny mixture-of-experts causal LMs from ``transformers``' own classes, built from configs (no download):
Mixtral, Qwen3-MoE, DeepSeek-V3 (MLA, a shared expert, a first dense layer) and GPT-OSS (biased experts,
sliding-window layers, attention sinks). 4 experts, top 2, width 32, seeded; the ``batched_mm`` experts
kernel, which runs in float64 on a CPU (the default ``grouped_mm`` is float32-only there)."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
EXPERTS = 4
TOP_K = 2
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
MOE_LAYERS = {"mixtral": 2, "qwen3_moe": 2, "deepseek_v3": 2, "gpt_oss": 2}
"""The layers of each tiny model whose feed-forward is a mixture of experts (DeepSeek-V3's first is dense)."""


def moe_config(family: str, **overrides):
    import transformers

    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, max_position_embeddings=64,
                                  num_experts_per_tok=TOP_K, output_router_logits=True)
    config: Any
    if family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2,
                                            num_local_experts=EXPERTS)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                                             num_key_value_heads=2, num_experts=EXPERTS, decoder_sparse_step=1)
    elif family == "deepseek_v3":
        config = transformers.DeepseekV3Config(**common, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                                               first_k_dense_replace=1, n_routed_experts=EXPERTS, n_shared_experts=1, n_group=1,
                                               topk_group=1, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                                               qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
    elif family == "gpt_oss":
        config = transformers.GptOssConfig(**common, intermediate_size=16, num_hidden_layers=2, num_key_value_heads=2, head_dim=8,
                                           num_local_experts=EXPERTS, sliding_window=4,
                                           layer_types=["sliding_attention", "full_attention"])
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._experts_implementation = "batched_mm"
    return config


def moe_model(family: str, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """The family's tiny causal LM, seeded, never called."""
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(moe_config(family, **overrides))


def ids(seed: int = 1, rows: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
