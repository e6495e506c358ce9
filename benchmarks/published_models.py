"""The models of the published record, built on the meta device as ``benchmarks/published.py`` costs them.

A row that gives its model's shape (layers, hidden size, heads, KV heads, FFN width, vocabulary) is built from
it; a row that names a model without its shape takes the shape that model was published with, from
:data:`PUBLISHED`, each entry with its source. Three families, by their MLP and norm:

- ``llama``: gated SiLU MLP (three matrices), RMSNorm, no biases (Llama 2 and 3, and every model whose name does
  not start as below: the record's other dense models are gated);
- ``nemotron``: squared-ReLU MLP (two matrices), LayerNorm, no biases, half the head dimension rotary (``nemotron…``);
- ``gpt3``: GELU MLP (two matrices), LayerNorm, biases on every linear (``gpt3…``, NeMo's GPT-3 configs). Built as a
  transformers ``NemotronForCausalLM`` with those settings: its rotary positions stand in for GPT-3's learned
  ones, which add an embedding of ``seq × hidden`` and no GEMM. Its embedding and head share one matrix without
  pipeline stages; with them, Megatron keeps a copy on the first and the last stage (the two copies' gradients
  summed over a group of two, a collective of one matrix per step), so the model is built untied.

Mixtures of experts are built whole from the configuration each was published with (:data:`MOE`), in
transformers' own classes, their experts run as grouped GEMMs (``grouped_mm``: the engines' kernel); the row's
shape cells, where it gives them, are checked against it:

- ``qwen3_moe``: ``Qwen3MoeForCausalLM`` (every layer a mixture, top 8 of 128 experts);
- ``mixtral``: ``MixtralForCausalLM`` (every layer a mixture, top 2 of 8 experts);
- ``deepseek_v3``: ``DeepseekV3ForCausalLM`` (multi-head latent attention, one shared expert beside the routed
  ones, the first layers dense; its multi-token prediction module is not built: transformers has none);
- ``gpt_oss``: ``GptOssForCausalLM`` (top 4 of 128 experts with biases; every other layer's attention on a sliding
  window, as :func:`sliding_attention` runs it).
"""

from __future__ import annotations

from typing import Any

from benchmarks.published_rows import SHAPE

__all__ = ["CAUSAL", "PUBLISHED", "build", "causal_attention", "family", "published_shape", "sliding_attention"]

_ROWS: dict[str, tuple[int, ...]] = {  # layers, hidden size, heads, KV heads, FFN width, vocabulary (the CSV's SHAPE columns)
    # Llama 2 (Touvron et al., 2023, Table 1; the config.json of meta-llama/Llama-2-{7,13,70}b-hf)
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000),
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000),
    # NeMo's GPTConfig5B / 20B / 175B (nemo/collections/llm/gpt/model/base.py; 175B is Brown et al., 2020, Table 2.1);
    # GPT-2's 50,257 tokens padded to a multiple of 128, as Megatron pads them
    "gpt3-5b": (24, 4096, 32, 32, 16384, 50304),
    "gpt3-20b": (44, 6144, 48, 48, 24576, 50304),
    "gpt3-175b": (96, 12288, 96, 96, 49152, 50304),
    # NeMo's Nemotron4Config15B / 340B (nemo/collections/llm/gpt/model/nemotron.py; Nemotron-4 15B and 340B reports:
    # 256,000 tokens); Nemotron-3 22B from NeMo-Framework-Launcher's conf/training/nemotron/nemotron_22b.yaml (multi-head
    # attention, squared ReLU; its tokenizer is not named there: Nemotron's 256,000 assumed)
    "nemotron-15b": (32, 6144, 48, 8, 24576, 256000),
    "nemotron-22b": (40, 6144, 48, 48, 24576, 256000),
    "nemotron-340b": (96, 18432, 96, 8, 73728, 256000),
}
PUBLISHED: dict[str, dict[str, Any]] = {name: dict(zip(SHAPE, row, strict=True)) for name, row in _ROWS.items()}

