"""autosplit's own plans of long sequences, context parallelism chosen with every other degree, beside the published layouts (simulated).

Four settings of issue 66, each on the meta device with the published GPUs' presets and fitted engine profiles:

- Llama-3.1-8B on 8 of torchtitan's H100s (96 GB, 500 W), FP8, compiled, full recomputation, local batch 1, at 32K
  (FSDP 8, CP 1: row 297 of ``../shared/published/runs.csv``, 3,890 tokens/s/GPU), 64K (FSDP 4, CP 2: 2,540) and 128K
  (FSDP 2, CP 4: row 299, 1,071) — torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md``, Table 2 (the 64K row is
  not in the shared file);
- Llama-3-70B on 64 H100s at 8K in BF16: Megatron-Bridge's recipe ``LLAMA3_70B_PRETRAIN_CONFIG_H100_BF16`` (TP 4 × PP 4 ×
  CP 2 × VP 5, global batch 128, micro-batch 1, the distributed optimizer; its ``scripts/performance`` presets), whose
  throughput is not published: only the two predictions stand side by side.

Each published layout is costed as ``benchmarks/published.py`` costs it, and autosplit plans the same model, cluster,
global batch, precision and stack with ``tensor_parallel``, ``data_parallel``, ``replicate``, ``context_parallel``, the
split, the micro-batches and the recomputation all ``"auto"`` (1F1B), in a fresh process each. Both figures are the same
cost model's: the ratio says whether autosplit's plan is ahead by that model, not on a cluster. The 70B setting is
planned again under ``--longer`` seconds (300): what the search finds given the time. Prints a table and writes
``benchmarks/results/plan_long.json``.

Usage::

    .venv/bin/python benchmarks/plan_long.py                 # 9 minutes (the 70B planned again given --longer 300 s)
    .venv/bin/python benchmarks/plan_long.py --settings llama3-8b-128k
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.plan_moe import arguments, compare  # noqa: E402  (run as a script: the root first)
from benchmarks.published_rows import read_csv  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "plan_long.json"


def settings(csv: Path) -> dict[str, dict[str, Any]]:
    """The four settings' published layouts as ``benchmarks/published.py`` specs (the module docstring)."""
    rows = {c.row_id: c.spec for c in read_csv(csv, {"297", "299", "189"})}
    short, long, megatron = rows["297"], rows["299"], rows["189"]
    assert short is not None and long is not None and megatron is not None
    middle = {**short, "row_id": "torchtitan 64K", "seq_len": 65536, "global_batch": 4, "cp": 2, "dp": 4,
              "published_tokens_per_s_per_gpu": 2540.0}
    bf16 = {**megatron, "row_id": "Megatron-Bridge H100 BF16 recipe", "global_batch": 128, "pp": 4, "cp": 2, "dp": 2,
            "micro_batches": 64, "float8": None, "published_tokens_per_s_per_gpu": None}
    return {"llama3-8b-32k": short, "llama3-8b-64k": middle, "llama3-8b-128k": long, "llama3-70b-64-bf16": bf16}


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, RESULTS, argv, longer=300.0)
    print("simulated: the published GPUs' presets with the fitted engine profiles")
    compare(settings(args.csv), args, "plan_long", ("context_parallel",), longer={"llama3-70b-64-bf16": args.longer})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
