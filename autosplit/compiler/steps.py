"""The compiler, top to bottom: capture → annotate → estimate → order → build → solve → validate → codegen.

Three functions, each a sequence of named, timed steps (``AUTOSPLIT_DEBUG=1`` logs them, ``2`` each
plan's report, ``3`` each stage's code: :mod:`autosplit.debug`):

- :func:`~autosplit.compiler.trace.trace` — capture the model as an fx graph and annotate every node (done once per
  model and input shape; :class:`~autosplit.api.planner.Planner` keeps the result);
- :func:`compile_plan` — estimate costs, choose the device order, build the solver's
  :class:`~autosplit.solver.Problem`, solve it and validate the assignment; or, given a
  saved plan, validate it and refresh its predictions;
- :func:`codegen` — one ``GraphModule`` per stage for a plan.

Usage::

    traced = trace(model, (x,), {}, method="auto")
    plan = compile_plan(traced, resolve_devices(["cpu"] * 4), PlanOptions())
    program = codegen(traced, plan)
"""

from __future__ import annotations

import dataclasses
import logging

from autosplit import debug, progress, schedules
from autosplit.compiler.costs import estimated, float8_fields, tp_fields
from autosplit.compiler.makespan import compile_makespan
from autosplit.compiler.prediction import module_stages, predict_step, rank_peaks, stage_reports, step_bound
from autosplit.compiler.recost import recost
from autosplit.compiler.refine import refine
from autosplit.compiler.search import configurations, recomputing, search, stage_problem
from autosplit.compiler.trace import Traced, versions
from autosplit.devices import DeviceSpec
from autosplit.errors import CodegenError, DeviceError, advice
from autosplit.options import PlanOptions
from autosplit.passes.codegen import Program, generate
from autosplit.passes.float8_stages import to_float8
from autosplit.plans import Alternative, PartialRecompute, Plan, SolverInfo
from autosplit.solver import validate
from autosplit.solver.evaluation import evaluate
from autosplit.solver.pipeline.strategy import solve
from autosplit.solver.problem import NS

__all__ = ["codegen", "compile_plan"]


def compile_plan(
    traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, *, given: Plan | None = None, check_memory: bool = True
) -> Plan:
    """Steps *estimate* → *order* → *build* → *solve* → *validate*; with ``given``, no solving:
    :func:`~autosplit.compiler.recost.recost` validates the saved plan and refreshes its predictions
    under ``options.costs`` (``check_memory=False``: a plan over a memory cap is costed, not refused)."""
    if given is not None:
        return recost(traced, specs, options, given, check_memory=check_memory)
    if options.searches and options.objective == "pipeline":
        return _searched(traced, specs, options)
    timings, M, table, source, rules = estimated(traced, specs, options)
    if options.objective == "makespan":
        return compile_makespan(traced, specs, options, table, source, rules, timings)
    v = options.rank_stages
    with progress.timed_pass("build", timings):  # the device order (one stage per rank) and the solver's problem
        order, problem = stage_problem(table, len(specs), options, M, rules)
    with progress.timed_pass("solve", timings, limit=options.time_limit):
        solution = solve(problem, time_limit=options.time_limit, seed=options.seed, limits=options.limits, gap=options.gap)
    # On the table before any recompute: recomputing only adds work, so it bounds those splits too.
    bound = step_bound(table, problem.ranks, M, options.schedule, v)
    recomputed = tuple(problem.recompute[u].label for u in solution.recompute)
    partial = tuple(PartialRecompute(problem.recompute[u].label, keep, problem.recompute[u].in_flight[s])
                    for u, s, keep in solution.partial)
    if recomputed:  # the chosen blocks' costs, exactly (the solver spread each block's over its members)
        with progress.timed_pass("estimate", timings):
            table, source, problem = recomputing(traced, specs, options, M, rules, order, recomputed, partial)
    stage_of, solver_name, status = solution.stage_of, solution.solver, solution.status
    if schedules.lookup(options.schedule).replayed(v):  # the closed form is a surrogate: the replay judges, and moves the cuts
        with progress.timed_pass("refine", timings):
            stage_of = refine(problem, table, stage_of, order, options)
        if stage_of != solution.stage_of:
            solver_name, status = f"{solution.solver} + replay", "FEASIBLE"
    with progress.timed_pass("validate", timings):
        validate(problem, stage_of)
    terms, shared = predict_step(problem, table, stage_of, order, options)
    reports = stage_reports(problem, table, stage_of, order, shared, options.schedule)
    per_step = M  # the objective is M steps' worth
    objective = evaluate(problem, stage_of).objective
    return Plan(
        assignment={name: s if v > 1 else order[s] for name, s in zip(problem.nodes, stage_of)},
        devices=specs,
        stage_devices=tuple(order),
        stages=reports,
        rank_memory=rank_peaks(problem, options.schedule, reports),
        module_stages=module_stages(table, stage_of),
        step_time=terms.total,
        terms=terms,
        shared_params=shared,
        data_parallel=options.replicas, dp_shard=options.dp_shard, **tp_fields(traced, options),
        micro_batches=M,
        schedule=options.schedule,
        stages_per_rank=v,
        precision=options.precision,
        **float8_fields(table),
        recompute=recomputed,
        recompute_partial=partial,
        recompute_selective=options.selective is True and bool(recomputed),
        objective="pipeline",
        solver=SolverInfo(
            name=solver_name,
            status=status,
            objective=objective / per_step / NS,
            bound=solution.bound / per_step / NS,
            gap=0.0 if objective <= 0 else max(0.0, (objective - solution.bound) / objective),
            wall_time=solution.wall_time,
            time_limit=options.time_limit,
            seed=options.seed,
            baseline=None if solution.baseline is None else solution.baseline / per_step / NS,
            units=solution.units,
            step_bound=bound,
        ),
        fingerprint=traced.fingerprint,
        capture=traced.captured.method,
        costs=source,
        versions=versions(),
        timings=timings,
    )


