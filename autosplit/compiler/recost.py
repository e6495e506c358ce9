"""A saved plan under today's costs: validated against the captured graph and re-costed, never solved.

This is the path of ``plan=`` (a plan file or object) through :class:`~autosplit.api.planner.Planner`,
:func:`autosplit.distribute` and the manual splits: the assignment stays, the stage figures, step
terms and shared-parameter policies are recomputed under ``options.costs``, and the plan keeps
what it was made with (``made_with``) so the report can show both.
"""

from __future__ import annotations

import dataclasses
import logging

from autosplit import progress
from autosplit.compiler.costs import cost_table, estimated, float8_fields, tp_fields
from autosplit.compiler.makespan import compile_makespan
from autosplit.compiler.prediction import module_stages, predict_step, rank_peaks, stage_reports, step_bound
from autosplit.compiler.recompute import offered
from autosplit.compiler.trace import Traced
from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.errors import PlanMismatchError, advice
from autosplit.options import PlanOptions
from autosplit.plans import Plan
from autosplit.solver import validate
from autosplit.solver.build import build_problem
from autosplit.solver.evaluation import evaluate
from autosplit.solver.problem import NS

__all__ = ["recost"]

log = logging.getLogger(__name__)


def recost(
    traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, given: Plan, *, check_memory: bool = True,
    decide_recompute: bool = False,
) -> Plan:
    """``given`` validated (every node placed once, caps unless ``check_memory=False``, data flowing
    forward) and its predictions refreshed; a hand-made split also gets its value under the
    solver's model, so that it compares with the solver's bound. ``decide_recompute`` (a split written
    by hand): it recomputes the blocks the options decide to (``checkpointing="full"``,
    ``recompute={...: True}``); a block they leave to the solver (``"auto"``) is kept, as the split was
    written without it."""
    given.check_fingerprint(traced.fingerprint, traced.node_names)
    timings, M, table, source, rules = estimated(traced, specs, options)
    _same_float8(given, table)
    if decide_recompute and table.blocks:
        decided = offered(table, options)
        if None in decided.values():
            log.info("a manual split keeps the blocks checkpointing='auto' leaves to the solver: %s",
                     [b for b, c in decided.items() if c is None])
        recompute = tuple(b for b, c in decided.items() if c)
        given = dataclasses.replace(given, recompute=recompute, recompute_selective=options.selective is True and bool(recompute))
    base = table  # before recompute, which only adds work: the step bound holds for every split
    if given.recompute:  # the costs of the blocks it recomputes
        table, source = cost_table(traced, specs, options, micro_batches=M, recompute=given.recompute, partial=given.recompute_partial,
                                   selective=given.recompute_selective)
    if given.objective == "makespan":
        return compile_makespan(traced, specs, options, table, source, rules, timings, given)
    order = given.stage_devices
    rank_of = order if given.stages_per_rank > 1 else ()  # several stages per rank: device index = rank
    with progress.timed_pass("build", timings):
        problem = build_problem(table, micro_batches=M, schedule=options.schedule, order=order, constraints=rules, rank_of=rank_of)
    given_stage = given.stage_of  # a property that builds the whole map
    stage_of = tuple(given_stage[name] for name in problem.nodes)
    with progress.timed_pass("validate", timings):
        validate(problem, stage_of, memory=check_memory)
    terms, shared = predict_step(problem, table, stage_of, order, options)
    # The replayed step's bound under the costs the step is re-costed with; a hand split gets one too.
    solver = dataclasses.replace(given.solver, step_bound=step_bound(base, problem.ranks, M, options.schedule, given.stages_per_rank))
    if solver.status == "MANUAL":
        solver = dataclasses.replace(solver, objective=evaluate(problem, stage_of).objective / M / NS)
    reports = stage_reports(problem, table, stage_of, order, shared, options.schedule)
    return dataclasses.replace(
        given, solver=solver, stages=reports, rank_memory=rank_peaks(problem, options.schedule, reports), costs=source,
        step_time=terms.total,
        module_stages=module_stages(table, stage_of),
        terms=terms, shared_params=shared, data_parallel=options.replicas, dp_shard=options.dp_shard, timings=timings,
        **tp_fields(traced, options),
        precision=options.precision,
        **float8_fields(table),
        made_with=given.made_with or (given.costs, given.step_time),
    )


def _same_float8(given: Plan, table: CostTable) -> None:
    """Refuse a saved FP8 plan whose linears these options would convert otherwise (its stages would train
    another model than it was planned and checked for)."""
    if given.float8 is not None and (given.float8, given.float8_linears) != (table.float8_recipe, table.float8_linears):
        ours, theirs = set(table.float8_linears), set(given.float8_linears)
        raise PlanMismatchError(advice(
            f"the plan runs {len(theirs)} linears in FP8 ({given.float8}), and these options would run {len(ours)} "
            f"({table.float8_recipe}): only in the plan {sorted(theirs - ours)[:4]}, only under these options {sorted(ours - theirs)[:4]}",
            "the linears converted follow from float8, float8_exclude and the devices' costs, which differ from the plan's",
            "plan with the options the plan was made with (float8, float8_exclude), or re-plan",
        ))
