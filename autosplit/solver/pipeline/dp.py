r"""Exact dynamic program over split points of a topological order (DESIGN §4.4).

Stages are contiguous runs of one topological order, stage ``s`` on device ``s``; cuts
may fall only at ``allowed`` positions (block boundaries after coarsening, or every
position). With prefix sums, stage ``s`` over positions ``(a, b]`` costs

    t_s(a, b) = C_s[b] − C_s[a] + X_s[a] + X_{s+1}[b]

where ``C_s`` is compute on device ``s`` and ``X_k[p]`` the transfer time at boundary
``k`` when it sits at position ``p`` (the tensors produced at or before ``p`` and read
after it, relayed stage to stage, plus latency). Memory is checked per segment the same
way. Two passes over K allowed cuts, vectorised with numpy; each stage looks back only
over the band of cuts whose compute fits under the pass's cap (an equal-compute split's
slowest stage bounds the bottleneck pass), so a pass costs about K², whatever S:

1. *bottleneck*: ``f_s[b] = min_a max(f_{s−1}[a], t_s(a, b))`` gives T*, the least
   possible slowest stage (the classic linear-partition recurrence).
2. *sum under a cap*: ``g_s[b] = min_a g_{s−1}[a] + t_s(a, b)`` over segments with
   ``t_s ≤ T`` gives the least Σ t_s given bottleneck ≤ T.

The pipeline objective ``Σ t_s + (M − 1)·max t_s`` is minimised by scanning T over the
segment costs in ``[T*, T* + (g(T*) − g(∞)) / (M − 1)]``: a larger bottleneck cannot pay
for itself. The scan is exact; it stops at ``max_candidates`` values, evenly spread (then the
result is the best of those, still a valid plan) so the DP's time stays bounded.

Usage::

    order = topological_order(problem)
    stage_of = split_dp(problem, order)          # None when no contiguous split fits memory
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autosplit.solver.evaluation import evaluate
from autosplit.solver.pipeline.memory import windows
from autosplit.solver.problem import Problem
from autosplit.solver.validate import violations

__all__ = ["topological_order", "split_dp", "forbidden_cuts", "prefix_sums", "Prefix"]

_INF = np.inf
_EXACT_FREE_SUM = 5 * 10**7  # K² · S up to which the unconstrained least sum is computed exactly
ROOM_REPAIRS = 3
"""Times the DP runs again with less room for the stages of a rank its split holds over its cap (several stages per rank)."""


def topological_order(problem: Problem) -> list[int]:
    """The nodes' order with every input-free node moved to just before its first reader.

    Captured graphs list parameters (``torch.export`` hoists every ``get_attr``) and
    input-only computations (mask preprocessing) at the top; left there they would pin
    the first stage and break module runs apart.
    """
    preds: list[list[int]] = [[] for _ in problem.nodes]
    for u, v in (*problem.edges, *problem.order_edges):
        preds[v].append(u)
    deferred = {n for n in range(len(problem.nodes)) if not preds[n]}
    emitted: set[int] = set()
    order: list[int] = []

    def emit(n: int) -> None:
        for u in preds[n]:
            if u not in emitted:
                emit(u)
        emitted.add(n)
        order.append(n)

    for n in range(len(problem.nodes)):
        if n not in deferred and n not in emitted:
            emit(n)
    for n in sorted(deferred - emitted):  # sources nothing reads
        emit(n)
    return order


def forbidden_cuts(problem: Problem, order: Sequence[int]) -> np.ndarray:
    """Cut positions that would separate colocated nodes (boolean mask over 0..N)."""
    pos = np.empty(len(order), dtype=np.int64)
    pos[np.asarray(order)] = np.arange(len(order))
    diff = np.zeros(len(order) + 2, dtype=np.int64)
    groups = [*problem.colocate, *(c.together for c in problem.constraints if len(c.together) > 1)]
    for group in groups:
        p = pos[list(group)]
        diff[p.min() + 1] += 1
        diff[p.max() + 1] -= 1
    return np.cumsum(diff)[: len(order) + 1] > 0


@dataclass(frozen=True)
class Prefix:
    """Prefix sums along one order, and which stages cost alike; reused by every DP over that order."""

    C: np.ndarray
    """[p, s] compute of the first p nodes on stage s."""
    A: np.ndarray
    Mst: np.ndarray
    X: np.ndarray
    """[p, k − 1] transfer at boundary k when it sits at position p."""
    R: np.ndarray
    H: np.ndarray
    F: np.ndarray
    kind: tuple[int, ...]
    """[s] stages whose costs, limits and constraints match (identical devices on identical
    links) share a kind, and so their DP bands."""


def prefix_sums(problem: Problem, order: Sequence[int]) -> Prefix:
    """Prefix sums along ``order``: compute[s], state, act[s], and boundary arrays per boundary k."""
    o = np.asarray(order)
    N, S, arrays = len(order), problem.num_stages, problem.arrays
    compute = arrays.compute[o].astype(np.float64)  # (N, S)
    act = arrays.act[o].astype(np.float64)
    state = arrays.state[o].astype(np.float64)
    zero = np.zeros((1, S))
    C = np.vstack([zero, np.cumsum(compute, axis=0)])  # (N+1, S)
    A = np.vstack([zero, np.cumsum(act, axis=0)])
    Mst = np.concatenate([[0.0], np.cumsum(state)])
    # Tensor u crosses every cut position in [pos(u) + 1, last reader position].
    pos = np.empty(N, dtype=np.int64)
    pos[o] = np.arange(N)
    last = pos.copy()
    np.maximum.at(last, arrays.producer, pos[arrays.consumer])
    transfer = arrays.transfer.astype(np.float64)
    recv = arrays.recv.astype(np.float64)
    send = arrays.send.astype(np.float64)
    X = np.zeros((N + 2, max(S - 1, 0)))
    R = np.zeros((N + 2, S))
    H = np.zeros((N + 2, S))  # held by the sender
    crossing = last > pos
    starts, stops = pos[crossing] + 1, last[crossing] + 1
    np.add.at(X, starts, transfer[crossing])
    np.add.at(X, stops, -transfer[crossing])
    np.add.at(R, starts, recv[crossing])
    np.add.at(R, stops, -recv[crossing])
    np.add.at(H, starts, send[crossing])
    np.add.at(H, stops, -send[crossing])
    X = np.cumsum(X, axis=0)[: N + 1] + np.asarray(problem.boundary_latency, dtype=np.float64)
    R = np.cumsum(R, axis=0)[: N + 1]
    H = np.cumsum(H, axis=0)[: N + 1]
    # F[p, s]: how many of the first p nodes may not sit on stage s (user constraints).
    F = np.zeros((N + 1, S))
    for c in problem.constraints:
        for n, st in c.forbid:
            F[pos[n] + 1, st] += 1
    F = np.cumsum(F, axis=0)

    def columns(s: int) -> bytes:
        parts = [C[:, s], A[:, s], R[:, s], H[:, s], F[:, s], np.array([problem.capacity[s], s == 0, s == S - 1])]
        parts += [X[:, s - 1]] if s > 0 else []
        parts += [X[:, s]] if s < S - 1 else []
        return b"".join(np.ascontiguousarray(x, dtype=np.float64).tobytes() for x in parts)

    kinds: dict[bytes, int] = {}
    return Prefix(C, A, Mst, X, R, H, F, tuple(kinds.setdefault(columns(s), len(kinds)) for s in range(S)))


def _upper_bound(problem: Problem, order: Sequence[int], cuts: np.ndarray, C: np.ndarray) -> float:
    """The slowest stage of a valid equal-compute split at allowed cuts (inf if it is not valid):
    no optimal plan has a stage whose compute alone exceeds it."""
    S, N = problem.num_stages, len(order)
    K = len(cuts)
    if K - 1 < S:
        return _INF
    marks = np.searchsorted(C[cuts, 0], C[-1, 0] * np.arange(1, S) / S)
    picked = np.clip(marks, 1, K - 2)
    for i in range(S - 1):  # a node heavier than a stage pulls marks together: keep stages non-empty
        lowest = picked[i - 1] + 1 if i else 1
        picked[i] = min(max(picked[i], lowest), K - S + i)
    stage_of = [0] * N
    bounds = [0, *cuts[picked].tolist(), N]
    for st in range(S):
        for p in range(bounds[st], bounds[st + 1]):
            stage_of[order[p]] = st
    if violations(problem, stage_of):
        return _INF
    return float(max(evaluate(problem, stage_of).time))


def _allowed_cuts(problem: Problem, order: Sequence[int], allowed: Sequence[int] | None) -> np.ndarray:
    """The cut positions a split may use: ``allowed`` (every position by default) and both ends,
    less those that would separate colocated nodes."""
    N = len(order)
    bad = forbidden_cuts(problem, order)
    cuts = np.arange(N + 1) if allowed is None else np.unique(np.concatenate([[0, N], np.asarray(allowed, dtype=np.int64)]))
    return cuts[~bad[cuts]]


class _StageDP:
    """The DP over stages at one order's allowed cuts: each stage's band of candidate segments
    (cached per kind of stage and cap), the passes that combine them, and the split they pick."""

    def __init__(self, problem: Problem, order: Sequence[int], cuts: np.ndarray, pre: Prefix) -> None:
        self.problem, self.order, self.cuts, self.pre = problem, order, cuts, pre
        self.ends = np.arange(len(cuts))
        self._bands: dict[tuple[int, float], tuple[float, int, np.ndarray]] = {}
        self.room = stage_room(problem, pre, cuts)

    def shrink(self, over: np.ndarray) -> None:
        """Each stage of a rank ``over[r]`` KiB over its cap gets that much less room (bands made again)."""
        self.room = self.room - np.asarray([over[self.problem.rank(s)] for s in range(self.problem.num_stages)]) - 1.0
        self._bands.clear()

    def band(self, s: int, cap: float) -> tuple[int, np.ndarray]:
        """Stages of one kind (and room) have the same band: it is computed once per kind, and a band made under a
        larger finite cap serves a smaller one, its segments over the cap masked (each segment's time is
        at least its compute, which alone decides the band's width)."""
        kind, bands = (self.pre.kind[s], float(self.room[s])), self._bands  # a rank's stages of one kind may get different rooms
        made = bands.get(kind)
        if made is None or made[0] < cap or (math.isinf(made[0]) and math.isfinite(cap)):
            made = bands[kind] = (cap, *self._segments(s, cap))
        made_cap, width, t = made
        return (width, t) if made_cap == cap else (width, np.where(t <= cap, t, _INF))

    def _segments(self, s: int, cap: float) -> tuple[int, np.ndarray]:
        """Stage s ending at each cut b: the band's width W and [b, j] the time of the stage from cut a = b − 1 − j
        (+inf if invalid).

        A stage's compute alone must stay within ``cap``, so only the W cuts before b that
        satisfy it are candidates: a band about K/S wide instead of all K.
        """
        problem, pre, cuts, ends = self.problem, self.pre, self.cuts, self.ends
        S = problem.num_stages
        C, A, Mst, X, R, H, F = pre.C, pre.A, pre.Mst, pre.X, pre.R, pre.H, pre.F
        Cs = C[cuts, s]
        lo = np.searchsorted(Cs, Cs - cap, side="left")
        width = max(1, int((ends - lo).max()))
        valid = np.arange(width)[None, :] <= (ends - 1 - np.maximum(lo, 0))[:, None]

        def at_start(column: np.ndarray) -> np.ndarray:  # a term of the start cut a, read through the band's window
            return windows(column[cuts], width, nearest=1)

        # each term a column over the cuts: those of b broadcast, those of a read at a (the sums in the same order)
        t = C[cuts, s][:, None] - at_start(C[:, s])
        mem = Mst[cuts][:, None] - at_start(Mst) + A[cuts, s][:, None] - at_start(A[:, s]) + problem.transient_mem
        if s > 0:
            t = t + at_start(X[:, s - 1])
            mem = mem + at_start(R[:, s])
        if s < S - 1:
            t = t + X[cuts, s][:, None]
            mem = mem + H[cuts, s][:, None]
        ok = valid & (mem <= self.room[s]) & (F[cuts, s][:, None] == at_start(F[:, s])) & (t <= cap)
        return width, np.where(ok, t, _INF)

    def run(
        self, combine: Callable[[np.ndarray, np.ndarray], np.ndarray], cap: float, collect: tuple[float, float] | None = None
    ) -> tuple[float, list[np.ndarray], list[np.ndarray]]:
        """DP over stages: (value at the end, back-pointers, segment costs seen within ``collect``)."""
        ends = self.ends
        val = np.full(len(self.cuts), _INF)
        val[0] = 0.0
        back, seen = [], []
        for s in range(self.problem.num_stages):
            width, t = self.band(s, cap)
            if collect is not None:
                seen.append(t[(t >= collect[0]) & (t <= collect[1])])
            cand = combine(windows(val, width, _INF, nearest=1), t)  # (K, W): end b, via start b − 1 − j
            arg = np.argmin(cand, axis=1)
            val = cand[ends, arg]
            back.append(np.maximum(ends - 1 - arg, 0))
        return val[-1], back, seen

    def walk(self, back: list[np.ndarray]) -> tuple[int, ...]:
        """The split the back-pointers of a pass pick (node index → stage)."""
        cuts, order = self.cuts, self.order
        stage_of = [0] * len(order)
        b = len(cuts) - 1
        for s in range(self.problem.num_stages - 1, -1, -1):
            a = back[s][b]
            for p in range(cuts[a], cuts[b]):
                stage_of[order[p]] = s
            b = a
        return tuple(stage_of)


def stage_room(problem: Problem, pre: Prefix, cuts: np.ndarray) -> np.ndarray:
    """[stage] KiB the DP lets each stage hold, transient reserve included: its device's cap with one
    stage per rank. A rank's stages share its cap, and the DP sees one stage at a time (it is a warm
    start then; CP-SAT holds each rank's sum to its cap). Each stage gets its typical pipeline buffers
    (the median over the cuts of what it receives and holds to send) and, of the rest of its rank's cap
    less the one reserve the rank keeps, the share an even split of the model costs it: the state, and
    the activations at its in-flight count (interleaved schedules hold more micro-batches on a rank's
    earlier stages), over what the rank holds of that split at its worst moment."""
    capacity = np.asarray(problem.capacity, dtype=np.float64)
    S = problem.num_stages
    if problem.stages_per_rank == 1:
        return capacity
    arrays = problem.arrays
    state, act = float(arrays.state.sum()), arrays.act.sum(axis=0).astype(np.float64)  # [s] the whole model at stage s's in-flight
    buffers = np.asarray([(np.median(pre.R[cuts, s]) if s > 0 else 0.0) + (np.median(pre.H[cuts, s]) if s < S - 1 else 0.0)
                          for s in range(S)])
    ranks = np.asarray([problem.rank(s) for s in range(S)])
    # what the rank holds of the even model at its worst moment: its stages' rooms add up to more than its cap where
    # its stages peak apart, so a split as even as the model fills the cap and no more
    whole = np.bincount(ranks, weights=state + act)
    for r, (L, moments) in enumerate(problem.peak_weights):
        mine = problem.stages_of(r)
        whole[r] = state * len(mine) + max(float(np.dot(weights, act[mine])) for weights in moments) / L
    shared = capacity - problem.transient_mem - np.bincount(ranks, weights=buffers)[ranks]
    return problem.transient_mem + buffers + np.maximum(0.0, shared) * (state + act) / np.maximum(whole[ranks], 1e-9)


def _least_bottleneck(problem: Problem, order: Sequence[int], dp: _StageDP) -> float:
    """T*, the least possible slowest stage (inf when no split fits). The bottleneck pass first
    looks only at segments within a valid equal-compute split's slowest stage (it bounds the
    optimum), and over every segment when that split is not valid."""
    t_star, _, _ = dp.run(np.maximum, _upper_bound(problem, order, dp.cuts, dp.pre.C))
    if not np.isfinite(t_star):
        t_star, _, _ = dp.run(np.maximum, _INF)
    return t_star


def _best_under_caps(problem: Problem, dp: _StageDP, t_star: float, max_candidates: int) -> list[np.ndarray]:
    """Back-pointers of the split of least objective ``Σ t_s + (M − 1)·max t_s``: the least sum under
    each cap T from T* up to where a larger bottleneck cannot pay for itself, at most
    ``max_candidates`` caps beyond T*, evenly spread."""
    K, S = len(dp.cuts), problem.num_stages
    # One stage per rank: Σ t + (M − 1)·max t, exactly. Several: M·max_r Σ_{s on r} t_s + (pp − 1)·max_s t_s
    # ≤ Σ t + (M·v + pp − 1)·max t, an upper bound the DP minimises (a warm start for CP-SAT).
    M, v = problem.micro_batches, problem.stages_per_rank
    weight = M - 1 if v == 1 else M * v + problem.ranks - 1
    if K * K * S <= _EXACT_FREE_SUM:
        free_sum, _, _ = dp.run(np.add, _INF)
    else:  # a lower bound on the least sum (transfers left out) only widens the scan below
        free_sum = float(sum(problem.fastest) + 2 * sum(problem.boundary_latency))
    base_sum, base_back, _ = dp.run(np.add, t_star)
    limit = t_star + (base_sum - free_sum) / weight
    best_obj, best_back = base_sum + weight * t_star, base_back
    if limit > t_star:
        _, _, seen = dp.run(np.add, limit, collect=(t_star, limit))
        candidates = np.unique(np.concatenate(seen))
        candidates = candidates[candidates > t_star]
        if len(candidates) > max_candidates:
            candidates = candidates[np.linspace(0, len(candidates) - 1, max_candidates).round().astype(int)]
        for T in candidates:
            total, back, _ = dp.run(np.add, T)
            if np.isfinite(total) and total + weight * T < best_obj:
                best_obj, best_back = total + weight * T, back
    return best_back


def split_dp(
    problem: Problem,
    order: Sequence[int],
    allowed: Sequence[int] | None = None,
    *,
    max_candidates: int = 8,
    prefix: Prefix | None = None,
) -> tuple[int, ...] | None:
    """Best contiguous split of ``order`` into S non-empty stages (node index → stage), or None.

    ``prefix``: :func:`prefix_sums` of ``order``, when the caller runs several DPs over it."""
    if problem.num_stages > len(order):
        return None
    dp = _StageDP(problem, order, _allowed_cuts(problem, order, allowed), prefix or prefix_sums(problem, order))
    found = _split(problem, order, dp, max_candidates)
    for _ in range(ROOM_REPAIRS if problem.stages_per_rank > 1 else 0):
        # The stages' rooms are a guess at how a rank's cap divides: where a rank's stages together hold
        # more, each of them gets that much less room, and the DP runs again.
        over = _over_rank_caps(problem, found) if found else None
        if over is None or not over.any():
            break
        dp.shrink(over)
        found = _split(problem, order, dp, max_candidates)
    return found


def _over_rank_caps(problem: Problem, stage_of: Sequence[int]) -> np.ndarray:
    """[rank] KiB its stages hold together over its cap under ``stage_of`` (0 where within)."""
    caps = np.zeros(problem.ranks)
    for s in range(problem.num_stages):
        caps[problem.rank(s)] = problem.capacity[s]
    return np.maximum(0.0, np.asarray(evaluate(problem, stage_of).rank_memory) - caps)


def _split(problem: Problem, order: Sequence[int], dp: _StageDP, max_candidates: int) -> tuple[int, ...] | None:
    if problem.micro_batches == 1 and problem.stages_per_rank == 1:  # no pipelining: only the sum counts
        free_sum, free_back, _ = dp.run(np.add, _INF)
        return dp.walk(free_back) if np.isfinite(free_sum) else None
    t_star = _least_bottleneck(problem, order, dp)
    if not np.isfinite(t_star):
        return None
    if problem.steady:  # only the slowest stage counts: the least sum under it breaks ties
        return dp.walk(dp.run(np.add, t_star)[1])
    return dp.walk(_best_under_caps(problem, dp, t_star, max_candidates))
