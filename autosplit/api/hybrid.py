"""The hybrid planner: how many devices form each data-parallel worker, for time to accuracy.

Pal et al. 2019 (each data-parallel worker is a group of devices; hybrid beats the best
DP-only setup end to end because a large global batch costs statistical efficiency) and
Joo & Youn's GHP (choose the grouping from a model of both). For every replica size k that
divides the cluster's N devices (k = 1 is data parallelism alone) and every worker batch
tried, one worker's split over k devices is planned by the pipeline planner; each stage's
gradient all-reduce over the N/k copies of that stage is added (ring inside a node,
hierarchical across nodes; the part that overlaps the backward of the stage's last
micro-batch is hidden — DDP's bucketed overlap, for k = 1 the whole backward); and the time
to the target follows from the statistical efficiency of the global batch
(:mod:`autosplit.solver.hybrid`).

Usage::

    cluster = autosplit.Cluster.dgx1(nodes=16)                       # 128 V100s
    hp = autosplit.plan_hybrid(model, cluster, example_inputs=(x,), per_device_batch=64, noise_scale=4000)
    print(hp)                # a row per replica size: step, exposed all-reduce, samples/s, E(B)/E_min, time to target
    hp.choice.plan           # the chosen worker's split
    b = autosplit.api.measure_noise_scale(model, batches, loss_fn, small_batch=8).noise_scale
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autosplit.api.planner import Planner
from autosplit.compat import BatchNorm, pytree
from autosplit.compiler.hybrid import Cluster, HybridPlan, assemble, default_micro_batches, divisors, first_sentence, is_count, is_real
from autosplit.errors import AutosplitError, ConstraintError, InfeasiblePlanError, advice
from autosplit.options import PlanOptions
from autosplit.plans import Plan
from autosplit.shapes import as_tensors
from autosplit.solver.hybrid import examples_factor

__all__ = ["measure_noise_scale", "NoiseScale", "plan_hybrid"]

log = logging.getLogger(__name__)


def plan_hybrid(
    model: torch.nn.Module,
    cluster: Cluster,
    *,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None = None,
    per_device_batch: int | Sequence[int] | None = None,
    global_batch: int | None = None,
    noise_scale: float | None = None,
    efficiency_table: Mapping[float, float] | None = None,
    min_examples: float | None = None,
    objective: str = "pipeline",
    replica_sizes: Sequence[int] | None = None,
    batch_dim: int = 0,
    **options: Any,
) -> HybridPlan:
    """Choose the replica size k (and worker batch) that reaches the target soonest on ``cluster``.

    ``per_device_batch=b``: a worker processes b examples per step — the per-GPU batch of the
    data-parallel setup, kept per worker, so a hybrid's global batch is ``N/k · b`` — or ``k·b``
    (the same global batch as data parallelism); both are tried. A sequence of per-device
    batches tries each (data parallelism alone may then shrink its batch as well). ``global_batch=B`` fixes
    ``B`` for every k instead (worker batch ``B·k/N``). ``noise_scale`` (``B_noise``; see
    :func:`measure_noise_scale`) or ``efficiency_table`` (``{global batch: examples or epochs
    to target}``) gives the statistical efficiency; neither: none is lost. ``min_examples``
    (E_min) turns time to target into seconds. ``replica_sizes``: the k to try (default every
    divisor of N up to 64). ``objective``: the worker planner's (``"pipeline"``, or ``"makespan"``:
    each worker one micro-batch, its parallel branches on different devices). ``options``:
    any :class:`~autosplit.PlanOptions` field for the worker plans.
    """
    PlanOptions().replace(objective=objective, **options)  # a bad option fails here, not once per worker plan
    per_device = _per_device_batches(per_device_batch, global_batch)
    examples_factor(1.0, noise_scale, efficiency_table)  # a bad noise scale or table fails here, not after every plan
    if min_examples is not None and not (is_real(min_examples) and 0 < min_examples < math.inf):
        raise ConstraintError(advice(
            f"min_examples={min_examples!r} is not a positive number of examples", "E_min turns time to target into seconds",
            "pass the examples to the target at a tiny batch, or leave it out for seconds × E_min",
        ))
    sizes = _replica_sizes(cluster, replica_sizes, global_batch)
    kwargs = as_tensors(dict(example_kwargs or {}))
    inputs = as_tensors(example_inputs if isinstance(example_inputs, tuple) else (example_inputs,))
    state = [*model.parameters(), *model.buffers()]
    if state and all(t.is_meta for t in state):  # a model made under torch.device("meta"): plan it on meta inputs too
        inputs, kwargs = _map_tensors(inputs, lambda t: t.to("meta")), _map_tensors(kwargs, lambda t: t.to("meta"))
    planners: dict[int, Planner] = {}

    def worker_plan(k: int, batch: int) -> Plan:
        if batch not in planners:  # one capture per worker batch, reused for every k
            args_b, kwargs_b = _at_batch((inputs, kwargs), batch, batch_dim)
            planners[batch] = Planner(model, cluster.replica_devices(1), example_inputs=args_b, example_kwargs=kwargs_b,
                                      objective=objective, **options)
        planner = planners[batch]
        return planner.what_if(devices=cluster.replica_devices(k), micro_batches=default_micro_batches(batch, k))

    plans: dict[tuple[int, int], tuple[Plan | None, str | None]] = {}
    failures: list[AutosplitError] = []
    for k in sizes:
        for b in _worker_batches(k, cluster.size // k, per_device, global_batch):
            try:
                plans[(k, b)] = (worker_plan(k, b), None)
            except AutosplitError as e:
                log.info("k = %d, worker batch %d: %s", k, b, e)
                plans[(k, b)] = (None, f"{type(e).__name__}: {e}")
                failures.append(e)

    causes = {f"{type(e).__name__}: {first_sentence(str(e))}" for e in failures}
    if len(failures) == len(plans) and len(causes) == 1 and not isinstance(failures[0], InfeasiblePlanError):
        first = failures[0]  # not a matter of memory or replica size: the cause itself leads
        first.add_note(f"(every one of the {len(plans)} worker plans tried, replica sizes {sizes}, failed this way)")
        raise first
    return assemble(cluster, plans, noise_scale, efficiency_table, min_examples)


def _per_device_batches(per_device_batch: int | Sequence[int] | None, global_batch: int | None) -> list[int]:
    """The per-device batches to try (none with ``global_batch``); refuses both, neither, or a batch that is no count."""
    if (per_device_batch is None) == (global_batch is None):
        raise ConstraintError(advice(
            "plan_hybrid needs exactly one of per_device_batch and global_batch",
            "the batch decides the statistical efficiency and the worker's work", "pass per_device_batch=64 (for example)",
        ))
    name, given = ("per_device_batch", per_device_batch) if global_batch is None else ("global_batch", global_batch)
    per_device: list[int] = []
    if isinstance(per_device_batch, Sequence):
        per_device = list(per_device_batch)
    elif per_device_batch is not None:
        per_device = [per_device_batch]
    values: list[object] = [global_batch] if per_device_batch is None else [*per_device]
    if not values or not all(is_count(b) for b in values):
        raise ConstraintError(advice(
            f"{name}={given!r} is not a whole number of examples ≥ 1" + (" (or a list of them)" if global_batch is None else ""),
            "a worker plans for a batch of that many examples", f"pass {name}=64 (for example)",
        ))
    return per_device


def _replica_sizes(cluster: Cluster, replica_sizes: Sequence[int] | None, global_batch: int | None) -> list[int]:
    """The replica sizes k to try: each divides the cluster, and some share the global batch evenly."""
    N = cluster.size
    sizes = sorted(set(replica_sizes or [k for k in divisors(N) if k <= 64]))
    bad = [k for k in sizes if not is_count(k) or N % k]
    if bad:
        raise ConstraintError(advice(
            f"replica sizes {bad} do not divide the cluster's {N} devices", "every worker has the same k devices",
            f"choose from {divisors(N)}",
        ))
    if global_batch is not None and all(global_batch % (N // k) for k in sizes):
        raise ConstraintError(advice(
            f"global_batch={global_batch} splits evenly over none of the worker counts {[N // k for k in sizes]} "
            f"(replica sizes {sizes} on {N} devices)", "every worker gets the same share of the global batch",
            f"pass a multiple of {N}, e.g. global_batch={N * max(1, round(global_batch / N))}",
        ))
    return sizes


def _worker_batches(k: int, replicas: int, per_device: Sequence[int], global_batch: int | None) -> list[int]:
    """A worker of k devices tries each per-device batch b kept per worker, and k·b (data parallelism's
    global batch); with a global batch, its share (none when it does not divide)."""
    if per_device:
        return sorted({b for p in per_device for b in (p, k * p)})
    if global_batch is not None and global_batch % replicas == 0:
        return [global_batch // replicas]
    return []


@dataclass(frozen=True)
class NoiseScale:
    """The simple noise scale ``B_simple = tr Σ / |G|²`` and what it was estimated from."""

    noise_scale: float
    trace: float
    """tr Σ: the per-example gradient covariance's trace."""
    grad_sq: float
    """|G|²: the true gradient's squared norm."""
    small_batch: int
    big_batch: int
    batches: int


