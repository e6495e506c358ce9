"""Which device takes which stage, when devices differ (speed, memory, or links).

With identical devices every order is the same. Otherwise the order is a decision: a
fast device should take the heavy stage, a stage boundary should not sit on the slow link
between two NVLink islands, a module pinned to device 3 that runs before one pinned to
device 1 needs device 3 earlier in the pipeline. The space is S! orders, so this is a local search, scored by
the dynamic program (exact over split points for each order):

0. devices alike but for their island, the islands listed one after the other in one size (a
   cluster's nodes): the given order, which crosses between islands the fewest times;
1. candidates: the given order; devices grouped by island; sorted by speed either way;
2. from the best, swap two devices of different kinds while a swap lowers the DP's
   predicted step time, up to a fixed number of evaluations (first improvement, fixed
   scan order, so the result is deterministic).

Usage::

    order = choose_order(table, micro_batches=16, schedule="gpipe")
    problem = build_problem(table, micro_batches=16, order=order)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Sequence

from autosplit.options import SolverLimits
from autosplit.solver.build import build_problem
from autosplit.solver.evaluation import evaluate
from autosplit.solver.pipeline.dp import topological_order
from autosplit.solver.pipeline.strategy import dp_plan
from autosplit.solver.problem import UserConstraint

__all__ = ["choose_order"]

log = logging.getLogger(__name__)


def _kinds(specs, constraints: Sequence[UserConstraint]) -> list[object]:
    """Devices are interchangeable when their specs match and every constraint treats them alike."""
    named = [{d for _, d in c.forbid} for c in constraints]
    return [
        (dataclasses.replace(spec, torch_device=None), tuple(d in devices for devices in named))
        for d, spec in enumerate(specs)
    ]


def _islands_in_order(specs, constraints: Sequence[UserConstraint]) -> bool:
    """Devices alike but for their island, in islands of one size listed one after the other (a
    cluster's nodes): the given order already crosses the slow links between islands the fewest
    times, at the same places as any order that does, so no swap can make it better."""
    alike = _kinds([dataclasses.replace(spec, island=None) for spec in specs], constraints)
    if any(k != alike[0] for k in alike):
        return False
    runs = [len(list(group)) for _, group in itertools.groupby(spec.island for spec in specs)]
    return len(runs) == len({spec.island for spec in specs}) and len(set(runs[:-1])) <= 1 and runs[-1] <= runs[0]


def choose_order(
    table,
    *,
    micro_batches: int,
    schedule: str,
    constraints: Sequence[UserConstraint] = (),
    max_evaluations: int = 64,
    limits: SolverLimits = SolverLimits(),
) -> tuple[int, ...]:
    """A device order for the pipeline's stages (stage s on device ``order[s]``), each scored by the
    DP under ``limits`` (when it coarsens: :class:`SolverLimits`).

    The search is bounded by a count of DP evaluations, not by time, so every rank of a
    distributed job reaches the same order.
    """
    specs = table.devices
    S = len(specs)
    identity = tuple(range(S))
    kinds = _kinds(specs, constraints)
    if all(k == kinds[0] for k in kinds) or _islands_in_order(specs, constraints):
        return identity
    start = time.perf_counter()
    topo = None
    evaluations = 0

    def score(order: tuple[int, ...]) -> float:
        nonlocal topo, evaluations
        evaluations += 1
        problem = build_problem(table, micro_batches=micro_batches, schedule=schedule, order=order, constraints=constraints)
        topo = topo or topological_order(problem)
        plan, _, _ = dp_plan(problem, topo, refine=False, limits=limits)
        return math.inf if plan is None else evaluate(problem, plan).objective

    islands = list(dict.fromkeys(s.island for s in specs))
    candidates = [
        identity,
        tuple(d for isl in islands for d in identity if specs[d].island == isl),
        tuple(sorted(identity, key=lambda d: specs[d].peak_flops)),
        tuple(sorted(identity, key=lambda d: -specs[d].peak_flops)),
    ]
    scored = {c: score(c) for c in dict.fromkeys(candidates)}
    best = min(scored, key=lambda c: (scored[c], candidates.index(c)))
    best_score = scored[best]
    improved = True
    while improved and evaluations < max_evaluations:
        improved = False
        for i in range(S):
            for j in range(i + 1, S):
                if kinds[best[i]] == kinds[best[j]] or evaluations >= max_evaluations:
                    continue
                swapped = list(best)
                swapped[i], swapped[j] = swapped[j], swapped[i]
                value = score(tuple(swapped))
                if value < best_score:
                    best, best_score, improved = tuple(swapped), value, True
    log.info("device order %s (predicted %s) in %.2fs", best, best_score, time.perf_counter() - start)
    return best
