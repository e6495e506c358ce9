"""Compare autosplit's plan with the manual splits users write today: predicted, and measured.

Every candidate is costed by the same planner (same graph, cost table, devices, schedule and
micro-batches), so the predicted columns compare like with like; ``measure=True`` also runs
each one — through the distributed runtime (:func:`autosplit.distribute`) on every rank of an
initialised process group, or through the local :class:`~autosplit.SplitModule` in this process
otherwise — and puts the measured step beside the prediction of the runtime that ran it.

Usage::

    from torch.distributed.pipelining import SplitPoint
    cmp = autosplit.compare(model, ["cpu"] * 2, example_inputs=(x,), manual={
        "torchtitan": [["wte", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "head"]],
        "split points": {"blocks.2": SplitPoint.BEGINNING},
        "deepspeed": "parameters",
        "torchgpipe": [3, 3],
    })
    print(cmp)                       # autosplit's plan first, then each manual split
    cmp.to_html("compare.html")      # the report, one self-contained file
    cmp.to_json()
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from autosplit.candidates import Candidate, Measured
from autosplit.compiler.manual import ManualSplit
from autosplit.errors import AutosplitError, ConstraintError, advice
from autosplit.microbatch import split_batch, split_target
from autosplit.recipes import Recipe
from autosplit.report.compare import Comparison
from autosplit.runtime.makespan import DeviceOptimizers, MakespanRunner
from autosplit.units import format_bytes

__all__ = ["compare"]

log = logging.getLogger(__name__)


def compare(
    model: torch.nn.Module,
    devices: Sequence[Any],
    *,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None = None,
    manual: Mapping[str, ManualSplit | Recipe] | None = None,
    measure: bool = False,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    steps: int = 10,
    warmup: int = 2,
    **options: Any,
) -> Comparison:
    """autosplit's plan and each ``manual`` split (name → any form :func:`~autosplit.compiler.manual.manual_plan`
    reads, or a :class:`~autosplit.recipes.Recipe` with its data-parallel degree over ``devices`` as the
    whole mesh), costed alike; with ``measure=True``, each feasible one also trained ``warmup + steps``
    steps (``loss_fn(output, target)``) and timed; given both, every plan costs the loss.
    ``options``: any :class:`~autosplit.PlanOptions` field.

    Under an initialised process group, call it on every rank: rank 0 plans and sends the
    candidates to the others, and every rank measures through :func:`autosplit.distribute`.
    """
    from autosplit.api.planner import Planner

    if measure and (loss_fn is None or target is None):
        raise ConstraintError(advice(
            "compare(measure=True) needs loss_fn and target", "a measured step trains: forward, loss, backward, optimizer",
            "pass loss_fn=torch.nn.functional.cross_entropy (or yours) and target=... for the example batch",
        ))
    if not isinstance(steps, int) or steps < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ConstraintError(advice(
            f"steps={steps!r}, warmup={warmup!r} are out of range", "a measurement needs at least one timed step",
            "pass steps ≥ 1 and warmup ≥ 0",
        ))
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    kwargs = dict(example_kwargs or {})
    candidates: list[Candidate] | None = None
    if not distributed or torch.distributed.get_rank() == 0:
        costed = loss_fn is not None and target is not None  # the loss costed in every candidate's plan
        planner = Planner(model, devices, example_inputs=example_inputs, example_kwargs=kwargs,
                          loss_fn=loss_fn if costed else None, example_target=target if costed else None, **options)
        if planner.options.objective == "makespan":
            # Both objectives, to say which is faster for this model; manual splits are pipelines.
            candidates = [Candidate("autosplit makespan", planner.plan())]
            planner = planner.with_options(objective="pipeline")
            candidates.append(Candidate("autosplit pipeline", planner.plan()))
        else:
            candidates = [Candidate("autosplit", planner.plan())]
        for name, split in (manual or {}).items():
            candidates.append(_manual(planner, name, split))
    if distributed:
        box = [candidates]
        torch.distributed.broadcast_object_list(box, src=0)
        candidates = box[0]
    assert candidates is not None
    if measure:
        inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        run = _measure_distributed if distributed else _measure_local
        # The makespan runtime is one process's device workers: it has no distributed form yet.
        measured = [c.plan is not None and c.feasible and not (distributed and c.plan.objective == "makespan") for c in candidates]
        times = run(model, [c.plan for c, m in zip(candidates, measured) if m], inputs, kwargs, loss_fn, target, steps, warmup)
        it = iter(times)
        candidates = [dataclasses.replace(c, measured=next(it)) if m else c for c, m in zip(candidates, measured)]
    return Comparison(tuple(candidates))


def _manual(planner: Any, name: str, split: ManualSplit | Recipe) -> Candidate:
    try:
        plan = planner.manual(split, name=name, check_memory=False)
    except AutosplitError as e:
        log.info("manual split %s: %s", name, e)
        return Candidate(name, None, error=f"{type(e).__name__}: {e}")
    over = tuple(
        f"stage {s} on {st.device} needs {format_bytes(st.memory)}, over its cap {format_bytes(st.capacity)}"
        for s, st in enumerate(plan.stages)
        if st.memory > st.capacity
    )
    return Candidate(name, plan, over_cap=over)


def _summary(times: list[float], runtime: str, predicted: float) -> Measured:
    return Measured(runtime, statistics.median(times), min(times), max(times), len(times), predicted)


def _round_robin(
    runs: list[tuple[Callable[[], Any], Any, list[float]]], steps: int, warmup: int, sync: Callable[[], Any] = lambda: None
) -> None:
    """Step i of every run (train, optimizer step, zero grad), then step i + 1, so a slow moment of
    the machine falls on all of them alike; each run's times after ``warmup`` go to its list."""
    for i in range(warmup + steps):
        for train, opt, times in runs:
            sync()
            t0 = time.perf_counter()
            train()
            opt.step()
            opt.zero_grad()
            if i >= warmup:
                times.append(time.perf_counter() - t0)