MOE: dict[str, tuple[str, dict[str, Any]]] = {  # family, and its transformers config's fields beside the defaults
    # the config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (head_dim 128, not hidden / heads)
    "qwen3-30b-a3b": ("qwen3_moe", dict(num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                        num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False)),
    "qwen3-235b-a22b": ("qwen3_moe", dict(num_hidden_layers=94, hidden_size=4096, num_attention_heads=64, num_key_value_heads=4,
                                          head_dim=128, intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
                                          num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False)),
    # NeMo's MixtralConfig8x22B (nemo/collections/llm/gpt/model/mixtral.py): 56 layers, hidden 6144, 48 heads over 8 query
    # groups, FFN 16384, 8 experts, top 2, untied, rope base 1e6; its vocabulary is the tokenizer's, Mistral's v3 one of 32,768
    # (the 8x22B base's config.json says 32,000: 0.1% of the FLOPs apart)
    "mixtral-8x22b": ("mixtral", dict(num_hidden_layers=56, hidden_size=6144, num_attention_heads=48, num_key_value_heads=8,
                                      intermediate_size=16384, num_local_experts=8, num_experts_per_tok=2, vocab_size=32768,
                                      rope_theta=1e6, tie_word_embeddings=False)),
    # deepseek-ai/DeepSeek-V3's config.json: transformers' DeepseekV3Config defaults (61 layers, 3 dense, 256 + 1 experts)
    "deepseek-v3": ("deepseek_v3", {}),
    # moonshotai/Kimi-K2-Instruct's config.json: DeepSeek-V3's architecture with 384 experts, 64 heads, 1 dense layer
    "kimi-k2": ("deepseek_v3", dict(n_routed_experts=384, num_attention_heads=64, first_k_dense_replace=1, n_group=1, topk_group=1,
                                    vocab_size=163840)),
    # openai/gpt-oss-120b's config.json: transformers' GptOssConfig defaults (36 layers, 128 experts, top 4, attention on a
    # sliding window of 128 in every other layer, sinks); gpt-oss-20b's: 24 layers, 32 experts
    "gpt-oss-120b": ("gpt_oss", {}),
    "gpt-oss-20b": ("gpt_oss", dict(num_hidden_layers=24, num_local_experts=32)),
}
"""The mixtures of experts of the record by ``model_canonical``: their family and published configuration."""
"""Published shapes by the record's ``model_canonical``: what a row that names the model without its shape is built as."""


def family(canonical: str) -> str:
    """``"gpt3"``, ``"nemotron"``, ``"llama"`` or a mixture's (:data:`MOE`) for a ``model_canonical`` name (the module
    docstring says what each is)."""
    name = canonical.strip().lower()
    if name in MOE:
        return MOE[name][0]
    if name.startswith("gpt3"):
        return "gpt3"
    if name.startswith("nemotron"):
        return "nemotron"
    return "llama"


def published_shape(canonical: str) -> dict[str, Any] | None:
    """The published shape of ``canonical`` with its family, or ``None`` where the record's models do not include it."""
    name = canonical.strip().lower()
    if name in MOE:
        return {"family": MOE[name][0], "canonical": name, "num_layers": moe_config(name).num_hidden_layers}
    shape = PUBLISHED.get(name)
    return None if shape is None else {**shape, "family": family(canonical)}


def moe_config(canonical: str) -> Any:
    """The transformers configuration a mixture of experts of the record was published with (:data:`MOE`)."""
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig

    kind, fields = MOE[canonical]
    made = {"qwen3_moe": Qwen3MoeConfig, "deepseek_v3": DeepseekV3Config, "mixtral": MixtralConfig, "gpt_oss": GptOssConfig}[kind]
    config = made(**{k: v for k, v in fields.items() if k != "head_dim"})
    if "head_dim" in fields:  # Qwen3MoeConfig does not take it; the attention reads it when set
        config.head_dim = fields["head_dim"]
    config._experts_implementation = "grouped_mm"
    return config


CAUSAL = "engine_causal"  # no "sdpa" or "flash" in it: transformers would check its own paths for those (GPT-OSS has neither)
"""The attention the published stand-ins run (:func:`causal_attention`)."""


