"""The makespan objective's compile step (DLPlacer, :mod:`autosplit.solver.makespan`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autosplit import progress
from autosplit.compiler.costs import float8_fields
from autosplit.compiler.prediction import module_stages, stage_modules
from autosplit.compiler.trace import Traced, versions
from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.options import PlanOptions
from autosplit.plans import Plan, PlannedTask, SolverInfo, StageReport, StepTerms
from autosplit.solver.build import build_problem
from autosplit.solver.makespan import solve_makespan
from autosplit.solver.makespan.schedule import memory_of, run_key, schedule_of
from autosplit.solver.problem import KIB, NS, UserConstraint

__all__ = ["compile_makespan"]


def compile_makespan(
    traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, table: CostTable, source: str,
    rules: list[UserConstraint], timings: dict[str, float], given: Plan | None = None,
) -> Plan:
    """The makespan objective (DLPlacer, :mod:`autosplit.solver.makespan`): one micro-batch, every
    node on any device, each device's forward and backward tasks timed. With ``given``, its
    assignment is re-timed under these costs (each device in the saved plan's task order)."""
    order = tuple(range(len(specs)))
    # the makespan runtime moves every value to the device that reads it, input-free ones too
    table = dataclasses.replace(table, input_free=())
    with progress.timed_pass("build", timings):
        problem = build_problem(table, micro_batches=1, schedule="sequential", order=order, constraints=rules)
    index = {name: i for i, name in enumerate(problem.nodes)}
    if given is not None:
        runs = sorted(given.tasks, key=lambda t: run_key(t.start, t.end, t.kind, index[t.node]))
        priority = [2 * index[t.node] + (t.kind == "backward") for t in runs]
        schedule = schedule_of(problem, [given.assignment[name] for name in problem.nodes], priority or None)
        solver = given.solver
    else:
        with progress.timed_pass("solve", timings, limit=options.time_limit):
            solution = solve_makespan(problem, time_limit=options.time_limit, seed=options.seed, limits=options.limits)
        schedule = solution.schedule
        solver = SolverInfo(
            name=solution.solver, status=solution.status, objective=solution.objective / NS, bound=solution.bound / NS,
            gap=solution.gap, wall_time=solution.wall_time, time_limit=options.time_limit, seed=options.seed,
            baseline=None if solution.baseline is None else solution.baseline / NS, units=solution.units,
        )
    device_of = schedule.device_of
    used = tuple(sorted(set(device_of)))
    stage_of = [used.index(d) for d in device_of]
    memory = memory_of(problem, device_of)
    stages = []
    for d in used:
        members = [n for n, dd in enumerate(device_of) if dd == d]
        state, act = sum(problem.state_mem[n] for n in members), sum(problem.act_mem[n][d] for n in members)
        busy = sum(problem.compute[n][d] for n in members) / NS
        sparse, rows = table.row_sparse(members)
        stages.append(StageReport(
            device=specs[d].torch_device or specs[d].name, nodes=len(members),
            params=sum(table.param_counts[n] for n in members),
            modules=stage_modules(table, members),
            compute=busy, transfer=0.0, time=busy,
            forward=sum(table.fwd_time[n][d] for n in members), backward=sum(table.bwd_time[n][d] for n in members),
            param_bytes=sum(table.param_bytes[n] for n in members) if table.param_bytes else 0,
            sparse_param_bytes=sparse, row_grad_bytes=rows,
            memory_state=state * KIB, memory_activations=act * KIB,
            memory_received=(memory[d] - state - act - problem.transient_mem) * KIB,
            memory_transient=problem.transient_mem * KIB, capacity=specs[d].memory,
        ))
    makespan = schedule.makespan / NS
    tasks = tuple(
        PlannedTask(problem.nodes[t.unit], t.kind, t.device, t.start / NS, t.end / NS)
        for t in sorted(schedule.tasks, key=lambda t: run_key(t.start, t.end, t.kind, t.unit))
    )
    common: dict[str, Any] = dict(
        assignment={name: device_of[i] for i, name in enumerate(problem.nodes)}, stage_devices=used, stages=tuple(stages),
        module_stages=module_stages(table, stage_of), step_time=makespan, terms=StepTerms(makespan, 0.0, 0.0, 0.0, 0.0),
        micro_batches=1, schedule="makespan", objective="makespan", solver=solver, costs=source, timings=timings, tasks=tasks,
        precision=options.precision,
        **float8_fields(table),
    )
    if given is not None:
        return dataclasses.replace(given, **common, made_with=given.made_with or (given.costs, given.step_time))
    return Plan(devices=specs, fingerprint=traced.fingerprint, capture=traced.captured.method, versions=versions(), **common)
