"""Step *search*: the schedule, stages per rank and micro-batch count, when the options leave them to
the planner (``"auto"``), and the solver's problem for one such configuration.

Every configuration the options allow — each flushed schedule torch runs, each number of stages per
rank it takes (up to :data:`~autosplit.options.AUTO_MOST_STAGES_PER_RANK`), each micro-batch count
that divides the batch and that its class accepts — is split by the exact DP (no CP-SAT: a search
runs dozens) and judged by its replayed step and per-rank peak memory, the most micro-batches first;
one whose bound (:func:`~autosplit.compiler.prediction.work_bound`) is no less than the fastest step
found is not split (it cannot win). The fastest that fits memory is planned in full; the others come
back as :class:`~autosplit.plans.Alternative` rows for the report.

Usage::

    chosen, alternatives = search(traced, specs, PlanOptions(schedule="auto", stages_per_rank="auto"))
"""

from __future__ import annotations

import dataclasses
import logging
import math

from autosplit import schedules
from autosplit.compiler.costs import cost_table, estimated
from autosplit.compiler.prediction import predict_step, rank_peaks, stage_reports, work_bound
from autosplit.compiler.recompute import offered
from autosplit.compiler.trace import Traced
from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.errors import AutosplitError, ConstraintError, InfeasiblePlanError, SolverError, advice
from autosplit.options import AUTO, AUTO_MOST_STAGES_PER_RANK, PlanOptions
from autosplit.plans import Alternative, PartialRecompute
from autosplit.solver.build import build_problem
from autosplit.solver.pipeline.dp import topological_order
from autosplit.solver.pipeline.order import choose_order
from autosplit.solver.pipeline.strategy import dp_plan, prove_over_caps
from autosplit.solver.problem import Problem, UserConstraint
from autosplit.solver.validate import violations

__all__ = ["configurations", "search", "stage_problem"]

log = logging.getLogger(__name__)


def stage_problem(
    table: CostTable, ranks: int, options: PlanOptions, micro_batches: int, rules: list[UserConstraint]
) -> tuple[tuple[int, ...], Problem]:
    """(device of each stage, the solver's problem) for one concrete configuration: with one stage
    per rank the device order is searched (:func:`choose_order`); with several, the schedule places
    the stages on the ranks (a loop or a V) and rank r runs on device r."""
    entry, v = schedules.lookup(options.schedule), options.rank_stages
    if v == 1:
        order = choose_order(table, micro_batches=micro_batches, schedule=options.schedule, constraints=rules, limits=options.limits)
        rank_of: tuple[int, ...] = ()
    else:
        entry.check(ranks=ranks, stages=ranks * v, micro_batches=micro_batches)
        rank_of = order = tuple(entry.rank_of(s, ranks * v, ranks) for s in range(ranks * v))
    problem = build_problem(table, micro_batches=micro_batches, schedule=options.schedule, order=order, constraints=rules,
                            rank_of=rank_of, recompute=offered(table, options) if table.blocks else None)
    return order, problem


def recomputing(
    traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, micro_batches: int, rules: list[UserConstraint],
    order: tuple[int, ...], labels: tuple[str, ...], partial: tuple[PartialRecompute, ...] = (),
) -> tuple[CostTable, str, Problem]:
    """The cost table and problem of stages in ``order`` that recompute the blocks ``labels`` (of them,
    ``partial`` keep some micro-batches): their costs exactly, nothing left to choose."""
    table, source = cost_table(traced, specs, options, micro_batches=micro_batches, recompute=labels, partial=partial)
    problem = build_problem(table, micro_batches=micro_batches, schedule=options.schedule, order=order, constraints=rules,
                            rank_of=order if options.rank_stages > 1 else ())
    return table, source, problem


def configurations(options: PlanOptions, ranks: int, batch: int | None) -> list[PlanOptions]:
    """Every concrete configuration ``options`` leave open, in a fixed order (``selective="auto"``: each
    both ways where blocks may recompute, else without)."""
    if options.selective == AUTO:
        choices = (False, True) if options.checkpoints else (False,)
        return [c for s in choices for c in configurations(options.replace(selective=s), ranks, batch)]
    names = ([n for n in schedules.SCHEDULES if schedules.REGISTRY[n].flushes and schedules.REGISTRY[n].torch_class
              and not (options.checkpoints and schedules.REGISTRY[n].split_backward)]
             if options.schedule == AUTO else [options.schedule])
    out = []
    for name in names:
        entry = schedules.lookup(name)
        low, high = entry.stages_per_rank
        if isinstance(options.stages_per_rank, int):
            per_rank = [options.stages_per_rank]
        elif options.stages_per_rank == AUTO:
            per_rank = list(range(low, max(low, min(high or AUTO_MOST_STAGES_PER_RANK, AUTO_MOST_STAGES_PER_RANK)) + 1))
        else:
            per_rank = [low]
        for v in per_rank:
            if ranks == 1 and v > 1 and entry.placement != "v":
                continue
            concrete = options.replace(schedule=name, stages_per_rank=v, micro_batches=None)
            if options.micro_batches == AUTO:  # one per rank up to one row each; fewer only where the batch allows no more
                counts = [m for m in range(ranks, (batch or 4 * ranks * v) + 1) if batch is None or batch % m == 0] or [
                    m for m in range(1, ranks) if batch is None or batch % m == 0]
            else:
                given = options.micro_batches
                counts = [given if isinstance(given, int) else concrete.micro_batches_for(ranks, batch)]
            out += [concrete.replace(micro_batches=m) for m in counts
                    if entry.refusal(ranks=ranks, stages=ranks * v, micro_batches=m) is None]
    return out


