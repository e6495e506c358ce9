"""Published 3D-parallel recipes for Llama 3 at scale, as ``autosplit.Recipe`` s (simulated: the published GPUs' presets).

Each entry: the model, the cluster (``Cluster.of(gpu, 8 · nodes, engine=...)``: the GPU the run had and the
engine profile of its stack, fitted to the published record, :mod:`autosplit.engine_profiles`), the global batch
of 8,192-token rows, the recipe (degrees, layers per stage, schedule, micro-batches, recomputation), and the
figure its authors measured, with its source. Every published figure here ran its linears in FP8 (tensorwise
scaling: torchao's Float8 under ``torch.compile`` in torchtitan's, Transformer Engine's current scaling in
Megatron's), and so are the recipes and autosplit's plans costed (``float8="tensorwise"``).
Each recipe runs sequence parallelism (torchtitan's ``SequenceParallel`` norms, Megatron's
``--sequence-parallel``), costed here with ``sequence_parallel=True``, as autosplit's runtime runs it.

- ``titan-70b``: torchtitan, Llama-3.1-70B on 256 H100s, FSDP 32 × TP 8, local batch 16 (global 512),
  full activation checkpointing: 829 tokens/s/GPU (876 with async TP) — torchtitan
  ``benchmarks/llama3_h100_202412_torchtitan.md`` Table 4 (Float8, torch.compile);
- ``titan-405b``: torchtitan, Llama-3.1-405B on 512 H100s, FSDP 8 × TP 8 × PP 8, Interleaved 1F1B
  (two stages per rank), local batch 32 (global 256), full checkpointing: 128 tokens/s/GPU (100 with
  1F1B) — Table 5 (Float8, torch.compile, async TP);
- ``megatron-70b``: Megatron-Bridge, Llama-3-70B on 64 H100s, TP 4 × PP 8 × VP 5 (DP 2), global batch
  128, micro-batch 1 (64 per copy): 1,602 tokens/s/GPU — Megatron-Bridge ``docs/performance-summary.md``,
  25.11 container, DGX-H100 (FP8-CS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RECIPES", "ScaleRecipe"]


@dataclass(frozen=True)
class ScaleRecipe:
    model: str
    nodes: int
    rows: int
    """The global batch, in rows of 8,192 tokens."""
    published: float
    """tokens/s/GPU as measured by the recipe's authors."""
    source: str
    data_parallel: int = 1
    replicate: str = "replicate"
    tensor_parallel: int = 1
    stages: int = 1
    """Pipeline stages (ranks × stages per rank), as torchtitan's even split deals the layers out."""
    options: Any = None
    input_weight: int = 1
    output_weight: int = 1
    gpu: str = "H100"
    """The GPU kind the run had (:data:`autosplit.gpu_presets.SYSTEMS`)."""
    engine: str = "megatron-te"
    """The engine profile of its stack (:data:`autosplit.engine_profiles.ENGINES`)."""
    async_tp: bool = False
    """Whether its tensor-parallel collectives overlapped the GEMMs (torchtitan's async TP, Megatron's TP overlap)."""
    megatron: str | None = None
    """Megatron-LM's flags, layout included, read by ``Planner.manual("megatron:…")``: the whole recipe
    (degrees, layout, micro-batches), in place of the fields above."""


RECIPES: dict[str, ScaleRecipe] = {
    "titan-70b": ScaleRecipe(
        "llama3-70b", nodes=32, rows=512, published=829.0, data_parallel=32, replicate="fully_shard", tensor_parallel=8,
        source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 4 (FSDP 32 x TP 8, Float8, torch.compile)",
        gpu="H100-500W", engine="torch-compile",
        options={"checkpointing": "full", "micro_batches": 1, "sequence_parallel": True, "float8": "tensorwise"}),
    "titan-405b": ScaleRecipe(
        "llama3-405b", nodes=64, rows=256, published=128.0, data_parallel=8, replicate="fully_shard", tensor_parallel=8, stages=16,
        source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 5 (FSDP 8 x TP 8 x PP 8, Interleaved 1F1B, "
               "Float8, torch.compile, async TP)",
        gpu="H100-500W", engine="torch-compile", async_tp=True,
        options={"checkpointing": "full", "schedule": "interleaved1f1b", "stages_per_rank": 2, "micro_batches": 32,
                 "sequence_parallel": True, "float8": "tensorwise", "async_tp": True}),
    "megatron-70b": ScaleRecipe(
        "llama3-70b", nodes=8, rows=128, published=1602.0,
        source="Megatron-Bridge docs/performance-summary.md, 25.11, DGX-H100 (TP 4 x PP 8 x VP 5, MBS 1, GBS 128, FP8-CS)",
        # the layout of Megatron-Bridge's perf recipe llama3_70b_pretrain_64gpu_h100_fp8cs_config (perf_recipes/llama/h100/llama3.py);
        # no recompute flags: Megatron recomputes nothing; DP 2 = 64 GPUs / (TP 4 × PP 8); 64 micro-batches per copy;
        # the distributed optimizer is Megatron-Bridge's default (recipes/common.py: use_distributed_optimizer=True);
        # FP8-CS: Transformer Engine's current (tensorwise) scaling; its performance recipes set tp_comm_overlap
        megatron="--tensor-model-parallel-size 4 --pipeline-model-parallel-size 8 --pipeline-model-parallel-layout "
                 "'Et*2|(t*2|)*34,t*3|(t*2|)*3,tL' --micro-batch-size 1 --global-batch-size 128 --sequence-parallel --bf16 "
                 "--use-distributed-optimizer --fp8-format hybrid --fp8-recipe tensorwise --tp-comm-overlap", async_tp=True),
}
