r"""Lower bounds on the pipeline objective, valid for every plan (DESIGN §4.4: "give the solver
the bound; report the gap against it").

*Analytic*: every node at its fastest, perfectly balanced, latency paid:

    LB = Σ_n min_s c[n,s] + 2·Σ_k L_k + (M − 1)·max(⌈that / S⌉, max_n min_s c[n,s])

*Chain* (tighter on deep models). Take the heaviest dependency chain h_1 → … → h_L of the
graph (in a transformer, the residual backbone with every matmul on it). In any plan the
chain's nodes fall into S consecutive, possibly empty, segments in stage order. When a
stage boundary falls between h_p and h_{p+1}, every tensor whose producer must come no
later than h_p and one of whose consumers no earlier than h_{p+1} crosses it: the chain
link, the residual stream beside it, a tied weight read at both ends. x(p) sums their
cheapest transfers, plus the least cut through the off-chain nodes free to sit on either
side (a path around the chain — attention's value projection — crosses somewhere too).
So every stage costs at least its chain segment's compute (with the off-chain nodes that
must lie inside it), plus the latency and x at each of its boundaries:

    T ≥ B* = min over 0 = p_0 ≤ … ≤ p_S = L of max_s [ c_H(p_s, p_{s+1}) + [s > 0](L + x(p_s))
                                                         + [s < S−1](L + x(p_{s+1})) ]

with x(0) = x(L) = 0 (a boundary outside the chain crosses no chain link) and L, x at their
cheapest over boundaries. B* is a bottleneck dynamic program over chain positions; unlike
⌈total / S⌉ it knows that cutting inside a layer moves large tensors and that nodes do
not split.

*Crossings* (the Σ_s t_s term). The S − 1 boundaries sit at chain positions, and each pays
x(p) to both its stages. Stages are never empty, so a second boundary at the same position
needs a stage of off-chain units that may lie there: a position holds at most 1 + (such
units) boundaries (only the units at p = 0 and p = L). The cheapest S − 1 slots bound the
sum. With many stages (M = 4S micro-batches, 64 devices) this term is most of the gap.

The chain itself, its positions' crossings x(p) and the off-chain nodes pinned along it come
from :mod:`~autosplit.solver.pipeline.chain` (:class:`Chain`, :func:`chain_of`, re-exported here).

Usage::

    bound = lower_bound(problem)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autosplit.options import SolverLimits
from autosplit.solver.pipeline.chain import Chain, chain_of
from autosplit.solver.pipeline.memory import memory_chain_floor, memory_floor, memory_units
from autosplit.solver.problem import Problem

__all__ = [
    "Chain", "chain_of", "lower_bound", "chain_bound", "chain_bounds", "crossing_floor", "crossing_floors", "memory_units",
    "memory_chain_floor", "memory_floor",
]


@dataclass(frozen=True)
class _Segments:
    """Every chain segment (a, b] of at most ``upper`` compute, as [b, j] arrays (a = starts[b, j])
    of the least time a stage holding it takes as the first, a middle or the last stage."""

    starts: np.ndarray
    first: np.ndarray
    middle: np.ndarray
    last: np.ndarray
    x: np.ndarray

    @classmethod
    def of(cls, problem: Problem, c: Chain, upper: float) -> _Segments:
        L = len(c.nodes)
        lat = float(min(problem.boundary_latency))
        ends = np.arange(L + 1)
        lo = np.searchsorted(c.prefix, c.prefix - upper, side="left") if math.isfinite(upper) else np.zeros(L + 1, dtype=int)
        width = int((ends - lo).max()) + 1
        starts = ends[:, None] - np.arange(width)[None, :]  # segment (a, b], a ≤ b: empty segments allowed
        valid = (starts >= lo[:, None]) & (starts >= 0)
        starts = np.clip(starts, 0, L)
        forced = np.maximum(0.0, c.forced_end[ends][:, None] - c.forced_start[starts])
        segment = c.prefix[ends][:, None] - c.prefix[starts] + forced
        segment[~valid] = np.inf
        left, right = lat + c.x[starts], lat + c.x[ends][:, None]
        return cls(starts, segment + right, segment + left + right, segment + left, c.x)

    def least_crossings(self, S: int, cap: float) -> float:
        """The least Σ x over the S − 1 boundaries of a split whose every stage takes at most ``cap``."""
        paid = self.x[self.starts]  # the boundary a segment starts at (none for stage 0)
        first, middle, last = (np.where(t <= cap, 0.0, np.inf) for t in (self.first, self.middle, self.last))
        middle += paid
        last += paid
        cost = np.where(np.arange(len(self.x)) == 0, 0.0, np.inf)
        for s in range(S):
            cost = (cost[self.starts] + (first if s == 0 else last if s == S - 1 else middle)).min(axis=1)
        return float(cost[-1])


def chain_bounds(problem: Problem, upper: float = math.inf, chain: Chain | None = None) -> list[float]:
    """[k] B* above with the chain in at most k segments (k = 1..S; [0] unused): no plan whose
    boundaries cut the chain into k pieces has a faster slowest stage. ``upper`` (the slowest
    stage of a known plan) narrows the DP: a segment of more compute than ``upper`` is left out,
    so a count of pieces whose best split has a segment over it is bounded by ``upper`` — and by
    the k-th of the chain's compute that one of its k pieces holds.

    Off-chain nodes forced into a segment (a, b] count as F(b) − G(a): the nodes forced
    inside, less those spanning past both ends, so never more than the true sum.
    """
    S = problem.num_stages
    c = chain or chain_of(problem)
    L = len(c.nodes)
    whole = float(c.prefix[-1])
    if S == 1 or L == 0:
        return [0.0] + [whole] * S
    seg = _Segments.of(problem, c, upper)
    bounds = [0.0, whole]
    head = np.maximum(np.where(np.arange(L + 1) == 0, 0.0, np.inf)[seg.starts], seg.first).min(axis=1)  # first, k − 2 middles
    for k in range(2, S + 1):
        value = float(np.maximum(head[seg.starts], seg.last).min(axis=1)[L])
        bounds.append(max(min(value, upper), whole / k))  # k pieces hold the chain: one holds a k-th of it
        head = np.maximum(head[seg.starts], seg.middle).min(axis=1)
    return bounds


_SEGMENT_CELLS = 20_000_000
"""The most [end, start] cells :func:`traded_bound` lets its segment arrays take (a wider trade is cut short)."""


def traded_bound(problem: Problem, total: float, low: float, slowest: float, chain: Chain | None = None, points: int = 3) -> float:
    """The objective bounded by trading the slowest stage T against what the boundaries carry.

    Any plan whose slowest stage takes T has its boundaries at a split of the chain whose every
    stage takes at most T, so they carry at least X(T), the least over such splits (a DP like
    B*'s, summing instead of maximising): the objective is at least total + 2·X(T) + (M − 1)·T.
    X falls as T grows, so on a grid T_0 < … < T_K, from ``slowest`` (B*) up to where the trade
    stops paying (X never falls below ``low``), every plan is above
    min_i total + 2·X(T_{i+1}) + (M − 1)·T_i.
    """
    S, M = problem.num_stages, problem.micro_batches
    c = chain or chain_of(problem)
    if S == 1 or M == 1 or not c.nodes:
        return 0.0
    t0 = slowest  # B*: no plan's slowest stage is faster
    x0 = _Segments.of(problem, c, t0).least_crossings(S, t0)
    if not math.isfinite(x0) or x0 <= low:
        return total + 2 * x0 + (M - 1) * t0 if math.isfinite(x0) else 0.0
    top = t0 + 2 * (x0 - low) / (M - 1)
    ends = np.arange(len(c.prefix))
    while top > t0 * 1.001 and len(ends) * (ends - np.searchsorted(c.prefix, c.prefix - top)).max() > _SEGMENT_CELLS:
        top = t0 + (top - t0) / 2  # any top is valid: past it, the bound counts the least crossing, ``low``
    seg = _Segments.of(problem, c, top)
    grid = [t0 + (top - t0) * i / points for i in range(points + 1)]
    crossings = [x0, *(seg.least_crossings(S, t) for t in grid[1:])]
    traded = [total + 2 * crossings[i + 1] + (M - 1) * grid[i] for i in range(points)]
    return min(*traded, total + 2 * low + (M - 1) * top)


def chain_bound(problem: Problem, upper: float = math.inf, chain: Chain | None = None) -> float:
    """B* above, for the plan's S stages."""
    return chain_bounds(problem, upper, chain)[problem.num_stages]


def crossing_floors(problem: Problem, chain: Chain | None = None) -> list[float]:
    """[D] the least the S − 1 boundaries carry, summed (each charged to both its stages), when D
    of them sit at distinct positions inside the chain (∞ where no plan can): D positions at
    their cheapest, the rest at the ends (free; as many as there are off-chain units to fill their
    stages) or again at a chosen position (its x at least)."""
    S = problem.num_stages
    c = chain or chain_of(problem)
    L = len(c.nodes)
    inner = np.sort(c.x[1:L]) if L > 1 else np.zeros(0)
    at_ends = int(c.room[0] + c.room[L]) if L else S - 1
    floors = []
    for D in range(S):
        rest = max(0, S - 1 - D - at_ends)
        if D > len(inner) or (rest and D == 0):
            floors.append(math.inf)
        else:
            floors.append(2.0 * float(inner[:D].sum() + rest * (inner[0] if D else 0.0)))
    return floors


def crossing_floor(problem: Problem, chain: Chain | None = None) -> float:
    """The least any plan's S − 1 boundaries carry, summed (each is charged to both its stages)."""
    return min(crossing_floors(problem, chain))


def lower_bound(
    problem: Problem, upper: float = math.inf, enough: float | None = None, *, limits: SolverLimits = SolverLimits()
) -> int:
    """The best of the bounds above, on the objective ``Σ t_s + (M − 1)·max t_s`` (``M · max t_s``
    for a :attr:`~Problem.steady` one).

    The two terms are bounded together: boundaries placed where they carry little (outside the
    chain, or several at one position) cut the chain into fewer pieces, so the slowest stage is
    slower. For each count D of distinct positions inside the chain, the Σ term pays the D
    cheapest and the max term the chain in D + 1 pieces; the least over D bounds every plan.
    The chain DP is narrowed to segments of at most ``upper`` compute (a known plan's slowest
    stage), then run again up to the slowest stage that the bound with every boundary inside the
    chain leaves room for. Unless that already reaches ``enough`` (the bound that proves a known
    plan), :func:`traded_bound` bounds the stages and the crossings together. ``limits``: how far
    the chain's detour cuts look (:attr:`SolverLimits.free_span`).
    """
    S, M = problem.num_stages, problem.micro_batches
    fastest = problem.fastest
    total = sum(fastest) + 2 * sum(problem.boundary_latency)
    if problem.stages_per_rank > 1:  # several stages per rank: the work spread evenly over ranks and stages, no more
        largest = max(fastest, default=0)
        return M * max(math.ceil(total / problem.ranks), largest) + (problem.ranks - 1) * max(math.ceil(total / S), largest)
    c = chain_of(problem, limits)
    balanced = max(math.ceil(total / S), max(fastest, default=0))
    if problem.steady:  # M · the slowest stage, which no split makes faster than the chain in S pieces
        return M * max(balanced, math.floor(chain_bounds(problem, upper, c)[S]))
    crossings = [(D, math.floor(x)) for D, x in enumerate(crossing_floors(problem, c)) if math.isfinite(x)]
    if M == 1:
        return total + min(x for _, x in crossings)

    def candidates(cap: float) -> dict[int, int]:
        pieces[:] = chain_bounds(problem, cap, c)
        return {D: total + x + (M - 1) * max(balanced, math.floor(pieces[min(D + 1, S)])) for D, x in crossings}

    pieces: list[float] = []
    first = candidates(upper)
    slowest = pieces[S]  # exact: no split beats a known plan's slowest stage
    # The chain in S pieces is bounded exactly (no split beats a known plan's slowest stage), so
    # every boundary inside the chain gives a true value; fewer pieces matter only while their
    # slowest stage stays below what leaves that value reachable: the DP runs again up to there.
    reference = first.get(S - 1, min(first.values()))
    again = candidates(math.ceil((reference - total) / (M - 1)))
    coupled = max(min(first.values()), min(again.values()))
    if enough is not None and coupled >= enough:
        return coupled  # proves the known plan already
    return max(coupled, math.floor(traded_bound(problem, total, min(x for _, x in crossings) / 2, slowest, c)))
