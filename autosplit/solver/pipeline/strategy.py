"""The planning strategy: exact DP, coarsening when the graph is large, CP-SAT, a proven bound.

1. Order the nodes topologically (:func:`~autosplit.solver.pipeline.dp.topological_order`).
2. *Dynamic program* over split points of that order — every position for small graphs
   (:attr:`SolverLimits.dp_work`); otherwise the block boundaries of :func:`coarsen`, then, round by
   round, every position near the chosen cuts (*refinement*). It is exact over the cuts it
   may use, runs in seconds, and is the baseline the report shows.
   With blocks to recompute, a third: :func:`~autosplit.solver.pipeline.layers.layer_split`, at layer
   boundaries, each stage's recomputation costed (identical layers: fewer where more micro-batches
   are in flight).
3. The bound: the analytic and chain bounds of :mod:`~autosplit.solver.pipeline.bounds` (and, with
   blocks to recompute, :func:`~autosplit.solver.pipeline.recompute_bound.recompute_bound`). When
   it certifies the DP's plan within ``gap`` (:attr:`~autosplit.options.PlanOptions.gap`: the
   planner's 1%; the solver's own default :data:`PROVEN_GAP`, 0.1%), that plan is the answer
   and no CP-SAT search runs.
4. Otherwise *CP-SAT* (:mod:`~autosplit.solver.pipeline.cpsat`) on the nodes, or on the blocks
   when the node model would be too large, with the DP's plan as a hint, until it certifies a
   plan within ``gap`` or the time is up. CP-SAT may leave the DP's order (parallel branches
   can move across stages), so it can only improve on it; the better plan, judged by
   :func:`evaluate` on the nodes, is returned, with the best of the bounds (CP-SAT's counts
   when it ran on the nodes).

``time_limit`` bounds every path: CP-SAT gets what the DP and the bound left of it (a quarter of it
on blocks), and none when they used it all (the fallback split of a problem with blocks to recompute
counts the time the searches before it spent). Where no split is found and CP-SAT cannot explain why,
the memory floors (:mod:`~autosplit.solver.pipeline.memory`) prove it when they can.

Deterministic: the same problem, seed and limits (``time_limit`` and :class:`SolverLimits`) give
the same plan (CP-SAT runs its workers interleaved under a deterministic time limit), so every
rank of a distributed job can plan on its own and agree.

Usage::

    solution = solve(problem, time_limit=10, seed=0)
    solution = solve(problem, limits=SolverLimits(dp_work=1))  # coarsen even a small graph
    solution = solve(problem, gap=0.01)                          # settle for a plan proven within 1%
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from autosplit.errors import InfeasiblePlanError, SolverError, advice
from autosplit.options import SolverLimits
from autosplit.solver.coarsen import Coarsening, coarse_problem, coarsen, repeated_layers
from autosplit.solver.evaluation import evaluate
from autosplit.solver.pipeline.balance import balance_ranks
from autosplit.solver.pipeline.bounds import lower_bound
from autosplit.solver.pipeline.cpsat import PROVEN_GAP, cpsat, explain_infeasible, precheck
from autosplit.solver.pipeline.dp import Prefix, prefix_sums, split_dp, topological_order
from autosplit.solver.pipeline.layers import layer_split
from autosplit.solver.pipeline.memory import memory_floor, memory_floors
from autosplit.solver.pipeline.recompute_bound import recompute_bound
from autosplit.solver.problem import KIB, Problem
from autosplit.solver.validate import violations
from autosplit.units import format_bytes

__all__ = ["Solution", "prove_over_caps", "solve"]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Solution:
    stage_of: tuple[int, ...]
    status: str
    """``OPTIMAL`` (the objective meets the proven bound) or ``FEASIBLE`` (within :attr:`gap` of it)."""
    objective: int
    bound: int
    wall_time: float
    solver: str = "cp-sat"
    """Which method produced the plan: ``"cp-sat"`` or ``"dp"``."""
    baseline: int | None = None
    """Objective of the dynamic program's plan (None when it found none)."""
    units: int = 0
    """How many units the solver placed: nodes, or blocks after coarsening."""
    recompute: tuple[int, ...] = ()
    """The blocks (indices into :attr:`Problem.recompute`) the plan recomputes."""
    partial: tuple[tuple[int, int, int], ...] = ()
    """(block, its stage, micro-batches it keeps there) for the blocks of :attr:`recompute` that keep
    some (:meth:`Problem.fixed`'s ``partial``)."""

    @property
    def gap(self) -> float:
        return 0.0 if self.objective <= 0 else max(0.0, (self.objective - self.bound) / self.objective)


