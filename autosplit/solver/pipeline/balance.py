"""Balance the ranks of a split whose ranks run several stages (interleaved, looped and V schedules).

The split DP (:mod:`~autosplit.solver.pipeline.dp`) sees one stage at a time, so for several stages per rank
it minimises an upper bound of the objective, ``Σ t + (M·v + pp − 1)·max t``: it balances the stages, not
the ranks. Of its splits with equal slowest stages, the one it returns may pile the heavier stages (an
odd layer more, the embedding, the output layer) on one rank, where the objective
(:meth:`~autosplit.solver.problem.Problem.objective_of`: ``M · max_r Σ_{s on r} t_s + (pp − 1)·max t``)
pays the fullest rank's work every micro-batch. :func:`balance_ranks` moves one cut at a time to any
allowed position between its neighbours, taking the move that lowers the objective most — or, where none
does, the ranks' work from the fullest down (a tie between two full ranks is undone one rank at a time) —
among those that keep every rule, memory included. A move changes two stages' times only, so every move
of every cut is scored at once from the DP's prefix sums.

Usage::

    stage_of = balance_ranks(problem, order, stage_of)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from autosplit.solver.evaluation import evaluate
from autosplit.solver.pipeline.dp import forbidden_cuts, prefix_sums
from autosplit.solver.problem import Problem
from autosplit.solver.validate import violations

__all__ = ["balance_ranks"]

log = logging.getLogger(__name__)

MOST_MOVES = 200
"""Moves :func:`balance_ranks` makes at most (each lowers its key, so it stops anyway)."""
TRIES = 16
"""Moves a round checks against the rules, best first, before it stops."""


def balance_ranks(
    problem: Problem, order: Sequence[int], stage_of: Sequence[int], allowed: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """``stage_of`` (a contiguous split of ``order``) with its cuts moved, one at a time to a position of
    ``allowed`` (default: every position), while its objective or the ranks' work drops; unchanged with
    one stage per rank or without flushes (the objective then sees stages only)."""
    if problem.stages_per_rank == 1 or problem.steady:
        return tuple(stage_of)
    N, S = len(order), problem.num_stages
    bad = forbidden_cuts(problem, order)  # a cut there would part colocated nodes
    positions = np.asarray([p for p in (range(1, N) if allowed is None else sorted(set(allowed))) if 0 < p < N and not bad[p]],
                           dtype=np.int64)
    pre = prefix_sums(problem, order)
    ranks = np.asarray([problem.rank(s) for s in range(S)])
    bounds = np.asarray([0, *(p for p in range(1, N) if stage_of[order[p]] != stage_of[order[p - 1]]), N])
    if len(bounds) != S + 1 or any(stage_of[order[p]] != s for s in range(S) for p in (bounds[s], bounds[s + 1] - 1)):
        return tuple(stage_of)  # not S contiguous stages in stage order along ``order``: no cuts to move
    best, key = tuple(stage_of), _key(problem, stage_of)
    first = key
    for _ in range(MOST_MOVES):
        found = None
        for objective, work, cut, p in _moves(problem, pre, ranks, bounds, positions):
            if (objective, work) >= key:
                break
            moved = bounds.copy()
            moved[cut] = p
            candidate = _split(order, moved)
            if not violations(problem, candidate):
                found = (_key(problem, candidate), moved, candidate)
                break
        if found is None or found[0] >= key:
            break
        key, bounds, best = found
    if key != first:
        log.info("balanced the ranks: objective (M steps) %d → %d ns, the fullest ranks' work %s → %s",
                 first[0], key[0], first[1][:3], key[1][:3])
    return best


def _key(problem: Problem, stage_of: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    ev = evaluate(problem, stage_of)
    return ev.objective, tuple(sorted(ev.rank_time, reverse=True))


def _times(pre, bounds: np.ndarray) -> np.ndarray:
    """[..., s] each stage's time for stages between ``bounds[..., s]`` and ``bounds[..., s + 1]``, as the DP
    costs a segment: its compute and the transfers at its two boundaries."""
    S = bounds.shape[-1] - 1
    s = np.arange(S)
    t = pre.C[bounds[..., 1:], s] - pre.C[bounds[..., :-1], s]
    t[..., 1:] += pre.X[bounds[..., 1:-1], s[:-1]]
    t[..., :-1] += pre.X[bounds[..., 1:-1], s[:-1]]
    return t


def _moves(problem: Problem, pre, ranks: np.ndarray, bounds: np.ndarray, positions: np.ndarray) -> list:
    """Every move of one cut (``bounds[1:-1]``) to a position strictly between its neighbours, as
    (objective, ranks' work from the fullest, which bound, where), best first."""
    cut = np.arange(1, len(bounds) - 1)
    lo, hi = bounds[cut - 1], bounds[cut + 1]
    start, stop = np.searchsorted(positions, lo, side="right"), np.searchsorted(positions, hi, side="left")
    which = np.repeat(cut, stop - start)
    where = np.concatenate([positions[a:b] for a, b in zip(start, stop)]) if len(cut) else np.zeros(0, dtype=np.int64)
    keep = where != bounds[which]
    which, where = which[keep], where[keep]
    if not len(which):
        return []
    moved = np.repeat(bounds[None, :], len(which), axis=0)
    moved[np.arange(len(which)), which] = where
    t = np.rint(_times(pre, moved)).astype(np.int64)
    work = np.zeros((len(which), ranks.max() + 1), dtype=np.int64)
    np.add.at(work.T, ranks, t.T)
    work = -np.sort(-work, axis=1)
    objective = problem.micro_batches * work[:, 0] + (problem.ranks - 1) * t.max(axis=1)
    rows = np.lexsort((*work.T[::-1], objective))
    return [(int(objective[i]), tuple(work[i].tolist()), int(which[i]), int(where[i])) for i in rows[:TRIES]]


def _split(order: Sequence[int], bounds: np.ndarray) -> tuple[int, ...]:
    """Node → stage for ``order`` cut at ``bounds`` (0, where each stage after the first starts, N)."""
    stage = np.searchsorted(bounds[1:-1], np.arange(len(order)), side="right")
    out = np.empty(len(order), dtype=np.int64)
    out[np.asarray(order)] = stage
    return tuple(out.tolist())
