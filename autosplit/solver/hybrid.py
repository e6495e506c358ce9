"""Hybrid data × model parallelism: the all-reduce, statistical efficiency and time to target.

N devices form R = N / k data-parallel workers of k devices each; a worker's model is split
over its k devices by the pipeline planner (Pal et al. 2019: each data-parallel worker is a
group of devices; Joo & Youn's GHP: choose the grouping analytically). With worker batch b
the global batch is B = R·b, and

- ``T_step(k) = step of one worker's plan + the exposed all-reduce of each stage's gradients
  over the R copies of that stage``;
- examples to reach the target (McCandlish et al. 2018, "An Empirical Model of Large-Batch
  Training", eq. 2.11): ``E(B) = E_min · (1 + B / B_noise)``;
- time to target ``= E(B) / B · T_step(k)`` (steps × seconds per step).

Torch-free: the orchestration (a plan per k) is :mod:`autosplit.api.hybrid`.

Usage::

    seconds = hierarchical_allreduce(nbytes, local=4, nodes=8, intra=(150e9, 5e-6), inter=(6.25e9, 5e-6))
    factor = examples_factor(batch=4096, noise_scale=2000.0)      # E(B) / E_min
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping

from autosplit.errors import ConstraintError, advice

__all__ = [
    "ring_allreduce", "ring_allgather", "hierarchical_allreduce", "hierarchical_allgather", "hierarchical_phases",
    "examples_factor", "efficiency_points", "time_to_target",
]


def ring_allreduce(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds to all-reduce ``nbytes`` over ``n`` peers in a ring: ``2(n−1)/n · bytes/bw +
    2(n−1)·latency`` (reduce-scatter then all-gather; Patarasuk & Yuan 2009)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def ring_allgather(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds for ``n`` peers in a ring to each gather every other peer's ``nbytes``:
    ``(n−1) · bytes/bw + (n−1)·latency`` — what a row-sparse gradient (an embedding's) is
    exchanged with, since its rows do not add up in place."""
    if n <= 1:
        return 0.0
    return (n - 1) * nbytes / bandwidth + (n - 1) * latency


def exposed_allreduce(allreduce: float, backward: float, micro_batches: int) -> float:
    """Seconds of a stage's gradient all-reduce the step waits for: what the backward of its last
    micro-batch (``backward / micro_batches``) does not hide (DDP's bucketed overlap)."""
    return max(0.0, allreduce - backward / micro_batches)


def hierarchical_phases(
    nbytes: float, *, local: int, nodes: int, intra: tuple[float, float], inter: tuple[float, float], gather: bool = False
) -> tuple[float, float]:
    """(inside the nodes, across them) seconds of :func:`hierarchical_allreduce` — or, ``gather``,
    of :func:`hierarchical_allgather` — over ``local × nodes`` peers, ``local`` on each node."""
    if gather:
        return ring_allgather(nodes * nbytes, local, *intra), ring_allgather(nbytes, nodes, *inter)
    return ring_allreduce(nbytes, local, *intra), ring_allreduce(nbytes / max(local, 1), nodes, *inter)


def hierarchical_allreduce(
    nbytes: float, *, local: int, nodes: int, intra: tuple[float, float], inter: tuple[float, float]
) -> float:
    """Seconds to all-reduce ``nbytes`` over ``local × nodes`` peers, ``local`` on each node:
    reduce-scatter inside each node (``intra`` = (bandwidth, latency)), all-reduce of each
    1/local shard across the nodes (``inter``, every local peer on its own share of the node's
    network), all-gather inside each node — NCCL's tree/ring hierarchy, modelled as rings."""
    return sum(hierarchical_phases(nbytes, local=local, nodes=nodes, intra=intra, inter=inter))


def hierarchical_allgather(
    nbytes: float, *, local: int, nodes: int, intra: tuple[float, float], inter: tuple[float, float]
) -> float:
    """Seconds for ``local × nodes`` peers to gather every peer's ``nbytes``: each peer first with
    its counterparts on the other nodes (``inter``, on its share of the node's network), then
    inside each node, now ``nodes × nbytes`` each (``intra``)."""
    return sum(hierarchical_phases(nbytes, local=local, nodes=nodes, intra=intra, inter=inter, gather=True))