_Choice = tuple[tuple[int, ...], dict[int, tuple[int, int]]]
"""Blocks a plan recomputes, and block → (its stage, micro-batches it keeps there) for those that keep some."""


def _one_order(problem: Problem) -> bool:
    """Whether the units' index order is their only topological order (each depends on the one
    before): then every plan is a contiguous split of it, which the DP searches exactly. Units
    with no edges that cost nothing (``_assert_is_none``) may sit anywhere at no cost: skipped."""
    links = (*problem.edges, *problem.order_edges)
    touched = {n for edge in links for n in edge}
    free = {
        n for n in range(len(problem.nodes))
        if n not in touched and not any(problem.compute[n]) and not problem.state_mem[n] and not any(problem.act_mem[n])
    }
    chain = [n for n in range(len(problem.nodes)) if n not in free]
    linked = set(links)
    return all((u, v) in linked for u, v in itertools.pairwise(chain))


def _cuts(order: Sequence[int], stage_of: Sequence[int]) -> list[int]:
    return [p for p in range(1, len(order)) if stage_of[order[p]] != stage_of[order[p - 1]]]


def _refine(problem: Problem, c: Coarsening, plan: tuple[int, ...], prefix: Prefix, max_rounds: int = 8) -> tuple[int, ...]:
    """Move each cut to its best position within a window of nodes around it, until nothing improves.

    The window spans two average blocks either side, so the DP stays small (S windows,
    not all N positions) while a cut can travel any distance over several rounds; when a
    round finds nothing better, the window doubles once before giving up.
    """
    N = len(c.order)
    width = 2 * max(1, N // c.num_blocks)
    widest = 2 * width
    best, best_obj = plan, evaluate(problem, plan).objective
    for _ in range(max_rounds):
        allowed = sorted({q for p in _cuts(c.order, best) for q in range(max(0, p - width), min(N, p + width) + 1)})
        found = split_dp(problem, c.order, allowed, prefix=prefix)
        found_obj = evaluate(problem, found).objective if found is not None else None
        if found is not None and found_obj is not None and found_obj < best_obj:
            best, best_obj = found, found_obj
        elif width < widest:  # stuck: the cuts may need to travel together further than the window
            width *= 2
        else:
            break
    return best


def dp_plan(
    problem: Problem, order: Sequence[int], *, refine: bool = True, limits: SolverLimits = SolverLimits()
) -> tuple[tuple[int, ...] | None, Coarsening | None, tuple[int, ...] | None]:
    """The dynamic program's plan: (plan, coarsening used or None, plan before refinement)."""
    N, S = len(problem.nodes), problem.num_stages
    if N * N <= limits.dp_work:
        plan = split_dp(problem, order)
        return (balance_ranks(problem, order, plan) if plan else plan), None, None
    total = float(problem.arrays.compute.sum()) / S
    coarse = coarsen(problem, order, max_cost=total / min(limits.blocks_per_stage * S, limits.max_blocks))
    if log.isEnabledFor(logging.INFO):  # the repeated-layer scan only feeds this line
        repeated = repeated_layers(problem, order)
        log.info("coarsened %d nodes into %d blocks; repeated layers: %s", N, coarse.num_blocks,
                 ", ".join(f"{g[0]} … {g[-1]} ({len(g)})" for g in repeated[:3]) or "none")
    prefix = prefix_sums(problem, order)
    block_dp = split_dp(problem, order, coarse.bounds, prefix=prefix)
    plan = _refine(problem, coarse, block_dp, prefix) if block_dp and refine else block_dp
    return (balance_ranks(problem, order, plan, coarse.bounds) if plan else plan), coarse, block_dp


def solve(
    problem: Problem, *, time_limit: float = 10.0, seed: int = 0, workers: int | None = None, limits: SolverLimits = SolverLimits(),
    gap: float = PROVEN_GAP,
) -> Solution:
    """Best assignment found within ``time_limit`` seconds, with its proven bound; ``limits``: when to
    coarsen, skip CP-SAT or narrow the bound (:class:`SolverLimits`); ``gap``: the certified gap to
    settle for — a plan proven within this fraction of optimal ends the search (none starts when the
    DP's plan is).

    With blocks to recompute (:attr:`Problem.recompute`), the DP splits the model recomputing the
    fewest and the most blocks allowed, then CP-SAT chooses split and blocks together from the better
    of the two, and for each block on a stage that holds several micro-batches at once
    (:attr:`~autosplit.solver.problem.Recompute.in_flight`) how many of them keep their activations; each DP plan's ranks keep
    the blocks, and the micro-batches, their memory holds after all. The bound is the time bound
    with the fewest (recomputing only adds time) or CP-SAT's on the nodes, and the plan the best
    found, judged on the nodes."""
    if not problem.recompute:
        return _split(problem, time_limit=time_limit, seed=seed, workers=workers, limits=limits, gap=gap)
    start = time.perf_counter()
    must, may = problem.forced
    # Before any search: no plan holds less than every block it may recompute recomputed, with no
    # more colocated and no more reserved than the problem itself.
    fewest, most = problem.fixed(must), problem.fixed(may)
    _refuse_over_caps(problem, memory_floor(_least(problem)))
    found, units, slowest = _dp_candidates(problem, fewest, most, limits)
    value = {name: evaluate(problem.fixed(*chosen), plan).objective for name, (chosen, plan) in found.items()}
    baseline = value.get("dp")
    best = min(value.values(), default=None)
    bound = lower_bound(fewest, upper=slowest, limits=limits)
    if best is not None:  # what the caps force every plan to recompute, bounded along the chain
        name = min(found, key=value.__getitem__)
        known = max(evaluate(problem.fixed(*found[name][0]), found[name][1]).time)
        bound = max(bound, recompute_bound(problem, fewest, upper=known, limits=limits))
    remaining = time_limit - (time.perf_counter() - start)
    certified = best is not None and best - bound <= gap * best
    if certified:
        log.info("the DP's plan is within %.2f%% of the bound: no CP-SAT search", 100 * gap)
    elif len(may) > len(must) and remaining > 0 and problem.num_stages > 1:
        hint = min(found, key=value.__getitem__) if found else None
        joint = _joint(problem, found[hint][1] if hint else None, found[hint][0][0] if hint else must,
                       time_limit=remaining, seed=seed, workers=workers, limits=limits, gap=gap)
        if joint is not None:
            plan, blocks, kept, joint_bound = joint
            if plan is not None and not violations(problem.fixed(blocks, kept), plan):
                # CP-SAT's own choice, or each rank keeping what fits after all (CP-SAT stopped by its time limit)
                split = plan
                ways = [(blocks, kept), _keep_what_fits(problem, split, blocks)]
                found["cp-sat"] = (min(ways, key=lambda way: evaluate(problem.fixed(*way), split).objective), split)
                value["cp-sat"] = evaluate(problem.fixed(*found["cp-sat"][0]), plan).objective
            bound = max(bound, joint_bound)
    if not found:  # recomputing every block allowed, as a plain split: its plan, or its own error saying why none fits
        alone = _split(most, time_limit=time_limit, seed=seed, workers=workers, limits=limits, gap=gap, started=start)
        found[alone.solver] = ((may, {}), alone.stage_of)
        value[alone.solver] = alone.objective
    name = min(found, key=lambda k: (value[k], k))
    (chosen, partial), plan = found[name]
    objective = value[name]
    bound = min(bound, objective)
    return Solution(plan, "OPTIMAL" if bound == objective else "FEASIBLE", objective, bound, time.perf_counter() - start,
                    name, baseline, units, tuple(chosen), tuple((u, s, k) for u, (s, k) in sorted(partial.items())))


def _dp_candidates(
    problem: Problem, fewest: Problem, most: Problem, limits: SolverLimits
) -> tuple[dict[str, tuple[_Choice, tuple[int, ...]]], int, float]:
    """The dynamic programs' plans that fit, by method → ((blocks, partial), plan): the split recomputing
    the fewest blocks, the most (each rank then keeping what fits), and :func:`layer_split`'s at layer
    boundaries with each stage's recomputation costed; the units the first two placed; and the slowest
    stage of any split found, recomputing the fewest, memory aside (it narrows the time bound's DP)."""
    must, may = problem.forced
    found: dict[str, tuple[_Choice, tuple[int, ...]]] = {}
    units, slowest = len(problem.nodes), math.inf
    runs = {"dp": (must, fewest), **({"dp (recompute)": (may, most)} if may != must else {})}
    for name, (chosen, fixed) in runs.items():
        if chosen != may and memory_floor(fixed) > max(problem.capacity):
            continue  # no plan recomputing so few fits (Llama-3-70B: its DP alone takes seconds)
        plan, coarse, _ = dp_plan(fixed, topological_order(fixed), limits=limits)
        units = units if coarse is None else coarse.num_blocks
        if plan is not None:
            slowest = min(slowest, max(evaluate(fewest, plan).time))
        if plan is not None and not violations(fixed, plan):
            found.setdefault(name, (_keep_what_fits(problem, plan, chosen), plan))
    layered = layer_split(problem, topological_order(problem)) if may != must else None
    if layered is not None and not violations(most, layered):
        choice = _keep_what_fits(problem, layered, may)
        if not violations(problem.fixed(*choice), layered):
            found["dp (layers)"] = (choice, layered)
    return found, units, slowest


def prove_over_caps(problem: Problem, *, cheap: bool = False) -> None:
    """Raise :class:`InfeasiblePlanError` where the memory floors prove that no split of ``problem``
    fits its caps, recomputing every block it may (no plan holds less: :func:`_least`), as :func:`solve`
    proves it; return where they do not. ``cheap``: only the checks that cost nothing (more ranks than
    units to place, a unit over every cap)."""
    least = _least(problem)
    precheck(least)
    if least.num_stages == 1:  # one stage holds everything: the only split, its memory exact (the floors bound no more)
        need, cap = evaluate(least, [0] * len(least.nodes)).memory[0], least.capacity[0]
        if need > cap:
            raise InfeasiblePlanError(advice(
                f"no plan fits the memory caps: its one stage needs {format_bytes(need * KIB)}, every block the options allow "
                f"recomputed, but its device holds {format_bytes(cap * KIB)} (proven: one stage has one split)",
                "model state and activations exceed the cap", "more pipeline stages or tp, replicate='fully_shard', or a smaller batch",
            ))
    elif not cheap:
        _refuse_over_caps(least, *memory_floors(least))



def _least(problem: Problem) -> Problem:
    """``problem`` holding the least memory any of its plans can: every block it may recompute
    recomputed, with no more colocated and no more reserved than the problem itself."""
    if not problem.recompute:
        return problem
    most = problem.fixed(problem.forced[1])
    return dataclasses.replace(most, colocate=problem.colocate, transient_mem=problem.transient_mem)


def _refuse_over_caps(problem: Problem, spread: int, along_chain: int = 0, together: int = 0) -> None:
    """Raise :class:`InfeasiblePlanError` where the memory floors (:func:`memory_floor`, spread
    perfectly; :func:`~autosplit.solver.pipeline.memory.memory_chain_floor`, layers whole along the
    heaviest chain; ``together``: :func:`~autosplit.solver.pipeline.memory.memory_proof`'s, stages before
    each chain position holding what must lie there) exceed every cap; 0: not computed."""
    floor, largest = max(spread, along_chain, together), max(problem.capacity)
    if floor > largest:
        how = ("state and activations spread perfectly" if spread >= max(along_chain, together) else
               "layers kept whole along the model's heaviest chain of layers, split at the best places"
               if along_chain >= together else
               "layers kept whole along the model's heaviest chain, the stages before each cut holding, together, "
               "everything that must come before it")
        raise InfeasiblePlanError(advice(
            f"no plan fits the memory caps: any plan needs at least {format_bytes(floor * KIB)} on its fullest "
            f"device, but the largest cap is {format_bytes(largest * KIB)} (proven over {problem.ranks} devices: {how})",
            "model state and activations exceed the caps",
            "more devices or devices with more memory, schedule='1f1b' (fewer micro-batches in flight), a smaller "
            "batch, or optimizer='sgd'",
        ))


def _keep_what_fits(problem: Problem, stage_of: Sequence[int], chosen: Sequence[int]) -> _Choice:
    """(``chosen`` less the blocks each rank's memory can keep after all, for the split ``stage_of``;
    of the rest, block → (stage, micro-batches it keeps there) where the rank can hold some of a
    block's in-flight micro-batches but not all: :meth:`Problem.fixed`'s arguments). Blocks that cost
    the most time per byte they save are kept first (for a stage's equal layers, the least time
    that fits); the blocks the user asked to recompute recompute every micro-batch."""
    kept = set(chosen)
    must = set(problem.forced[0])
    ev = evaluate(problem.fixed(kept), stage_of)
    first = {problem.rank(s): s for s in reversed(range(problem.num_stages))}
    slack = {r: problem.capacity[s] - ev.rank_memory[r] for r, s in first.items()}
    stage = {u: stage_of[problem.recompute[u].members[0]] for u in kept}
    ratio = {u: problem.recompute[u].compute[stage[u]] / max(1, problem.recompute[u].saves[stage[u]]) for u in kept}
    for u in sorted(kept - must, key=lambda u: (-ratio[u], u)):
        r, need = problem.rank(stage[u]), problem.recompute[u].saves[stage[u]]
        if need <= slack[r]:
            kept.discard(u)
            slack[r] -= need
    partial = {}
    for u in sorted(kept - must, key=lambda u: (-ratio[u], u)):
        block, s = problem.recompute[u], stage[u]
        window = block.in_flight[s] if block.in_flight else 1
        each = block.saves[s] / window  # KiB one kept micro-batch holds again
        keep = min(window - 1, int(slack[problem.rank(s)] // each) if each > 0 else window - 1)
        if keep > 0:
            partial[u] = (s, keep)
            slack[problem.rank(s)] -= block.saves[s] - block.partly(s, keep, problem.micro_batches).saves[s]
    found = tuple(sorted(kept))
    if partial and violations(problem.fixed(found, partial), stage_of):  # the memory apportioned otherwise: no partial
        partial = {}
    return (found, partial) if not violations(problem.fixed(found), stage_of) else (tuple(chosen), {})


def _joint(
    problem: Problem, stage_of: tuple[int, ...] | None, chosen: tuple[int, ...], *, time_limit: float, seed: int,
    workers: int | None, limits: SolverLimits, gap: float = PROVEN_GAP,
) -> tuple[tuple[int, ...] | None, tuple[int, ...], dict[int, tuple[int, int]], int] | None:
    """CP-SAT over the split and the blocks together, from the plan ``stage_of`` recomputing
    ``chosen``: (plan on the nodes, blocks it recomputes, those that keep some micro-batches (block →
    (stage, kept)), a bound valid for every plan — 0 unless it ran on the nodes themselves). On the
    nodes when the model is small enough, else on blocks that keep each recomputable block whole (as
    few as :attr:`SolverLimits.cpsat_vars` allows)."""
    N, S = len(problem.nodes), problem.num_stages
    order = topological_order(problem)
    if N * (S - 1) <= limits.cpsat_vars:
        recomputed: list[int] = []
        kept: dict[int, tuple[int, int]] = {}
        name, found, cp_bound, core = cpsat(problem, stage_of, time_limit=time_limit, seed=seed, workers=workers,
                                            hint_recompute=chosen, recomputed=recomputed, kept=kept, gap=gap)
        if name == "INFEASIBLE":
            raise InfeasiblePlanError(explain_infeasible(problem.fixed(problem.forced[1]), core, time_limit, seed))
        return found, tuple(recomputed), kept, math.ceil(cp_bound)
    units = max(len(problem.recompute), min(limits.cpsat_vars // max(1, S - 1), limits.max_blocks))
    c = coarsen(problem, order, max_cost=float(problem.arrays.compute.sum()) / S / max(1, units // S))
    if c.num_blocks * (S - 1) > 4 * limits.cpsat_vars:
        log.info("%d blocks x %d stages: too many to choose recomputation with CP-SAT; kept the DP's choice", c.num_blocks, S)
        return None
    coarse = coarse_problem(problem, c)
    hint = None if stage_of is None else tuple(stage_of[c.members(b)[0]] for b in range(c.num_blocks))
    recomputed, kept = [], {}
    # On blocks the bound is not used: the micro-batches each block keeps are left to _keep_what_fits (a
    # k[u, s] per block and stage made CP-SAT on Llama-3-70B's 80 layers × 32 stages worse in its time)
    _, found, _, _ = cpsat(coarse, hint, time_limit=time_limit, seed=seed, workers=workers, hint_recompute=chosen,
                           recomputed=recomputed, kept=kept, partial=False, gap=gap)
    return None if found is None else (c.to_nodes(found), tuple(recomputed), kept, 0)


def _split(
    problem: Problem, *, time_limit: float = 10.0, seed: int = 0, workers: int | None = None, limits: SolverLimits = SolverLimits(),
    gap: float = PROVEN_GAP, started: float | None = None,
) -> Solution:
    """:func:`solve` for a problem with nothing to recompute: the split alone. ``started``: the
    :func:`time.perf_counter` at which ``time_limit`` began (the caller's search counts against it)."""
    start = time.perf_counter() if started is None else started
    precheck(problem)
    N, S = len(problem.nodes), problem.num_stages
    order = topological_order(problem)

    dp, coarse, block_dp = dp_plan(problem, order, limits=limits)
    candidates = {"dp": dp} if dp else {}
    dp_eval = evaluate(problem, dp) if dp else None
    baseline = dp_eval.objective if dp_eval else None
    if (dp is None or violations(problem, dp)) and N * (S - 1) > limits.cpsat_vars:
        # No split of the DP's order fits, and CP-SAT cannot explain why: the memory floors may prove it first.
        _refuse_over_caps(problem, *memory_floors(problem))

    units = N if coarse is None else coarse.num_blocks
    # The bound stops once it proves the DP's plan within 0.1% (or the gap asked for, if smaller): past the
    # gap asked for, a tighter bound costs little (0.1 s on 345 nodes) and reports a truer gap.
    enough = None if baseline is None else baseline * (1 - min(gap, PROVEN_GAP))
    bound = lower_bound(problem, upper=max(dp_eval.time) if dp_eval else math.inf, enough=enough, limits=limits)
    remaining = time_limit - (time.perf_counter() - start)
    target: Problem | None = None
    if coarse is not None:  # blocks cannot express the refined cuts: CP-SAT gets a share of the time
        remaining = min(remaining, time_limit / 4)
    certified = dp_eval is not None and dp_eval.objective - bound <= gap * dp_eval.objective
    if certified and dp is not None and not violations(problem, dp):
        log.info("the DP's plan is within %.2f%% of the bound: no CP-SAT search", 100 * gap)
    elif units * (S - 1) <= limits.cpsat_vars and remaining > 0 and S > 1:
        target = problem if coarse is None else coarse_problem(problem, coarse)
        if coarse is not None and _one_order(target):
            log.info("the %d blocks admit one order only: the block DP is exact over them, no CP-SAT search", units)
            target = None
    if target is not None:
        hint = dp if coarse is None else (block_dp and tuple(block_dp[coarse.members(b)[0]] for b in range(units)))
        name, found, cp_bound, core = cpsat(target, hint, time_limit=remaining, seed=seed, workers=workers, gap=gap)
        if found is not None:
            candidates["cp-sat"] = found if coarse is None else coarse.to_nodes(found)
        if coarse is None:  # a bound on the nodes themselves: valid for every plan
            if name == "INFEASIBLE":
                raise InfeasiblePlanError(explain_infeasible(problem, core, time_limit, seed))
            bound = max(bound, math.ceil(cp_bound))
    valid = {k: v for k, v in candidates.items() if not violations(problem, v)}
    if not valid:
        if N * (S - 1) <= limits.cpsat_vars:
            everything = [*range(S), *(c.text for c in problem.constraints)]
            raise InfeasiblePlanError(explain_infeasible(problem, everything, time_limit, seed))
        floors = memory_floors(problem)
        _refuse_over_caps(problem, *floors)
        floor, largest = max(floors), max(problem.capacity)
        searched = (f"CP-SAT found none in the {time.perf_counter() - start:.1f}s of time_limit={time_limit:g}s spent"
                    if target is not None else f"CP-SAT was not run ({units} units × {S - 1} boundaries exceed "
                    f"SolverLimits.cpsat_vars={limits.cpsat_vars}, or no time was left of time_limit={time_limit:g}s)")
        raise SolverError(advice(
            f"no plan found for {N} nodes on {S} devices; not proven infeasible: any plan needs at least "
            f"{format_bytes(floor * KIB)} on its fullest device (cap {format_bytes(largest * KIB)})",
            f"the dynamic program found no contiguous split that fits memory and the constraints, and {searched}",
            "a longer time_limit, a larger SolverLimits(cpsat_vars=...), looser memory caps or constraints, or more devices",
        ))
    method, stage_of = min(valid.items(), key=lambda kv: (evaluate(problem, kv[1]).objective, kv[0] != "dp"))
    objective = evaluate(problem, stage_of).objective
    bound = min(bound, objective)
    status = "OPTIMAL" if bound == objective else "FEASIBLE"
    return Solution(stage_of, status, objective, bound, time.perf_counter() - start, method, baseline, units)