def causal_attention() -> str:
    """Register, and name, the attention the engines run for a causal language model: scaled-dot-product
    attention with ``is_causal`` and no mask tensor, so that the flash kernels skip the masked score blocks
    (Megatron's ``AttnMaskType.causal``, torchtitan's ``is_causal=True``), and annotation counts the blocks they run
    (:func:`autosplit.passes.flop_formulas.causal_share`). transformers' ``sdpa`` materialises its causal mask
    under ``torch.export``: a ``seq × seq`` tensor a layer reads and no engine makes. Under this name its mask
    function makes none for a batch without a padding mask: a benchmark's pretraining batch, unpadded and unpacked.
    (Exported, transformers cannot read the positions to rule out packed sequences, and asks for a causal mask anded
    with a packing one; the positions it would read are ``0 … s − 1``.) A layer with a sliding window runs
    :func:`sliding_attention`. Any other mask is transformers' own."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attention_mask") is None:
            return None  # transformers' SDPA then passes is_causal; a sliding layer windows itself
        return sdpa_mask(*args, **kwargs)

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        window = kwargs.pop("sliding_window", None)
        if window and attention_mask is None and query.shape[2] > window:
            return sliding_attention(query, key, value, window, kwargs.get("scaling")), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionMaskInterface.register(CAUSAL, mask)
    AttentionInterface.register(CAUSAL, attention)
    return CAUSAL


def sliding_attention(query: Any, key: Any, value: Any, window: int, scale: float | None = None) -> Any:
    """Causal attention over the last ``window`` positions (a query at ``i`` sees keys ``i − window < j ≤ i``, as
    transformers' sliding window), with the score blocks a flash kernel runs for it: the sequence in chunks of
    ``window`` queries, each against its own chunk and the one before, under a band mask — ``2·window`` keys per
    query where the kernel computes about ``window`` (and the blocks the band cuts), not the ``seq`` a whole mask
    would count (:func:`autosplit.passes.flop_formulas.causal_share` counts a mask tensor's every pair). GPT-OSS's
    sinks (a logit per head added to each softmax's denominator: a few FLOPs a row) are left out. Output as
    transformers' attention functions return it: ``(batch, seq, heads, dim)``."""
    import torch
    import torch.nn.functional as F

    b, h, s, _ = query.shape
    n = -(-s // window)
    pad = n * window - s

    def chunks(t: Any) -> Any:  # (b, n, heads, window, d), zero rows past the end
        return F.pad(t, (0, 0, 0, pad)).unflatten(2, (n, window)).transpose(1, 2)

    def paired(t: Any) -> Any:  # each chunk after the one before it (zeros before the first): (b, n, heads, 2·window, d)
        return torch.cat([torch.cat([torch.zeros_like(t[:, :1]), t[:, :-1]], dim=1), t], dim=3)

    q, k, v = chunks(query), paired(chunks(key)), paired(chunks(value))
    rows = torch.arange(window, device=query.device)[:, None] + window  # a query's position in its pair of chunks
    cols = torch.arange(2 * window, device=query.device)[None, :]
    band = ((cols <= rows) & (cols > rows - window)).expand(n, 1, window, 2 * window).clone()
    band[0, :, :, :window] = False  # the first chunk has none before it
    out = F.scaled_dot_product_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), attn_mask=band.repeat(b, 1, 1, 1),
                                         scale=scale, enable_gqa=k.shape[2] != h)
    return out.unflatten(0, (b, n)).transpose(2, 3).flatten(1, 2)[:, :s].contiguous()


def build(shape: dict[str, Any], seq: int, pipelined: bool = False) -> Any:
    """The model of ``shape`` (its ``family`` defaulting to ``llama``) on the meta device, for pipeline stages
    where ``pipelined`` (GPT-3's embedding then untied, as above); its attention one scaled-dot-product call over
    the grouped key/value heads, causal as the engines run it (:func:`causal_attention`: with no mask tensor,
    transformers' SDPA reads grouped heads in place, as the engines' flash kernels do, rather than repeating them)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, NemotronConfig, NemotronForCausalLM

    config: Any
    cls: Any
    if shape.get("canonical") in MOE:
        from transformers import AutoModelForCausalLM

        config = moe_config(shape["canonical"])
        config.max_position_embeddings = max(seq, config.max_position_embeddings)
        config._attn_implementation = causal_attention()
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    common = dict(hidden_size=shape["hidden_size"], intermediate_size=shape["ffn_hidden_size"], num_hidden_layers=shape["num_layers"],
                  num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_kv_heads"],
                  vocab_size=shape["vocab_size"], max_position_embeddings=seq)
    kind = shape.get("family", "llama")
    if kind == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif kind in ("nemotron", "gpt3"):
        gpt3 = kind == "gpt3"
        config = NemotronConfig(**common, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                                hidden_act="gelu" if gpt3 else "relu2", attention_bias=gpt3, mlp_bias=gpt3,
                                tie_word_embeddings=gpt3 and not pipelined)
        cls = NemotronForCausalLM
    else:
        raise ValueError(f"no model family {kind!r}: llama, nemotron or gpt3")
    config._attn_implementation = causal_attention()
    with torch.device("meta"):
        return cls(config)