def _measure_local(model, plans, inputs, kwargs, loss_fn, target, steps, warmup) -> list[Measured]:
    """Each plan as a :class:`~autosplit.runtime.local.SplitModule` in this process, measured round-robin."""
    from autosplit.api.planner import Planner

    runs: list[tuple[Callable[[], Any], torch.optim.Optimizer | DeviceOptimizers, list[float]]] = []
    for plan in plans:
        own = copy.deepcopy(model)  # a SplitModule moves the model's own modules to their devices
        split = Planner(own, None, example_inputs=inputs, example_kwargs=kwargs).build(plan)
        train: Callable[[], Any]
        opt: torch.optim.Optimizer | DeviceOptimizers
        if isinstance(split, MakespanRunner):
            train = functools.partial(split.step, *inputs, target=target, loss_fn=loss_fn, **kwargs)
            opt = split.optimizer(torch.optim.Adam, lr=1e-4)
        else:
            train = functools.partial(_train, split, inputs, kwargs, loss_fn, target)
            opt = torch.optim.Adam(split.parameters(), lr=1e-4)
        runs.append((train, opt, []))
    _round_robin(runs, steps, warmup)
    return [
        _summary(times, "makespan", plan.step_time) if plan.objective == "makespan"
        else _summary(times, "local", sum(st.compute for st in plan.stages))
        for plan, (*_, times) in zip(plans, runs)
    ]


def _train(split: torch.nn.Module, inputs: tuple, kwargs: dict, loss_fn: Callable[[Any, Any], torch.Tensor], target: Any) -> None:
    loss_fn(split(*inputs, **kwargs), target).backward()


def _measure_distributed(model, plans, inputs, kwargs, loss_fn, target, steps, warmup) -> list[Measured]:
    """Each plan through :func:`autosplit.distribute` on every rank, round-robin; a step's time
    is the slowest rank's."""
    import torch.distributed as dist

    from autosplit.api.distributed import distribute

    runs: list[tuple[Callable[[], Any], Any, list[float]]] = []
    for plan in plans:
        pipe = distribute(copy.deepcopy(model), None, example_inputs=inputs, example_kwargs=kwargs, loss_fn=loss_fn, plan=plan)
        mine, my_kwargs = split_batch(inputs, kwargs, plan.data_parallel)[pipe.layout.replica]  # this copy's rows
        my_target = split_target(target, plan.data_parallel)[pipe.layout.replica]
        runs.append((functools.partial(pipe.step, *mine, target=my_target, **my_kwargs), torch.optim.Adam(pipe.parameters(), lr=1e-4), []))
    _round_robin(runs, steps, warmup, sync=dist.barrier)
    out = []
    for plan, (*_, times) in zip(plans, runs):
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out.append(_summary(slowest.tolist(), "distributed", plan.step_time))
    return out
