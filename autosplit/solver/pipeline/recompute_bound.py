r"""A time bound that knows what the memory caps force a plan to recompute (DESIGN §4.2–4.4).

:func:`~autosplit.solver.pipeline.bounds.lower_bound` bounds the plans of the problem that recomputes
only what it must: recomputing more only adds time. Where the caps leave no plan that keeps its
activations (Llama-3-70B on 32 H100s, bf16-mixed: every 1F1B stage holds ``S − s`` micro-batches of
its layers' activations), that bound misses what every plan pays again in its backward, and a plan
that is near the optimum shows a gap of 30 %.

Along the heaviest chain (:mod:`~autosplit.solver.pipeline.chain`), a stage holding the chain segment
(a, b] holds at least the memory pinned there (:func:`~autosplit.solver.pipeline.memory.along_chain`:
the chain's nodes, their colocated groups, the units that must lie between them). Whatever of that
exceeds the stage's room (its cap less the transient reserve) it must save by recomputing, and no
recomputation on stage s saves a KiB for less than

    e_s = min over blocks u and micro-batches kept k of  recompute time(u, s, k) / KiB saved(u, s, k)

(:meth:`~autosplit.solver.problem.Recompute.partly`). So stage s takes at least

    t_s(a, b) ≥ compute(a, b) + latency and crossings at its ends + e_s · max(0, held_s(a, b) − room_s)

and the bottleneck dynamic program of the chain bound, with these times, bounds the slowest stage
(B_r); a second, summing the penalties, bounds what the stages recompute together (P). Every plan
whose slowest stage takes at most T_P pays ``total + X + P + (M − 1)·B_r`` (X: the least the
boundaries carry); any other, ``total + X + (M − 1)·T_P``. The bound is the lesser of the two.

Usage::

    bound = recompute_bound(problem, problem.fixed(problem.forced[0]), upper=slowest_stage_of_a_known_plan)
"""

from __future__ import annotations

import math

import numpy as np

from autosplit.options import SolverLimits
from autosplit.solver.pipeline.bounds import _Segments, crossing_floor
from autosplit.solver.pipeline.chain import chain_of
from autosplit.solver.pipeline.memory import along_chain
from autosplit.solver.problem import Problem

__all__ = ["recompute_bound", "saving_rates"]


def saving_rates(problem: Problem) -> list[float]:
    """[stage] the least time (ns) any block the problem may recompute takes again per KiB it saves
    there, over every count of micro-batches it may keep (∞ where none saves anything)."""
    must, may = problem.forced
    rates = [math.inf] * problem.num_stages
    for u in sorted(set(may) - set(must)):
        block = problem.recompute[u]
        for s in range(problem.num_stages):
            window = block.in_flight[s] if block.in_flight else 1
            for keep in range(window):
                way = block.partly(s, keep, problem.micro_batches) if keep else block
                if way.saves[s] > 0:
                    rates[s] = min(rates[s], way.compute[s] / way.saves[s])
    return rates


def recompute_bound(problem: Problem, fewest: Problem, *, upper: float, limits: SolverLimits = SolverLimits()) -> int:
    """The objective bound above, for ``problem`` (with its :attr:`~Problem.recompute` blocks) and
    ``fewest``, the problem recomputing only the blocks it must; ``upper``: the slowest stage of a
    known plan (ns, its recomputation included), which narrows the dynamic programs. 0 where it does
    not apply (one stage, one micro-batch, several stages per rank, a steady schedule, nothing to recompute)."""
    S, M = fewest.num_stages, fewest.micro_batches
    rates = saving_rates(problem)
    if S == 1 or M == 1 or fewest.stages_per_rank > 1 or fewest.steady or not math.isfinite(upper):
        return 0
    c = chain_of(fewest, limits)
    if not c.nodes:
        return 0
    along = along_chain(fewest, c.nodes)
    total = sum(fewest.fastest) + 2 * sum(fewest.boundary_latency)
    crossing = crossing_floor(fewest, c)
    slowest = _bottleneck(problem, fewest, c, along, rates, upper)
    reach = upper + max(0.0, upper - slowest)  # plans slower than this pay (M − 1)·reach already
    paid = _least_paid(problem, fewest, c, along, rates, reach)
    if slowest + paid / (M - 1) > reach:  # reach far enough that slower plans pay more than the bound below
        reach = slowest + paid / (M - 1)
        paid = _least_paid(problem, fewest, c, along, rates, reach)
    within = total + crossing + paid + (M - 1) * slowest
    return math.floor(min(within, total + crossing + (M - 1) * reach))


