r"""The split at layer boundaries with each stage's recomputation costed (DESIGN §4.4).

With activation checkpointing left to the planner, the strategy's dynamic programs split the model
recomputing the fewest blocks and the most, and then let each rank keep what its memory holds
(:func:`~autosplit.solver.pipeline.strategy._keep_what_fits`). Neither sees that a stage holding
fewer layers recomputes fewer of them: Llama-3-70B's 80 identical layers on 32 1F1B stages
(``S − s`` micro-batches in flight on stage s), split with every layer recomputed, came out as 27
stages of three layers and five with none; this split puts two layers on the stages that hold the
most micro-batches, three on most others, and none without a layer (2 % faster by the model).

This dynamic program cuts only between units — the blocks the problem may recompute (a repeated
layer), the runs of nodes between them, and inside each block where a boundary carries least (a
block cut through keeps its activations) — and costs stage s holding units (i, j] as the model does
(:mod:`~autosplit.solver.pipeline.dp`'s prefix sums: compute, transfers at both ends, state,
activations, received and held tensors), plus the least recomputation that brings its memory under
its cap:

    t_s(i, j) = C_s(i, j) + X_s + min { time(f, k) : saves(f, k) ≥ mem_s(i, j) + reserve − cap_s }

over f of the blocks whole inside it recomputed whole and one keeping k of its in-flight
micro-batches (:meth:`~autosplit.solver.problem.Recompute.partly`), the blocks being identical
(otherwise it does not apply). The objective ``Σ t_s + (M − 1)·max t_s`` is minimised as the split DP
does: the least sum under each cap T, over caps from the least bottleneck up. The strategy then lets
each rank keep what fits (the exact choice) and costs the plan on the nodes like every other candidate.

Usage::

    stage_of = layer_split(problem, topological_order(problem))   # None where it does not apply
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autosplit.solver.pipeline.dp import Prefix, forbidden_cuts, prefix_sums
from autosplit.solver.problem import Problem

__all__ = ["layer_split"]

CAPS = 64
"""Most caps on the slowest stage the sum pass is run under (evenly spread past the least bottleneck)."""
MOST_CELLS = 4 * 10**7
"""The most [stage, end, start] stage times the program tabulates (Llama-3-70B on 32 stages: 0.9 million)."""


def _units(problem: Problem, order: Sequence[int], pre: Prefix) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(cut positions along ``order``: every recomputable block's ends and, inside each, the position
    where a boundary carries least; per cut, how many blocks end at or before it, and how many start
    before it), or None when a block is not a run of ``order``. A stage holds whole the blocks between
    its cuts; one cut through, it keeps (both halves keep their activations)."""
    pos = np.empty(len(order), dtype=np.int64)
    pos[np.asarray(order)] = np.arange(len(order))
    cuts, spans = {0, len(order)}, []
    carried = pre.X[:, 0] if pre.X.shape[1] else np.zeros(len(order) + 1)
    for block in problem.recompute:
        p = np.sort(pos[list(block.members)])
        if p[-1] - p[0] + 1 != len(p):
            return None
        start, end = int(p[0]), int(p[-1]) + 1
        spans.append((start, end))
        cuts |= {start, end}
        if end - start > 1:
            cuts.add(start + 1 + int(np.argmin(carried[start + 1: end])))
    arr = np.asarray(sorted(cuts))
    arr = arr[~forbidden_cuts(problem, order)[arr]]
    starts, ends = np.sort([a for a, _ in spans]), np.sort([b for _, b in spans])
    return arr, np.searchsorted(ends, arr, side="right"), np.searchsorted(starts, arr, side="left")


def _menu(problem: Problem, s: int) -> np.ndarray:
    """[(KiB saved, ns taken)] of one block on stage s recomputed keeping k = 1 … of its in-flight micro-batches."""
    block = problem.recompute[0]
    window = block.in_flight[s] if block.in_flight else 1
    parts = [block.partly(s, keep, problem.micro_batches) for keep in range(1, window)]
    return np.array([(p.saves[s], p.compute[s]) for p in parts], dtype=np.float64).reshape(-1, 2)


