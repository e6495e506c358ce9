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
"""

from __future__ import annotations

from typing import Any

from benchmarks.published_rows import SHAPE

__all__ = ["PUBLISHED", "build", "family", "published_shape"]

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
"""Published shapes by the record's ``model_canonical``: what a row that names the model without its shape is built as."""


def family(canonical: str) -> str:
    """``"gpt3"``, ``"nemotron"`` or ``"llama"`` for a ``model_canonical`` name (the module docstring says what each is)."""
    name = canonical.strip().lower()
    if name.startswith("gpt3"):
        return "gpt3"
    if name.startswith("nemotron"):
        return "nemotron"
    return "llama"


def published_shape(canonical: str) -> dict[str, Any] | None:
    """The published shape of ``canonical`` with its family, or ``None`` where the record's models do not include it."""
    shape = PUBLISHED.get(canonical.strip().lower())
    return None if shape is None else {**shape, "family": family(canonical)}


def build(shape: dict[str, Any], seq: int, pipelined: bool = False) -> Any:
    """The model of ``shape`` (its ``family`` defaulting to ``llama``) on the meta device, for pipeline stages
    where ``pipelined`` (GPT-3's embedding then untied, as above); its attention one
    scaled-dot-product call over the grouped key/value heads (``TRANSFORMERS_SDPA_FORCE_GQA``: the engines' flash
    kernels read them in place; transformers would otherwise repeat them to every query head under a mask)."""
    import os

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, NemotronConfig, NemotronForCausalLM

    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"  # the process costs one row: nothing else reads it
    common = dict(hidden_size=shape["hidden_size"], intermediate_size=shape["ffn_hidden_size"], num_hidden_layers=shape["num_layers"],
                  num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_kv_heads"],
                  vocab_size=shape["vocab_size"], max_position_embeddings=seq)
    kind = shape.get("family", "llama")
    config: Any
    cls: Any
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
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return cls(config)