def _savable(problem: Problem, chain: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(per chain position, how many blocks the problem may recompute end by there, and how many
    start by there; [s] the KiB the blocks with no chain node save at most, together). A stage that
    holds the chain segment (a, b] can recompute only the blocks whose chain nodes lie inside it
    (a block recomputes whole, on one stage): ``ends[b] − starts[a]`` of them, when positive."""
    must, may = problem.forced
    L, S = len(chain), problem.num_stages
    position = {h: p + 1 for p, h in enumerate(chain)}
    ends, starts, free = np.zeros(L + 2), np.zeros(L + 2), np.zeros(S)
    for u in sorted(set(may) - set(must)):
        block = problem.recompute[u]
        held = [position[n] for n in block.members if n in position]
        if not held:
            free += np.asarray(block.saves, dtype=np.float64)
            continue
        ends[max(held)] += 1
        starts[min(held)] += 1
    return np.cumsum(ends)[: L + 1], np.cumsum(starts)[: L + 1], free


def _envelope(problem: Problem, s: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The lower convex envelope (KiB saved → least ns) of the ways one block recomputes on stage s
    (whole, or keeping k of its in-flight micro-batches), from (0, 0); None unless every block the
    problem may recompute is the same there. n such blocks save E in no less than n·g(E/n) (g convex)."""
    must, may = problem.forced
    blocks = [problem.recompute[u] for u in sorted(set(may) - set(must))]
    first = blocks[0] if blocks else None
    if first is None or any((b.compute[s], b.saves[s], b.in_flight[s] if b.in_flight else 1) !=
                            (first.compute[s], first.saves[s], first.in_flight[s] if first.in_flight else 1) for b in blocks):
        return None
    window = first.in_flight[s] if first.in_flight else 1
    ways = [(first.saves[s], first.compute[s])]
    ways += [(w.saves[s], w.compute[s]) for w in (first.partly(s, keep, problem.micro_batches) for keep in range(1, window))]
    hull = [(0.0, 0.0)]
    for x, y in sorted((float(x), float(y)) for x, y in ways if x > 0):
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0]) >= (y - hull[-2][1]) * (hull[-1][0] - hull[-2][0]):
            hull.pop()  # the last point lies on or above the chord: not on the lower envelope
        if x > hull[-1][0]:
            hull.append((x, y))
    xs, ys = (np.array(v) for v in zip(*hull))
    return xs, ys


def _penalties(problem: Problem, fewest: Problem, along, seg: _Segments, rates: list[float], savable, s: int) -> np.ndarray:
    """[b, j] the least time stage s spends recomputing with the chain segment (starts[b, j], b] (∞
    where even every block inside it recomputed whole does not save enough): n blocks inside it save
    the excess E in no less than n·g(E/n) (:func:`_envelope`), or, where the blocks differ, at the
    least rate any of them saves at."""
    b, a = np.arange(seg.starts.shape[0])[:, None], seg.starts
    held = along.read[b, s] - along.read[a, s] + np.maximum(0.0, along.F[0][b, s] - along.G[0][a, s])
    held = held + (along.crossing[0][a, s] if s > 0 else 0.0) + (along.crossing[1][b, s] if s < fewest.num_stages - 1 else 0.0)
    room = fewest.capacity[s] - fewest.transient_mem
    # A stage over its room recomputes, and keeps room for a recomputed block's backward (its reserve).
    reserve = min((problem.recompute[u].reserve for u in set(problem.forced[1]) - set(problem.forced[0])), default=0)
    excess = np.where(held > room, held + reserve - room, 0.0)
    ends, begins, free = savable
    most = max((block.saves[s] for block in problem.recompute), default=0)
    inside = np.maximum(0.0, ends[b] - begins[a])
    savable = inside * most + free[s]
    linear = 0.0 if math.isinf(rates[s]) else rates[s] * excess
    hull = _envelope(problem, s) if not free[s] else None
    if hull is not None:
        each = np.where(inside > 0, excess / np.maximum(inside, 1.0), 0.0)
        linear = np.where(inside > 0, inside * np.interp(np.minimum(each, hull[0][-1]), *hull), linear)
    return np.where(excess <= savable, linear, np.inf)


def _bottleneck(problem: Problem, fewest: Problem, c, along, rates: list[float], upper: float) -> float:
    """B_r: the least slowest stage over splits of the chain, each stage's recomputation included
    (stages over ``upper`` left out: the answer is then ``upper``)."""
    best = _over_splits(problem, fewest, c, along, rates, upper,
                        lambda before, times, paid: np.maximum(before, times + paid))
    return float(min(best, upper))


def _least_paid(problem: Problem, fewest: Problem, c, along, rates: list[float], reach: float) -> float:
    """P: the least the stages recompute together over splits of the chain whose every stage takes at
    most ``reach`` (compute, crossings and recomputation)."""
    paid = _over_splits(problem, fewest, c, along, rates, reach,
                        lambda before, times, paid: np.where(times + paid <= reach, before + paid, np.inf))
    return paid if np.isfinite(paid) else 0.0


def _over_splits(problem: Problem, fewest: Problem, c, along, rates: list[float], limit: float, step) -> float:
    """The DP over contiguous splits of the chain into the problem's stages (stages over ``limit`` left
    out): ``step(value before the stage, the stage's times, its recomputation)`` → the value with it, the
    least over where the stage starts kept."""
    S, L = fewest.num_stages, len(c.nodes)
    seg = _Segments.of(fewest, c, limit)
    savable = _savable(problem, c.nodes)
    val = np.where(np.arange(L + 1) == 0, 0.0, np.inf)
    for s in range(S):
        times = seg.first if s == 0 else seg.last if s == S - 1 else seg.middle
        val = step(val[seg.starts], times, _penalties(problem, fewest, along, seg, rates, savable, s)).min(axis=1)
    return float(val[L])
