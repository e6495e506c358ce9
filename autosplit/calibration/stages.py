"""Each stage of a split timed on its own, forward and backward over the plan's micro-batches,
then one optimizer step: what the plan's per-stage predictions are checked against.

Usage::

    rows = measure_stages(split, split_batch((x,), {}, 4), steps=3)
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autosplit.compat import pytree
from autosplit.errors import ConstraintError, advice
from autosplit.timers import MemoryTracker, pinned

__all__ = ["measure_stages", "StageMeasurement"]


@dataclass(frozen=True)
class StageMeasurement:
    """What one stage of a split module took in a training step, run on its own."""

    forward: float
    """Seconds of forward for the whole batch (sum over micro-batches, median over steps)."""
    backward: float
    peak_bytes: int
    """Peak bytes live during a step: state, optimizer state, received inputs, activations."""

    @property
    def time(self) -> float:
        return self.forward + self.backward


def _stage_inputs(split, micro: Sequence[tuple[tuple, dict]]) -> list[list[tuple]]:
    """[stage][micro-batch] the arguments each stage receives (and whether each needs a gradient)."""
    records: list[list[tuple]] = [[] for _ in split.stages]

    def keep(t: Any) -> Any:
        return t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    hooks = [
        stage.register_forward_pre_hook(lambda mod, args, s=s: records[s].append(pytree.tree_map(keep, args)))
        for s, stage in enumerate(split.stages)
    ]
    try:
        for args, kwargs in micro:
            split(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return records


def measure_stages(
    split, micro_batches: Sequence[tuple[tuple, dict]], *, steps: int = 3, warmup: int = 1,
    threads: int | None = 1, cores: Sequence[int] | None = None, optimizer: str = "adam",
) -> list[StageMeasurement]:
    """Run every stage of ``split`` alone through GPipe training steps and measure it.

    ``micro_batches`` holds the (args, kwargs) of each micro-batch of one step. Each stage
    gets the inputs it receives in the real run (recorded first), runs the forward of
    every micro-batch, then every backward (with output gradients of ones), then an
    optimizer step: the GPipe schedule of one stage, with no waiting for its neighbours.
    Time is the median over ``steps`` after ``warmup`` steps, under ``threads`` pinned to
    ``cores`` as a stage process would run; peak memory is from :class:`MemoryTracker` over
    one step taken after the optimizer state exists.

    Usage::

        micro = split_batch((x,), {}, split.plan.micro_batches)   # autosplit.microbatch
        stages = measure_stages(split, micro)                     # [StageMeasurement] per stage
    """
    _check_measure_stages(split, micro_batches, steps, warmup, threads)
    records = _stage_inputs(split, micro_batches)
    results = []
    for stage, inputs in zip(split.stages, records):
        params = [p for p in stage.parameters() if p.requires_grad]
        opt = _optimizer(optimizer, params)
        fwd_s, bwd_s = [], []
        with pinned(threads, cores):
            for step in range(warmup + steps + 1):
                tracker = MemoryTracker() if step == warmup + steps else None
                with tracker or contextlib.nullcontext():
                    if tracker is not None:
                        tracker.track(params, [p.grad for p in params], opt.state_dict()["state"], inputs)
                    fwd, bwd = _gpipe_step(stage, inputs, opt)
                if tracker is not None:
                    peak = tracker.peak
                elif step >= warmup:
                    fwd_s.append(fwd)
                    bwd_s.append(bwd)
        results.append(StageMeasurement(statistics.median(fwd_s), statistics.median(bwd_s), peak))
    return results


def _check_measure_stages(split: Any, micro_batches: Any, steps: Any, warmup: Any, threads: Any) -> None:
    """:func:`measure_stages`' arguments, checked before anything runs."""
    from autosplit.runtime.local import SplitModule

    if not isinstance(split, SplitModule):
        raise ConstraintError(advice(
            f"measure_stages(split=...) got a {type(split).__name__}, not a SplitModule",
            "it runs each stage of a split built in this process alone",
            "pass the module autosplit.autosplit(model, devices, example_inputs=...) returns",
        ))
    how = ("pass split_batch((x,), {}, split.plan.micro_batches) (from autosplit.microbatch), "
           "or a list of ((x_i,), {}) pairs, one per micro-batch")
    if isinstance(micro_batches, (str, bytes, Mapping)) or not isinstance(micro_batches, Sequence):
        raise ConstraintError(advice(
            f"measure_stages(split, micro_batches=...) got {type(micro_batches).__name__} {_short(micro_batches)}, "
            "not a list of micro-batches",
            "it takes the inputs of every micro-batch of one step, each an (args, kwargs) pair, "
            "not a count of micro-batches", how,
        ))
    if not micro_batches:
        raise ConstraintError(advice(
            "measure_stages(split, micro_batches=[]) got no micro-batches", "a step runs at least one micro-batch", how,
        ))
    for i, item in enumerate(micro_batches):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], (tuple, list))
                and isinstance(item[1], Mapping)):
            raise ConstraintError(advice(
                f"measure_stages: micro_batches[{i}] is {type(item).__name__} {_short(item)}, not an (args, kwargs) pair",
                "each micro-batch is the positional arguments (a tuple) and keyword arguments (a dict) of one forward call",
                how,
            ))
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0), ("threads", threads, 1)):
        if value is None and name == "threads":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConstraintError(advice(
                f"measure_stages: {name}={value!r} is not an integer ≥ {least}",
                "steps are timed steps, warmup untimed ones before them, threads the intra-op threads of a stage",
                "e.g. steps=3, warmup=1, threads=1 (threads=None keeps the current count)",
            ))


def _short(value: Any, limit: int = 60) -> str:
    """``value`` for a message: a tensor by its shape, anything else by its repr, cut to ``limit``."""
    if isinstance(value, torch.Tensor):
        return f"of shape {tuple(value.shape)}"
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if not params:
        return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    if name in ("adam", "adamw"):
        return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=1e-4)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9 if name == "sgd_momentum" else 0.0)


def _gpipe_step(stage: torch.nn.Module, inputs: list[tuple], opt: torch.optim.Optimizer) -> tuple[float, float]:
    """All forwards, all backwards, one optimizer step; returns (forward s, backward s)."""

    def fresh(t):  # a new leaf per step, as a received tensor is
        return t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    outs, fwd, bwd = [], 0.0, 0.0
    for args in inputs:
        args = pytree.tree_map(fresh, args)
        t0 = time.perf_counter_ns()
        out = stage(*args)
        fwd += (time.perf_counter_ns() - t0) / 1e9
        outs.append([t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad])
    for tensors in outs:
        t0 = time.perf_counter_ns()
        if tensors:
            torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
        bwd += (time.perf_counter_ns() - t0) / 1e9
    del outs
    opt.step()
    opt.zero_grad(set_to_none=True)
    return fwd, bwd