def _searched(traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions) -> Plan:
    """The plan of the fastest configuration the search finds, with every one tried beside it; the one
    configuration's own plan where the options leave only one (no search to run)."""
    only = configurations(options, len(specs), traced.batch)
    if len(only) == 1:
        return compile_plan(traced, specs, only[0])
    searched: dict[str, float] = {}
    with progress.timed_pass("search", searched):
        options, alternatives = search(traced, specs, options)
    plan = compile_plan(traced, specs, options)
    return dataclasses.replace(plan, alternatives=alternatives, timings={**plan.timings, **searched},
                               solver=dataclasses.replace(plan.solver, step_bound=_searched_bound(plan, alternatives)))


def _searched_bound(plan: Plan, alternatives: tuple[Alternative, ...]) -> float:
    """The least step any configuration the search tried can reach: the chosen one's proven bound (its
    replay's, or its step less the solver's gap where the closed form is the replay), and each other's
    :func:`~autosplit.compiler.prediction.work_bound` — so the plan's gap covers the schedules,
    stages per rank and micro-batches too."""
    own = plan.solver.step_bound if plan.solver.step_bound is not None else plan.step_time * (1 - plan.solver.gap)
    chosen = (plan.schedule, plan.stages_per_rank, plan.micro_batches)
    return min([own, *(a.bound for a in alternatives
                       if a.bound is not None and (a.schedule, a.stages_per_rank, a.micro_batches) != chosen)])


def codegen(traced: Traced, plan: Plan) -> tuple[Program, dict[str, float]]:
    """Step *codegen*: the stage modules of ``plan`` on its devices, and the step's time."""
    if plan.objective == "makespan":
        raise CodegenError(advice(
            "codegen makes pipeline stages, and a makespan plan (objective='makespan') has none",
            "its devices hold non-adjacent nodes and run them as their inputs arrive",
            "run it with Planner.build(plan), which returns its MakespanRunner",
        ))
    targets = [plan.devices[d].torch_device for d in plan.stage_devices]
    if None in targets:
        absent = sorted({d.name for d in plan.devices if d.torch_device is None})
        raise DeviceError(
            advice(
                f"cannot build modules for {absent}",
                "presets describe hardware to plan for, not a device to run on",
                "autosplit.plan(...) for planning only, or pass torch devices such as 'cuda:0' or 'cpu'",
            )
        )
    timings: dict[str, float] = {}
    with progress.timed_pass("codegen", timings):
        program = generate(traced.captured, plan.stage_of, [str(t) for t in targets], recompute=plan.recompute,
                           partial=plan.recompute_partial, selective=plan.recompute_selective)
        converted = set().union(*(to_float8(stage, plan.float8, plan.float8_linears) for stage in program.stages))
        if converted != set(plan.float8_linears):
            raise CodegenError(advice(
                f"the plan runs {sorted(set(plan.float8_linears) - converted)[:3]} in FP8, and no stage holds them as linears",
                "the plan was made for another version of the model", "re-plan the model",
            ))
    if debug.stage_code.isEnabledFor(logging.DEBUG):
        for s, (stage, device) in enumerate(zip(program.stages, program.devices)):
            debug.stage_code.debug("stage %d on %s:\n%s", s, device, stage.code.strip())
    return program, timings


