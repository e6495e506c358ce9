"""Weight prediction for asynchronous pipelines (XPipe, Guan et al. 2019; DESIGN §4.7).

A stage of an asynchronous pipeline runs a micro-batch's forward ``s`` weight updates before
the update its gradient is applied to (the version difference, simulated by
:mod:`autosplit.solver.asynchronous`). XPipe runs it on the weights it predicts for then:

    Ŵ = W − lr · s · Δ

with Δ the optimizer's own update direction, read from its state:

- Adam: ``m̂ / (√v̂ + ε)`` (bias-corrected moments; AMSGrad's running maximum for v̂);
  AdamW adds its decoupled decay ``λ · W``;
- SGD with momentum: the momentum buffer (Nesterov: ``g + μ · buffer`` is not known before
  the gradient, so the buffer is used as well).

Before the optimizer's first step there is no direction, and Ŵ = W. The prediction is a
differentiable function of W (Δ is a constant), so a forward run on Ŵ through
``torch.func.functional_call`` sends its gradient into ``W.grad`` and there is still one
weight copy; ``s = 0`` returns the parameters themselves.

Usage::

    weights = predicted(optimizer, version_difference=2)      # {param: Ŵ}
    out = torch.func.functional_call(stage, {name: weights[p] for name, p in stage.named_parameters()}, args)
"""

from __future__ import annotations

import torch

from autosplit.errors import ConstraintError, advice

__all__ = ["predicted", "update_direction"]


def update_direction(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """Δ for ``param`` (the step is ``−lr · Δ``), or None before the optimizer's first step."""
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)
    if group is None:
        raise ConstraintError(advice(
            "the parameter is not one of the optimizer's", "weights are predicted from the optimizer that updates them",
            "pass the optimizer built over this stage's parameters",
        ))
    return _direction(optimizer, group, param)


def _direction(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> torch.Tensor | None:
    state = optimizer.state.get(param, {})
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        if "exp_avg" not in state:
            return None
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
        direction = (state["exp_avg"] / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + group["eps"])
        if isinstance(optimizer, torch.optim.AdamW) and group["weight_decay"]:
            direction = direction + group["weight_decay"] * param.detach()
        return -direction if group.get("maximize") else direction
    if isinstance(optimizer, torch.optim.SGD) and group["momentum"]:
        buffer = state.get("momentum_buffer")
        if buffer is None:
            return None
        return -buffer if group.get("maximize") else buffer
    raise ConstraintError(advice(
        f"weight prediction has no update direction for {type(optimizer).__name__}"
        + (" without momentum" if isinstance(optimizer, torch.optim.SGD) else ""),
        "XPipe predicts from the optimizer's own direction: Adam's m̂/(√v̂+ε) or SGD's momentum buffer",
        "use Adam, AdamW or SGD with momentum > 0, or schedule='async' (no prediction)",
    ))


def predicted(optimizer: torch.optim.Optimizer, version_difference: int) -> dict[torch.Tensor, torch.Tensor]:
    """Every parameter of ``optimizer`` mapped to ``W − lr · s · Δ`` (differentiable in W)."""
    s = version_difference
    if not isinstance(s, int) or s < 0:
        raise ConstraintError(advice(
            f"version_difference={s!r}", "it counts weight updates, so it is an integer ≥ 0",
            "pass the version difference the schedule's simulation gives",
        ))
    out: dict[torch.Tensor, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            direction = None if s == 0 else _direction(optimizer, group, p)
            out[p] = p if direction is None else p - (float(group["lr"]) * s) * direction.detach()
    return out