def examples_factor(batch: float, noise_scale: float | None = None, table: Mapping[float, float] | None = None) -> float:
    """``E(B) / E_min``: how many more examples than at a tiny batch reaching the target takes.

    From the noise scale (McCandlish et al.: ``1 + B / B_noise``; ``None`` or ``inf``: 1, no
    loss of statistical efficiency), or from a user's table ``{global batch: examples (or
    epochs) to target}`` (see :func:`efficiency_points`): interpolated log-log between its
    entries, relative to its smallest batch (1 below it), extended linearly in B past its largest.
    """
    if table is not None:
        points = efficiency_points(table)
        base, batches = points[0][1], [b for b, _ in points]
        if batch <= batches[0]:
            return 1.0
        if batch >= batches[-1]:  # E(B) is linear in B for large B (the noise-scale form): extend the last segment
            (b0, e0), (b1, e1) = points[-2], points[-1]
            return (e1 + (e1 - e0) / (b1 - b0) * (batch - b1)) / base
        i = bisect.bisect_right(batches, batch)
        (b0, e0), (b1, e1) = points[i - 1], points[i]
        t = (math.log(batch) - math.log(b0)) / (math.log(b1) - math.log(b0))
        return math.exp(math.log(e0) + t * (math.log(e1) - math.log(e0))) / base
    if noise_scale is None or noise_scale == math.inf:
        return 1.0
    if not (_number(noise_scale) and noise_scale > 0):
        raise ConstraintError(advice(
            f"noise_scale={noise_scale!r} is not a positive number of examples",
            "the gradient noise scale B_noise is a batch size", "measure it with autosplit.api.measure_noise_scale",
        ))
    return 1.0 + batch / noise_scale


def efficiency_points(table: Mapping[float, float]) -> list[tuple[float, float]]:
    """A table ``{global batch: examples (or epochs) to target}`` as its entries in batch order, checked.

    Two entries at least (one says nothing about how ``E(B)`` grows, so it would silently mean no
    statistical cost), positive finite numbers, and examples never fewer at a larger batch:
    ``E(B) = E_min·(1 + B/B_noise)`` grows with B, and a falling table would make ``E(B)/E_min`` below 1.
    """
    why = "the table maps a global batch to the examples (or epochs) it takes to reach the target"
    bad = {b: e for b, e in table.items() if not (_number(b) and _number(e) and 0 < b < math.inf and 0 < e < math.inf)}
    if bad:
        raise ConstraintError(advice(
            f"efficiency_table entries {bad} are not positive finite numbers (batch: examples to target)", why,
            "give positive batches and counts, e.g. {256: 1.0e6, 1024: 1.2e6}",
        ))
    if len(table) < 2:
        raise ConstraintError(advice(
            f"efficiency_table {dict(table)} has {len(table)} entr{'y' if len(table) == 1 else 'ies'}, fewer than 2",
            f"{why}; one entry says nothing about how that grows with the batch",
            "give two or more batches, or noise_scale= instead, or neither for no statistical cost",
        ))
    points = sorted((float(b), float(e)) for b, e in table.items())
    falls = [f"{e1:g} at batch {b1:g} < {e0:g} at batch {b0:g}" for (b0, e0), (b1, e1) in itertools.pairwise(points) if e1 < e0]
    if falls:
        raise ConstraintError(advice(
            f"efficiency_table needs fewer examples at a larger batch: {'; '.join(falls)}",
            "examples to target never fall as the batch grows (E(B) = E_min·(1 + B/B_noise)); "
            "a falling table would make E(B)/E_min below 1",
            "give examples (or epochs) to target, not steps: examples = steps × batch",
        ))
    return points


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def time_to_target(step: float, batch: float, factor: float, min_examples: float = 1.0) -> float:
    """Seconds to reach the target: ``E_min · factor / B`` steps of ``step`` seconds."""
    return min_examples * factor / batch * step