def _judge(traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, best: float = math.inf) -> Alternative:
    """One configuration, split by the DP and replayed — unless its bound leaves no room below ``best``,
    the fastest step found so far; one that cannot be costed (an exported graph that changes at its
    micro-batch's shape) is a row that does not fit, saying why."""
    try:
        return _split_and_replay(traced, specs, options, best)
    except AutosplitError as e:
        first = str(e).split(". Likely cause")[0]
        log.info("search: %s × %s × M=%s cannot be costed: %s", options.schedule, options.rank_stages, options.micro_batches, first)
        return Alternative(options.schedule, options.rank_stages, int(options.micro_batches or 0), math.inf, (), first)


def _split_and_replay(traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, best: float) -> Alternative:
    _, M, table, _, rules = estimated(traced, specs, options)
    bound = work_bound(table, len(specs), M, options.schedule, options.rank_stages)  # before recompute, which only adds work
    if bound >= best:
        return Alternative(options.schedule, options.rank_stages, M, math.inf, (),
                           f"not split: none of its plans steps in less than {bound:.4g} s, and the best found takes {best:.4g} s",
                           bound=bound)
    order, problem = stage_problem(table, len(specs), options, M, rules)
    try:  # the cheap proofs first (more ranks than units, a node over every cap): no DP to run where they hold
        prove_over_caps(problem, cheap=True)
    except InfeasiblePlanError as e:
        return _proven(options, M, e)
    stage_of, labels = None, tuple[str, ...]()
    for chosen in dict.fromkeys(problem.forced):  # the fewest and the most blocks recomputed, when there are any
        fixed = problem.fixed(chosen)
        found, _, _ = dp_plan(fixed, topological_order(fixed), limits=options.limits)
        if found is not None and not violations(fixed, found):
            stage_of, labels = found, tuple(problem.recompute[u].label for u in chosen)
            break
    if labels:
        table, _, problem = recomputing(traced, specs, options, M, rules, order, labels)
    elif stage_of is None:
        stage_of, _, _ = dp_plan(problem, topological_order(problem), limits=options.limits)
    why = "; ".join(violations(problem, stage_of)) if stage_of is not None else ""
    if stage_of is None or why:
        try:  # the memory floors may prove that no split fits: then the configuration reaches no step at all
            prove_over_caps(problem)
        except InfeasiblePlanError as e:
            return _proven(options, M, e)
        why = f"the DP's split does not fit ({why or 'no contiguous split'}); not proven infeasible"
    row = Alternative(options.schedule, options.rank_stages, M, math.inf, (), why, bound=bound)
    if why or stage_of is None:
        return row
    terms, shared = predict_step(problem, table, stage_of, order, options)
    reports = stage_reports(problem, table, stage_of, order, shared, options.schedule)
    return dataclasses.replace(row, step_time=terms.total, rank_memory=rank_peaks(problem, options.schedule, reports))


def _proven(options: PlanOptions, M: int, error: InfeasiblePlanError) -> Alternative:
    """A configuration proven to fit no split: it reaches no step at all (its bound infinite)."""
    return Alternative(options.schedule, options.rank_stages, M, math.inf, (), f"proven: {error}".split(". Likely cause")[0],
                       bound=math.inf)


def search(traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions) -> tuple[PlanOptions, tuple[Alternative, ...]]:
    """The fastest configuration that fits memory among those ``options`` leave open, and every
    one tried (fastest first); when none fits, an :class:`InfeasiblePlanError` naming them where the
    memory floors prove each, else a :class:`SolverError` (the DP's splits over one order do not fit:
    no proof)."""
    concretes = configurations(options, len(specs), traced.batch)
    if not concretes:
        raise ConstraintError(advice(
            f"no configuration the options leave open runs on {len(specs)} ranks with a batch of {traced.batch} rows",
            f"schedule {options.schedule!r} needs a micro-batch count it runs that divides the batch",
            "another schedule (gpipe runs any count), a larger batch, or fewer devices",
        ))
    tried: list[tuple[PlanOptions, Alternative]] = []
    for concrete in sorted(concretes, key=lambda c: -int(c.micro_batches or 1)):  # the most micro-batches: the least bubble
        row = _judge(traced, specs, concrete, min((row.step_time for _, row in tried), default=math.inf))
        tried.append((concrete, dataclasses.replace(row, selective=concrete.selective is True)))
    tried.sort(key=lambda pair: (pair[1].step_time, pair[1].schedule, pair[1].stages_per_rank, pair[1].micro_batches, pair[1].selective))
    for _, row in tried:
        log.info("search: %s × %d stage(s) per rank × %d micro-batches%s: %s", row.schedule, row.stages_per_rank,
                 row.micro_batches, ", selective" if row.selective else "", f"{row.step_time * 1e3:.3f} ms" if row.fits else row.note)
    if not tried or not tried[0][1].fits:
        if all(row.bound == math.inf for _, row in tried):  # each configuration proven not to fit
            raise InfeasiblePlanError(_none_fits(tried))
        raise SolverError(_none_fits(tried))
    return tried[0][0], tuple(row for _, row in tried)


def _none_fits(tried: list[tuple[PlanOptions, Alternative]]) -> str:
    return advice(
        f"none of the {len(tried)} configurations tried fits: "
        + "; ".join(f"{r.schedule} × {r.stages_per_rank} × M={r.micro_batches}: {r.note}" for _, r in tried[:6]),
        "every schedule, stages per rank and micro-batch count the options allow was split by the DP",
        "more devices or memory, a smaller batch, or fix schedule= to search CP-SAT's wider space",
    )
