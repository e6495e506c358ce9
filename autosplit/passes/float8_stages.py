"""FP8 stages: the linears a plan runs in FP8 (:attr:`~autosplit.plans.Plan.float8_linears`), converted with torchao.

Each stage module's converted linears become torchao ``Float8Linear`` modules by
``convert_to_float8_training`` with the plan's recipe (``Float8LinearConfig.from_recipe_name``), the
module filter naming exactly the plan's linears — torchtitan's order: before tensor parallelism,
``torch.compile`` and FSDP. A ``Float8Linear`` keeps the linear's own weight parameter, so the
optimizer, checkpoints and the user's model see the same tensors. Under FSDP (``dp_shard > 1``) with
tensorwise scaling the weights are all-gathered in FP8 (``enable_fsdp_float8_all_gather``, as the plan
costs them), and :func:`precompute_scales` computes every weight's scale in one all-reduce before a step
(torchao's ``precompute_float8_dynamic_scale_for_fsdp``, which torchtitan runs after each optimizer step).

A stage that holds one of the plan's FP8 weights but computes it other than as an ``nn.Linear`` module
(torch.export captures linears as functions) is refused: it would train in bf16, unlike its plan.
torchao is an optional dependency (``pip install torchao``); MXFP8 needs Blackwell GPUs and is refused.

Usage::

    to_float8(stage, plan.float8, plan.float8_linears, all_gather=plan.dp_shard > 1)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from autosplit.errors import CodegenError, advice

__all__ = ["precompute_scales", "to_float8"]

log = logging.getLogger(__name__)


def _torchao() -> Any:
    """``torchao.float8``, imported where FP8 stages are first built (not with autosplit)."""
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise CodegenError(advice(
            "the plan runs linears in FP8, and torchao is not installed",
            "autosplit runs FP8 linears with torchao's float8 training (convert_to_float8_training)",
            "pip install torchao (scripts/setup.sh installs it), or plan with float8=None",
        )) from e
    return float8


def to_float8(module: nn.Module, recipe: str | None, linears: Collection[str], *, all_gather: bool = False) -> set[str]:
    """Convert the linears of ``module`` named in ``linears`` (module paths) to torchao's FP8 training in
    ``recipe``; returns those it holds. ``all_gather``: FSDP will shard them (FP8 all-gathers where
    tensorwise). Refuses one of them held other than as an ``nn.Linear``, and recipes torchao does not run here."""
    if recipe is None or not linears:
        return set()
    if recipe == "mxfp8":
        raise CodegenError(advice(
            "the plan runs linears in MXFP8 (float8='mxfp8'), costed but not run by autosplit",
            "MXFP8 training runs through torchao's MX formats on Blackwell GPUs (SM100), which this runtime does not drive yet",
            "plan with float8='tensorwise' or 'rowwise' to run it",
        ))
    wanted = set(linears)
    params = dict(module.named_parameters(remove_duplicate=False))
    mods = dict(module.named_modules(remove_duplicate=False))
    held = sorted(p for p in wanted if f"{p}.weight" in params)
    odd = [p for p in held if type(mods.get(p)) is not nn.Linear]
    if odd:
        raise CodegenError(advice(
            f"the plan runs {odd[:3]} in FP8, and this stage holds their weights but computes them other than as nn.Linear modules",
            "torchao converts nn.Linear modules; a graph captured by torch.export calls linears as functions",
            "capture with capture='symbolic_trace' where the model allows it, or plan with float8=None",
        ))
    float8 = _torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if all_gather and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(module, module_filter_fn=lambda _, fqn: fqn in wanted, config=config)
    log.info("FP8 (%s): %d linears converted%s", recipe, len(held),
             ", all-gathered in FP8 under FSDP" * config.enable_fsdp_float8_all_gather)
    return set(held)


def precompute_scales(modules: Collection[nn.Module]) -> None:
    """Every FP8 weight's scale for the next FSDP all-gather, in one all-reduce per module (what torchtitan
    runs after each optimizer step); nothing where no weight is all-gathered in FP8."""
    float8 = _torchao()
    for module in modules:
        if any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False) for m in module.modules()):
            with torch.no_grad():
                float8.precompute_float8_dynamic_scale_for_fsdp(module)
