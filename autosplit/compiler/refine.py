"""Step *refine*: the solver's split, its cuts moved while the replayed step improves.

The solver minimises a closed form of the schedule (:meth:`~autosplit.solver.problem.Problem.objective_of`),
exact for GPipe and for equal stages; torch's interleaved and zero-bubble schedules, run as their
action lists say, reward other cuts (a rank's two stages need not be equal when one of them waits
anyway). The replay is the judge. Candidates, in a topological order in which a split is contiguous:
the solver's split, and it with each cut at the nearest layer boundary; the split of equal compute
per stage at *cheap cuts* (layer boundaries, where little crosses); where a rank runs several stages,
the split at layer boundaries that evens the *ranks'* work, its extra layers then moved where the replay
prefers them (Megatron's hand layouts do both); and, when there are few cheap
cuts, every split at them, and when there are few repeated layers, every split between them
(torchtitan's cuts). From each, a descent moves
one cut, or one stage, to the next cheap cut or by ``±width`` nodes while the replayed step drops and
no rule breaks (memory, colocation, data flowing forward), the width halving down to one node, within
a budget of replays. The result is never slower, by the replay, than the split given, except
that the fastest split at layer boundaries (enumerated when few, else descended to along them, or met on the way) is
kept over a faster one that cuts inside a layer unless that one gains more than
:attr:`~autosplit.options.PlanOptions.cut_margin`: the fastest of hundreds of splits is predicted
further ahead than it is, and torchtitan's layouts, which users compare with, cut at layers.
Splits the replay ties go to the one whose slowest stage computes least.

Usage::

    stage_of = refine(problem, table, solution.stage_of, order, options)
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from autosplit.costtable import CostTable
from autosplit.options import PlanOptions
from autosplit.solver.pipeline.dp import topological_order
from autosplit.solver.problem import Problem
from autosplit.solver.validate import violations

__all__ = ["refine", "REPLAYS", "TIE"]

log = logging.getLogger(__name__)

REPLAYS = 400
"""Most replays one refinement spends (each costs about the schedule's action count)."""
TIE = 1e-6
"""Weight of the slowest stage's share of the compute beside the replayed step: it orders only splits
whose steps agree within about a millionth."""


def refine(
    problem: Problem, table: CostTable, stage_of: Sequence[int], order: Sequence[int], options: PlanOptions, *,
    replays: int = REPLAYS,
) -> tuple[int, ...]:
    """The fastest, by the replay, of ``stage_of``, the split of equal compute per stage and (when
    they are few) every split at cheap cuts — the layer boundaries — each with its cuts then moved
    while the replayed step improves (a split not contiguous in the problem's topological order is
    not moved); the fastest split at layer boundaries instead, when the best is inside
    ``options.cut_margin`` of it."""
    from autosplit.compiler.prediction import predict_step  # prediction imports nothing from here

    topo = topological_order(problem)
    N, S = len(topo), problem.num_stages

    def split(cuts: Sequence[int]) -> tuple[int, ...]:
        out = [0] * N
        for s, (a, b) in enumerate(itertools.pairwise([0, *cuts, N])):
            for p in range(a, b):
                out[topo[p]] = s
        return tuple(out)

    seen: dict[tuple[int, ...], float] = {}  # every split replayed (the layer-aligned ones are asked for twice)

    def step(plan: tuple[int, ...]) -> float:
        """The replayed step, × (1 + :data:`TIE` × the slowest stage's share of the compute): splits
        the replay cannot tell apart (a V's rank holds the same layers in two stages either way) go
        to the evener."""
        if plan not in seen:
            load = np.bincount(plan, weights=problem.fastest, minlength=S)
            seen[plan] = math.inf if violations(problem, plan) else (
                predict_step(problem, table, plan, order, options)[0].total * (1 + TIE * max(load) / max(1, sum(load))))
        return seen[plan]

    def cuts_of(plan: Sequence[int]) -> list[int] | None:
        """Where ``plan``'s stages change along ``topo``; None when its stages are not contiguous there."""
        along = [plan[n] for n in topo]
        return None if any(b < a for a, b in itertools.pairwise(along)) else [
            p for p in range(1, N) if along[p] != along[p - 1]]

    cheap = _cheap_cuts(problem, topo)
    layers = _layer_cuts(table.module_paths, topo)
    work = list(itertools.accumulate(problem.fastest[n] for n in topo))
    seeds = _seeds(problem, cuts_of(stage_of), cheap, layers, work, split, step, replays)
    best_plan, best = tuple(stage_of), step(tuple(stage_of))
    # Few cheap cuts, or few boundaries between repeated layers: every split at them is replayed.
    for cuts in (cheap, layers):
        if math.comb(len(cuts), S - 1) > replays // 2:
            continue
        for chosen in itertools.combinations(cuts, S - 1):
            plan = split(chosen)
            cost = step(plan)
            if cost < best * (1 - 1e-9):
                best_plan, best = plan, cost
        if (found := cuts_of(best_plan)) is not None:
            seeds.append(found)
    for cuts in seeds:
        plan, cost = _descend(cuts, cheap, split, step, N, max(1, replays // len(seeds)))
        if cost < best * (1 - 1e-9):
            best_plan, best = plan, cost
    found = cuts_of(best_plan)
    if found is None or set(found) <= set(layers) or len(layers) < S - 1:
        return best_plan
    _fastest_at(layers, S, split, step, work, replays)  # what it replays lands in ``seen``, beside what the seeds met
    aligned, aligned_plan = min(((cost, plan) for plan, cost in seen.items() if set(cuts_of(plan) or [-1]) <= set(layers)),
                                default=(math.inf, best_plan))
    if aligned < math.inf and aligned <= best * (1 + options.cut_margin):
        if aligned > best:
            log.info("refine: kept the fastest split at layer boundaries (%.4g s by the replay) over one %.2f %% faster "
                     "(%.4g s) that cuts inside a layer, within cut_margin = %g", aligned, 100 * (aligned / best - 1), best,
                     options.cut_margin)
        return aligned_plan
    return best_plan


def _seeds(
    problem: Problem, given: list[int] | None, cheap: Sequence[int], layers: Sequence[int], work: Sequence[float],
    split: Callable[[Sequence[int]], tuple[int, ...]], step: Callable[[tuple[int, ...]], float], replays: int,
) -> list[list[int]]:
    """The splits a descent starts from: ``given`` (the solver's cuts, when contiguous), equal work per
    stage at the cheap cuts, the ranks' work evened at the layer boundaries where a rank runs several
    stages, and the solver's cuts moved to the nearest layer boundaries."""
    S = problem.num_stages
    seeds = [] if given is None else [given]
    even = _even(cheap, work, S)
    if len(even) == S - 1:
        seeds.append(even)
    if any(problem.rank(s) != s for s in range(S)):  # a rank runs several stages: even the ranks, not the stages
        balanced = _rank_balanced(layers, work, S, problem.rank)[: replays // 8]
        if balanced:
            seeds.append(_relocate(min(balanced, key=lambda cuts: step(split(cuts))), layers, split, step, replays // 4))
    snapped = sorted({_nearest(layers, p) for p in given or ()})
    if len(snapped) == S - 1 and snapped != given:
        seeds.append(snapped)
    return seeds


def _fastest_at(
    cuts: Sequence[int], S: int, split: Callable[[Sequence[int]], tuple[int, ...]],
    step: Callable[[tuple[int, ...]], float], work: Sequence[float], replays: int,
) -> tuple[tuple[int, ...], float]:
    """The fastest split with every cut at one of ``cuts``: all of them replayed when few, else
    descended to along ``cuts`` from the split of equal work (``work``: cumulative, in cut order)."""
    if math.comb(len(cuts), S - 1) <= replays // 2:
        return min(((p, step(p)) for p in map(split, itertools.combinations(cuts, S - 1))), key=lambda pc: pc[1])
    even = _even(cuts, work, S)
    if len(even) < S - 1:
        return split(even), math.inf
    return _descend(even, cuts, split, step, len(work), replays // 4, shifts=False)


def _even(cuts: Sequence[int], work: Sequence[float], S: int) -> list[int]:
    """The split of equal compute per stage (``work``: cumulative along the order), each cut moved to
    the nearest of ``cuts``; fewer than ``S − 1`` cuts where two land on one."""
    return sorted({_nearest(cuts, bisect.bisect_left(work, work[-1] * s / S)) for s in range(1, S)})


def _rank_balanced(cuts: Sequence[int], work: Sequence[float], S: int, rank: Callable[[int], int]) -> list[list[int]]:
    """A split at ``cuts`` (the layer boundaries) that evens the ranks' work where each rank runs several
    stages: from the split of equal work per stage, one piece between cuts (a layer) at a time moves
    off a stage of the busiest rank onto a stage of another rank, the stages between keeping theirs,
    while that lowers the busiest rank's work (then the busiest stage's, then the ranks' sum of squares). Rounding to whole layers
    leaves some rank a layer more; Megatron's own layouts put it on a rank without the head (Llama-3-70B
    on PP 8 × VP 5: two layers per stage, the last one layer and the head, one stage three). Returned with
    the splits the last move ties with: the loads cannot tell where in the schedule the extra layer
    sits, the replay can."""
    if len(cuts) < S - 1:
        return []
    edges = [0, *cuts, len(work)]
    piece = [work[b - 1] - (work[a - 1] if a else 0.0) for a, b in itertools.pairwise(edges)]
    even = _even(cuts, work, S)
    if len(even) != S - 1:
        return []
    counts = _counts(even, cuts)

    def loads(counts: Sequence[int]) -> tuple[float, float, float, int]:
        """(the busiest rank's work, the busiest stage's, the ranks' sum of squares, the busiest rank)"""
        at = list(itertools.accumulate(counts, initial=0))
        stage = [sum(piece[a:b]) for a, b in itertools.pairwise(at)]
        ranks: dict[int, float] = {}
        for s, w in enumerate(stage):
            ranks[rank(s)] = ranks.get(rank(s), 0.0) + w
        busiest = max(ranks, key=ranks.__getitem__)
        return ranks[busiest], max(stage), sum(w * w for w in ranks.values()), busiest

    best, ties = loads(counts), [counts]
    while True:
        trials = [(loads(moved)[:3], moved) for a in range(S) if rank(a) == best[3] and counts[a] > 1
                  for b in range(S) if rank(b) != best[3]
                  for moved in [[c - (s == a) + (s == b) for s, c in enumerate(counts)]]]
        score = min((t[0] for t in trials), default=best[:3])
        if score >= best[:3]:
            return [_at(c, cuts) for c in ties]
        ties = [moved for t, moved in trials if t == score]
        best, counts = loads(ties[0]), ties[0]


def _relocate(
    start: Sequence[int], cuts: Sequence[int], split: Callable[[Sequence[int]], tuple[int, ...]],
    step: Callable[[tuple[int, ...]], float], replays: int,
) -> list[int]:
    """From ``start`` (a split at ``cuts``), move a piece between cuts off a stage that holds more than most
    stages do onto any other stage, the stages between keeping theirs, while the replayed step drops:
    where an extra layer sits in the schedule matters even when the ranks' work does not change. At most
    ``replays`` steps evaluated."""
    counts = _counts(start, cuts)
    best, spent, moved = step(split(start)), 1, True
    while moved and spent < replays:
        moved = False
        usual = max(set(counts), key=counts.count)
        for a, b in itertools.product(range(len(counts)), repeat=2):
            if a == b or counts[a] <= usual or spent >= replays:
                continue
            trial = [c - (s == a) + (s == b) for s, c in enumerate(counts)]
            cost, spent = step(split(_at(trial, cuts))), spent + 1
            if cost < best * (1 - 1e-9):
                best, counts, moved = cost, trial, True
                break
    return _at(counts, cuts)


def _counts(chosen: Sequence[int], cuts: Sequence[int]) -> list[int]:
    """How many of the pieces between ``cuts`` each stage of the split at ``chosen`` (some of ``cuts``) holds."""
    before = {c: i + 1 for i, c in enumerate(cuts)}  # a cut → the pieces before it
    return [b - a for a, b in itertools.pairwise([0, *(before[c] for c in chosen), len(cuts) + 1])]


def _at(counts: Sequence[int], cuts: Sequence[int]) -> list[int]:
    """The split whose stages hold ``counts`` pieces between ``cuts`` each: :func:`_counts` undone."""
    return [cuts[i - 1] for i in itertools.accumulate(counts[:-1])]


def _cheap_cuts(problem: Problem, topo: Sequence[int]) -> list[int]:
    """Positions of ``topo`` where a cut sends little: at most 1.5 × what the cheapest fifth of cuts
    send (between two layers, where one tensor crosses, rather than inside one)."""
    N = len(topo)
    pos = {n: i for i, n in enumerate(topo)}
    last = list(range(N))
    for u, v in problem.edges:
        last[pos[u]] = max(last[pos[u]], pos[v])
    # The dearest boundary's, not the cheapest's: a V schedule's middle boundary joins two stages
    # of one rank and sends nothing, which would make every cut look cheap.
    sends = [max(row, default=0) for row in problem.transfer]
    change = [0] * (N + 1)
    for i, n in enumerate(topo):  # node i's output crosses cuts i + 1 … last[i]
        change[i + 1] += sends[n]
        change[last[i] + 1] -= sends[n]
    crossing = list(itertools.accumulate(change))
    inner = sorted(c for c in crossing[1:N] if c > 0)
    low = inner[len(inner) // 5] if inner else 0  # the 20th percentile: a layer boundary, not the ends' few bytes
    return [p for p in range(1, N) if crossing[p] <= 1.5 * low]


def _layer_cuts(module_paths: Sequence[str], topo: Sequence[int]) -> list[int]:
    """Positions of ``topo`` where the repeated layer changes (:func:`~autosplit.compiler.prediction.numbered_layer`),
    torchtitan's cuts: a node of a module outside every layer (``lm_head``) leaves the layers, and
    one of no module changes nothing."""
    from autosplit.compiler.prediction import numbered_layer

    cuts, current = [], ""
    for p, n in enumerate(topo):
        if not module_paths[n]:
            continue
        here = numbered_layer(module_paths[n]) or ""
        if here != current:
            if p > 0:
                cuts.append(p)
            current = here
    return cuts


def _nearest(cheap: Sequence[int], p: int) -> int:
    i = bisect.bisect_left(cheap, p)
    return min(cheap[max(0, i - 1): i + 1], key=lambda q: abs(q - p), default=p)


def _moved(cuts: Sequence[int], k: int, span: int, how: str, delta: int, cheap: Sequence[int]) -> list[int]:
    """Cuts ``k … k + span − 1`` shifted by ``delta`` nodes (``how="shift"``), or each to the next
    cheap cut in ``delta``'s direction (``how="jump"``)."""
    trial = list(cuts)
    for j in range(k, min(k + span, len(cuts))):
        if how == "shift":
            trial[j] += delta
        elif delta > 0:
            i = bisect.bisect_right(cheap, trial[j])
            trial[j] = cheap[i] if i < len(cheap) else trial[j]
        else:
            i = bisect.bisect_left(cheap, trial[j])
            trial[j] = cheap[i - 1] if i > 0 else trial[j]
    return trial


def _descend(
    cuts: list[int], cheap: Sequence[int], split: Callable[[Sequence[int]], tuple[int, ...]],
    step: Callable[[tuple[int, ...]], float], N: int, replays: int, *, shifts: bool = True,
) -> tuple[tuple[int, ...], float]:
    """Move one cut, or a stage (two cuts together), to the next cheap cut either way or (with
    ``shifts``) by ``±width`` nodes while the step improves; halve the width when nothing helps,
    down to one node; at most ``replays`` steps evaluated."""
    plan = split(cuts)
    best, spent = step(plan), 1
    width = max(1, N // (4 * (len(cuts) + 1))) if shifts else 1
    while width >= 1 and spent < replays:
        moved = False
        tries = [("jump", -1), ("jump", 1)] + ([("shift", -width), ("shift", width)] if shifts else [])
        for k, span, (how, delta) in itertools.product(range(len(cuts)), (1, 2), tries):
            trial = _moved(cuts, k, span, how, delta, cheap)
            if trial == cuts or any(b <= a for a, b in itertools.pairwise([0, *trial, N])):
                continue
            candidate = split(trial)
            cost, spent = step(candidate), spent + 1
            if cost < best * (1 - 1e-9):
                best, plan, cuts, moved = cost, candidate, trial, True
            if spent >= replays:
                break
        if not moved:
            width //= 2
    return plan, best
