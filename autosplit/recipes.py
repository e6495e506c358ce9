"""A parallelism recipe as people publish one: the split, the data-parallel degree and the options it fixes.

torchtitan's Llama-3-8B on 8 H100s is "FSDP 8, local batch 1, full activation checkpointing";
Megatron's 70B is "TP 4 × PP 8 × VP 5" with layers per stage. A :class:`Recipe` writes such a
layout down so that the planner costs it with the model it costs its own plans with
(:meth:`autosplit.Planner.manual`), :func:`autosplit.compare` puts it beside autosplit's plan of
the same devices and global batch, and :func:`autosplit.distribute` runs the plan it gives.

Usage::

    recipe = autosplit.Recipe(data_parallel=8, replicate="fully_shard",
                              options={"precision": "bf16-mixed", "checkpointing": "full", "micro_batches": 1})
    cmp = autosplit.compare(model, autosplit.Cluster.dgx_h100(), example_inputs=(tokens,),
                            manual={"torchtitan FSDP 8": recipe})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autosplit.errors import ConstraintError, advice
from autosplit.options import REPLICATES, PlanOptions

__all__ = ["Recipe"]

FIXED_BY_RECIPE = ("data_parallel", "replicate", "tensor_parallel", "expert_parallel", "context_parallel")


@dataclass(frozen=True)
class Recipe:
    """One layout over the whole mesh: ``world / (data_parallel · context_parallel · tensor_parallel)`` pipeline ranks, each
    stage's tensors split over ``tensor_parallel`` devices and its ``data_parallel`` copies kept in step as
    ``replicate`` says (the mesh's dp_replicate or dp_shard), every copy a ``1/data_parallel`` share of the
    global batch."""

    split: Any = None
    """The pipeline's stages, in any form :func:`~autosplit.compiler.manual.manual_plan` reads
    (module names per stage, a balance, split points, a DeepSpeed method); ``None``: one stage."""
    data_parallel: int = 1
    replicate: str = "replicate"
    """``"replicate"`` (whole copies) or ``"fully_shard"`` (FSDP2: state sharded over the copies)."""
    tensor_parallel: int = 1
    """Devices each stage's tensors are split over (the mesh's tp), by the rules the graph gives."""
    expert_parallel: int = 1
    """Ranks each mixture-of-experts layer's experts are spread over (ep), borrowed from dp_shard × tp."""
    context_parallel: int = 1
    """Devices each sequence is split over (the mesh's cp, between dp_shard and tp)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The :class:`~autosplit.PlanOptions` the recipe fixes: ``schedule``, ``micro_batches``,
    ``stages_per_rank``, ``checkpointing``, ``precision``, …"""

    def __post_init__(self) -> None:
        for name in ("data_parallel", "tensor_parallel", "expert_parallel", "context_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConstraintError(advice(
                    f"Recipe({name}={value!r}) is not a count of devices",
                    "the mesh's degrees are whole numbers of devices", "pass an integer ≥ 1",
                ))
        if self.replicate not in REPLICATES:
            raise ConstraintError(advice(
                f"Recipe(replicate={self.replicate!r}) is not a way copies keep in step",
                "a recipe fixes its layout; the planner does not choose it", f"pass one of {REPLICATES}",
            ))
        fixed = sorted(set(self.options) & set(FIXED_BY_RECIPE))
        if fixed:
            raise ConstraintError(advice(
                f"Recipe(options=...) sets {fixed}", "the recipe's own fields hold its data-parallel layout",
                "pass them as Recipe(data_parallel=..., replicate=..., tensor_parallel=..., expert_parallel=..., context_parallel=...)",
            ))
        # an unknown or bad option fails here, naming itself (FP8 linears ride on the planner's bf16 precision where
        # the recipe names none: checked again with it when the recipe is costed)
        unnamed = self.options.get("float8") and "precision" not in self.options
        PlanOptions(precision="bf16-mixed" if unnamed else "fp32").replace(**self.options)