def _frontier(problem: Problem, s: int, n: int, menu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(KiB saved, least ns taken to save at least that) by n identical blocks on stage s: f recomputed
    whole and at most one keeping some micro-batches (``menu``: :func:`_menu`)."""
    block = problem.recompute[0]
    whole = np.arange(n + 1, dtype=np.float64)
    saves = [whole * block.saves[s]]
    time = [whole * block.compute[s]]
    if len(menu) and n > 0:
        saves.append((whole[:-1, None] * block.saves[s] + menu[None, :, 0]).ravel())
        time.append((whole[:-1, None] * block.compute[s] + menu[None, :, 1]).ravel())
    saved, taken = np.concatenate(saves), np.concatenate(time)
    order = np.lexsort((taken, saved))
    saved, taken = saved[order], taken[order]
    return saved, np.minimum.accumulate(taken[::-1])[::-1]


def _stage_times(problem: Problem, pre: Prefix, cuts: np.ndarray, counts: tuple[np.ndarray, np.ndarray], s: int) -> np.ndarray:
    """[j, i] stage s's time holding units (i, j] with the least recomputation that fits (∞: none does)."""
    S = problem.num_stages
    a, b = cuts[None, :], cuts[:, None]
    t = pre.C[b, s] - pre.C[a, s]
    mem = pre.Mst[b] - pre.Mst[a] + pre.A[b, s] - pre.A[a, s] + problem.transient_mem
    if s > 0:
        t, mem = t + pre.X[a, s - 1], mem + pre.R[a, s]
    if s < S - 1:
        t, mem = t + pre.X[b, s], mem + pre.H[b, s]
    n = np.maximum(0, counts[0][:, None] - counts[1][None, :])  # blocks whole inside (i, j]
    excess = mem - problem.capacity[s] // problem.stages_per_rank
    extra = np.full(t.shape, np.inf)
    extra[excess <= 0] = 0.0
    reserve = max((block.room for block in problem.recompute), default=0)
    menu = _menu(problem, s)
    for k in np.unique(n[(excess > 0) & (n > 0)]):
        saves, time = _frontier(problem, s, int(k), menu)
        pick = (n == k) & (excess > 0)
        i = np.searchsorted(saves, excess[pick] + reserve, side="left")
        extra[pick] = np.where(i < len(saves), time[np.minimum(i, len(saves) - 1)], np.inf)
    ok = (a < b) & ((pre.F[b, s] - pre.F[a, s]) == 0)
    return np.where(ok, t + extra, np.inf)


def layer_split(problem: Problem, order: Sequence[int]) -> tuple[int, ...] | None:
    """The best split at unit boundaries (node → stage) by the costs above, or None (blocks that differ
    or are not runs of ``order``, several stages per rank, or no split fits)."""
    blocks, S = problem.recompute, problem.num_stages
    if not blocks or any(b.forced is not None for b in blocks) or problem.stages_per_rank > 1 or problem.steady:
        return None
    if any((b.compute, b.saves, b.room, b.in_flight) != (blocks[0].compute, blocks[0].saves, blocks[0].room, blocks[0].in_flight)
           for b in blocks):
        return None
    pre = prefix_sums(problem, order)
    units = _units(problem, order, pre)
    if units is None or len(units[0]) - 1 < S:
        return None
    cuts, ends, starts = units
    if len(cuts) ** 2 * S > MOST_CELLS:
        return None
    times = np.stack([_stage_times(problem, pre, cuts, (ends, starts), s) for s in range(S)])  # [s, j, i]
    back = _best(times, problem.micro_batches)
    if back is None:
        return None
    stage_of = [0] * len(order)
    j = len(cuts) - 1
    for s in range(S - 1, -1, -1):
        i = back[s][j]
        for p in range(cuts[i], cuts[j]):
            stage_of[order[p]] = s
        j = i
    return tuple(stage_of)


def _run(times: np.ndarray, cap: float, combine) -> tuple[float, list[np.ndarray]]:
    S, K = times.shape[0], times.shape[1]
    val = np.full(K, np.inf)
    val[0] = 0.0
    back = []
    for s in range(S):
        t = np.where(times[s] <= cap, times[s], np.inf)
        cand = combine(val[None, :], t)
        back.append(np.argmin(cand, axis=1))
        val = cand[np.arange(K), back[-1]]
    return float(val[-1]), back


def _best(times: np.ndarray, M: int) -> list[np.ndarray] | None:
    """Back-pointers of the split of least ``Σ t_s + (M − 1)·max t_s``: the least bottleneck T*, then
    the least sum under caps from T* up to where a slower bottleneck cannot pay for itself."""
    t_star, _ = _run(times, math.inf, np.maximum)
    if not math.isfinite(t_star):
        return None
    free, _ = _run(times, math.inf, np.add)
    base, best_back = _run(times, t_star, np.add)
    best = base + (M - 1) * t_star
    limit = t_star + (base - free) / max(1, M - 1)
    values = np.unique(times[np.isfinite(times) & (times > t_star) & (times <= limit)])
    if len(values) > CAPS:
        values = values[np.linspace(0, len(values) - 1, CAPS).round().astype(int)]
    for cap in values:
        total, back = _run(times, float(cap), np.add)
        if total + (M - 1) * cap < best:
            best, best_back = total + (M - 1) * cap, back
    return best_back