def measure_noise_scale(
    model: torch.nn.Module,
    batches: Iterable[tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    small_batch: int,
    batch_dim: int = 0,
) -> NoiseScale:
    """McCandlish et al.'s two-batch estimator of the simple noise scale (their appendix A.1).

    Each ``(inputs, target)`` in ``batches`` is a big batch of ``B_big`` examples; its gradient
    gives ``|G_big|²``, and its chunks of ``small_batch`` examples give ``|G_small|²`` (their mean).
    Then ``|G|² ≈ (B_big|G_big|² − B_small|G_small|²)/(B_big − B_small)`` and ``tr Σ ≈
    (|G_small|² − |G_big|²)/(1/B_small − 1/B_big)``; the numerator and the denominator are
    averaged over the batches separately before dividing (unbiased each; their ratio is not).
    ``loss_fn(output, target)`` must average over the examples. The estimator assumes the
    examples' gradients independent; BatchNorm in training mode couples a batch's examples
    (a chunk of 8 normalises by its own statistics), so batch-norm layers are measured with
    their running statistics (eval mode) and put back as they were. The model's gradients
    are left zeroed; its weights and buffers are not changed.
    """
    if not is_count(small_batch):
        raise ConstraintError(advice(
            f"small_batch={small_batch!r} is not an integer ≥ 1",
            "the estimator splits each big batch into chunks of small_batch examples",
            "pass small_batch=8 (for example), with big batches a multiple (≥ 2×) of it",
        ))
    params = [p for p in model.parameters() if p.requires_grad]
    coupled = [m for m in model.modules() if isinstance(m, BatchNorm) and m.training]
    for m in coupled:
        m.eval()
    try:
        return _two_batch_estimate(model, params, batches, loss_fn, small_batch, batch_dim)
    finally:
        for m in coupled:
            m.train()


def _two_batch_estimate(
    model: torch.nn.Module, params: list[torch.nn.Parameter], batches: Iterable[tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor], small_batch: int, batch_dim: int,
) -> NoiseScale:
    def grad_sq(inputs: Any, target: Any) -> float:
        for p in params:
            p.grad = None
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        loss_fn(model(*args), target).backward()
        return float(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))

    traces, grads, big, count = [], [], 0, 0
    for inputs, target in batches:
        big = int(target.shape[batch_dim])
        if big % small_batch or big <= small_batch:
            raise ConstraintError(advice(
                f"a batch of {big} examples does not split into more than one chunk of small_batch={small_batch}",
                "the estimator compares the gradient of the whole batch with those of its chunks",
                "pass big batches that are a multiple (≥ 2×) of small_batch",
            ))
        g_big = grad_sq(inputs, target)
        chunks = [
            grad_sq(_slice(inputs, i, small_batch, batch_dim), target.narrow(batch_dim, i, small_batch))
            for i in range(0, big, small_batch)
        ]
        g_small = sum(chunks) / len(chunks)
        grads.append((big * g_big - small_batch * g_small) / (big - small_batch))
        traces.append((g_small - g_big) / (1 / small_batch - 1 / big))
        count += 1
    for p in params:
        p.grad = None
    if not count:
        raise ConstraintError(advice("measure_noise_scale got no batches", "batches was empty", "pass at least one (inputs, target)"))
    trace, g2 = sum(traces) / count, sum(grads) / count
    if g2 <= 0:
        log.warning("the true gradient's squared norm estimates %.3g ≤ 0 over %d batches of %d: its signal is below the "
                    "estimator's noise, so the noise scale is reported as infinite; pass more or bigger batches", g2, count, big)
    return NoiseScale(trace / g2 if g2 > 0 else math.inf, trace, g2, small_batch, big, count)


def _slice(value: Any, start: int, length: int, dim: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value.narrow(dim, start, length)
    if isinstance(value, tuple):
        return tuple(_slice(v, start, length, dim) for v in value)
    return value


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (through tuples, lists and mappings)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, Mapping):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _at_batch(value: Any, batch: int, dim: int) -> Any:
    """``value`` with its batched tensors' batch dimension set to ``batch`` (rows repeated or cut:
    planning reads shapes). Batched: as :func:`autosplit.microbatch.split_batch` reads it, the
    tensors whose dimension ``dim`` has the size of the first tensor's that has one; any other
    (a set of sampled classes shared by the batch) stays as it is."""
    example = next((t.shape[dim] for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.dim() > dim), None)

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() <= dim or t.shape[dim] != example:
            return t
        return torch.cat([t] * math.ceil(batch / t.shape[dim]), dim=dim).narrow(dim, 0, batch).contiguous()

    return _map_tensors(value, resize)
