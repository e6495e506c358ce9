"""The compiler, top to bottom: capture → annotate → estimate → order → build → solve → validate → codegen.

Three functions, each a sequence of named, timed steps (``AUTOSPLIT_DEBUG=1`` logs them, ``2`` each
plan's report, ``3`` each stage's code: :mod:`autosplit.debug`):

- :func:`trace` — capture the model as an fx graph and annotate every node (done once per
  model and input shape; :class:`~autosplit.planner.Planner` keeps the result);
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

import contextlib
import dataclasses
import difflib
import logging
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autosplit import debug, progress, schedules
from autosplit.devices import DeviceSpec, uncalibrated
from autosplit.errors import CodegenError, ConstraintError, CostModelError, DeviceError, advice
from autosplit.options import PlanOptions
from autosplit.passes.annotate import annotate
from autosplit.passes.capture import Captured, capture, fingerprint, flat_inputs
from autosplit.passes.codegen import Program, generate
from autosplit.passes.costs import CostTable, estimate, with_overrides
from autosplit.passes.profile import ProfileOptions, profile
from autosplit.plan import Plan, PlannedTask, SharedParam, SolverInfo, StageReport, StepTerms
from autosplit.runtime.microbatch import batch_size, split_batch
from autosplit.solver import Problem, build_problem, choose_order, evaluate, solve, validate
from autosplit.solver.hybrid import ring_allreduce
from autosplit.solver.makespan import schedule_of, solve_makespan
from autosplit.solver.makespan.schedule import memory_of, run_key
from autosplit.solver.problem import KIB, NS, UserConstraint, tied_costs

__all__ = ["Traced", "trace", "compile_plan", "codegen"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _timed(name: str, timings: dict[str, float], limit: float | None = None) -> Iterator[None]:
    start = time.perf_counter()
    with progress.phase(name, limit):
        yield
    timings[name] = time.perf_counter() - start
    debug.pass_times.info("pass %-9s %8.3fs", name, timings[name])


@dataclass(frozen=True)
class Traced:
    """A captured, annotated model: what every plan of it starts from."""

    captured: Captured
    inputs: tuple[Any, ...]
    """The example values of the graph's placeholders, in order."""
    fingerprint: str
    timings: Mapping[str, float] = field(default_factory=dict)
    model: torch.nn.Module | None = None
    example: tuple[tuple, Mapping[str, Any]] = ((), {})
    """The example call ``(args, kwargs)`` it was captured with."""
    _micro: dict[int, Captured] = field(default_factory=dict, compare=False, repr=False)

    @property
    def node_names(self) -> set[str]:
        return {n.name for n in self.captured.gm.graph.nodes if n.op not in ("placeholder", "output")}

    @property
    def batch(self) -> int | None:
        """Rows of the example batch (dimension 0 of its first tensor), the micro-batches cut."""
        return batch_size(self.inputs)

    def at_micro_batch(self, micro_batches: int) -> tuple[Captured, list[Any]]:
        """The capture to run one of ``micro_batches`` micro-batches with, and its placeholder values.

        torch.export specialises a graph to its example shapes (guards, view sizes), so an
        exported model is captured again at the micro-batch's shape — it must give the same
        graph, or it is refused. A symbolically traced graph runs any batch as it is.
        """
        if micro_batches == 1 or self.captured.method != "export":  # defaults included, cut like the inputs
            return self.captured, list(split_batch(self.inputs, None, micro_batches)[0][0])
        args, kwargs = split_batch(self.example[0], self.example[1], micro_batches)[0]
        if micro_batches not in self._micro:
            if self.model is None:
                raise CodegenError(advice(
                    f"this exported graph is specialised to its batch and cannot run {micro_batches} micro-batches",
                    "the trace was made without its model, so it cannot be captured again at the micro-batch's shape",
                    "trace with autosplit.compiler.trace(model, ...)",
                ))
            captured = capture(self.model, args, dict(kwargs), method="export")
            if fingerprint(captured.gm) != self.fingerprint:
                raise CodegenError(advice(
                    f"the model captures as another graph at the micro-batch's shape ({batch_size(args, kwargs)} rows) "
                    f"than at the batch's ({batch_size(*self.example)} rows)",
                    "Python control flow or torch.export specialisation that depends on the batch size",
                    "make forward independent of the batch size, or plan with micro_batches=1",
                ))
            self._micro[micro_batches] = captured
        captured = self._micro[micro_batches]
        return captured, flat_inputs(captured, args, kwargs)


def trace(model: torch.nn.Module, example_inputs: tuple, example_kwargs: Mapping[str, Any] | None, *, method: str) -> Traced:
    """Steps *capture* and *annotate*."""
    timings: dict[str, float] = {}
    kwargs = dict(example_kwargs or {})
    state = [*model.parameters(), *model.buffers()]
    if state and all(t.is_meta for t in state):  # planning reads shapes only: inputs go where the weights are
        example_inputs, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (tuple(example_inputs), kwargs))
    with _timed("capture", timings):
        captured = capture(model, example_inputs, kwargs, method=method)
        graph_id = fingerprint(captured.gm)
    inputs = flat_inputs(captured, example_inputs, kwargs)
    with _timed("annotate", timings):
        annotate(captured, inputs)
    return Traced(captured, tuple(inputs), graph_id, timings, model=model, example=(tuple(example_inputs), kwargs))


def compile_plan(
    traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, *, given: Plan | None = None, check_memory: bool = True
) -> Plan:
    """Steps *estimate* → *order* → *build* → *solve* → *validate*; with ``given``, no solving:
    the saved plan is validated and its predictions refreshed under ``options.costs``
    (``check_memory=False``: a plan over a memory cap is costed, not refused)."""
    timings = dict(traced.timings)
    if given is not None:
        given.check_fingerprint(traced.fingerprint, traced.node_names)
    M = options.micro_batches_for(len(specs), traced.batch)
    with _timed("estimate", timings):
        table, source = _costs(traced, specs, options, micro_batches=M)
    rules = _user_constraints(table, options)
    if options.objective == "makespan" or (given is not None and given.objective == "makespan"):
        return _compile_makespan(traced, specs, options, table, source, rules, timings, given)
    with _timed("order", timings):
        order = given.stage_devices if given is not None else choose_order(
            table, micro_batches=M, schedule=options.schedule, constraints=rules, limits=options.limits
        )
    with _timed("build", timings):
        problem = build_problem(table, micro_batches=M, schedule=options.schedule, order=order, constraints=rules)
    if given is not None:
        stage_of = tuple(given.stage_of[name] for name in problem.nodes)
        with _timed("validate", timings):
            validate(problem, stage_of, memory=check_memory)
        terms, shared = predict_step(problem, table, stage_of, order, options)
        solver = given.solver
        if solver.status == "MANUAL":  # a hand-made split: its value under the solver's model, comparable with bounds
            solver = dataclasses.replace(solver, objective=evaluate(problem, stage_of).objective / M / NS)
        return dataclasses.replace(
            given, solver=solver, stages=_stage_reports(problem, table, stage_of, order), costs=source, step_time=terms.total,
            module_stages=_module_stages(table, stage_of),
            terms=terms, shared_params=shared, data_parallel=options.data_parallel, timings=timings,
            made_with=given.made_with or (given.costs, given.step_time),
        )
    with _timed("solve", timings, limit=options.time_limit):
        solution = solve(problem, time_limit=options.time_limit, seed=options.seed, limits=options.limits)
    with _timed("validate", timings):
        validate(problem, solution.stage_of)
    terms, shared = predict_step(problem, table, solution.stage_of, order, options)
    return Plan(
        assignment={name: order[s] for name, s in zip(problem.nodes, solution.stage_of)},
        devices=specs,
        stage_devices=tuple(order),
        stages=_stage_reports(problem, table, solution.stage_of, order),
        module_stages=_module_stages(table, solution.stage_of),
        step_time=terms.total,
        terms=terms,
        shared_params=shared,
        data_parallel=options.data_parallel,
        micro_batches=M,
        schedule=options.schedule,
        objective="pipeline",
        solver=SolverInfo(
            name=solution.solver,
            status=solution.status,
            objective=solution.objective / M / NS,
            bound=solution.bound / M / NS,
            gap=solution.gap,
            wall_time=solution.wall_time,
            time_limit=options.time_limit,
            seed=options.seed,
            baseline=None if solution.baseline is None else solution.baseline / M / NS,
            units=solution.units,
        ),
        fingerprint=traced.fingerprint,
        capture=traced.captured.method,
        costs=source,
        versions=_versions(),
        timings=timings,
    )


def _compile_makespan(
    traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, table: CostTable, source: str,
    rules: list[UserConstraint], timings: dict[str, float], given: Plan | None,
) -> Plan:
    """The makespan objective (DLPlacer, :mod:`autosplit.solver.makespan`): one micro-batch, every
    node on any device, each device's forward and backward tasks timed. With ``given``, its
    assignment is re-timed under these costs (each device in the saved plan's task order)."""
    order = tuple(range(len(specs)))
    with _timed("build", timings):
        problem = build_problem(table, micro_batches=1, schedule="sequential", order=order, constraints=rules)
    index = {name: i for i, name in enumerate(problem.nodes)}
    if given is not None:
        runs = sorted(given.tasks, key=lambda t: run_key(t.start, t.end, t.kind, index[t.node]))
        priority = [2 * index[t.node] + (t.kind == "backward") for t in runs]
        schedule = schedule_of(problem, [given.assignment[name] for name in problem.nodes], priority or None)
        solver = given.solver
    else:
        with _timed("solve", timings, limit=options.time_limit):
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
        stages.append(StageReport(
            device=specs[d].torch_device or specs[d].name, nodes=len(members),
            params=sum(table.param_counts[n] for n in members),
            modules=_stage_modules(table, members),
            compute=busy, transfer=0.0, time=busy,
            forward=sum(table.fwd_time[n][d] for n in members), backward=sum(table.bwd_time[n][d] for n in members),
            param_bytes=sum(table.param_bytes[n] for n in members) if table.param_bytes else 0,
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
        module_stages=_module_stages(table, stage_of), step_time=makespan, terms=StepTerms(makespan, 0.0, 0.0, 0.0, 0.0),
        micro_batches=1, schedule="makespan", objective="makespan", solver=solver, costs=source, timings=timings, tasks=tasks,
    )
    if given is not None:
        return dataclasses.replace(given, **common, made_with=given.made_with or (given.costs, given.step_time))
    return Plan(devices=specs, fingerprint=traced.fingerprint, capture=traced.captured.method, versions=_versions(), **common)


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
    with _timed("codegen", timings):
        program = generate(traced.captured, plan.stage_of, [str(t) for t in targets])
    if debug.stage_code.isEnabledFor(logging.DEBUG):
        for s, (stage, device) in enumerate(zip(program.stages, program.devices)):
            debug.stage_code.debug("stage %d on %s:\n%s", s, device, stage.code.strip())
    return program, timings


def predict_step(
    problem: Problem, table: CostTable, stage_of: Sequence[int], order: Sequence[int], options: PlanOptions
) -> tuple[StepTerms, tuple[SharedParam, ...]]:
    """The step the runtime will take (DESIGN §4.1): the schedule over stage times, plus what runs
    around it — the runtime's per-micro-batch overhead, the optimizer step, tied-parameter
    gradient sync and the exposed data-parallel all-reduce — and how each tied parameter is shared.
    """
    S, M = problem.num_stages, problem.micro_batches
    devices = [table.devices[d] for d in order]
    links = [devices[k - 1].link_to(devices[k]) for k in range(1, S)]
    reads = table.param_reads or ("",) * len(table.nodes)
    consumers = problem.consumers()
    transfer = [list(row) for row in problem.transfer]
    param_bytes = [0.0] * S
    for n, s in enumerate(stage_of):
        param_bytes[s] += table.param_bytes[n] if table.param_bytes else 0
    shared, tied_sync = [], 0.0
    for u, read in enumerate(reads):
        holders = sorted({stage_of[u], *(stage_of[v] for v in consumers[u])})
        if not read or len(holders) < 2:
            continue
        nbytes = table.output_bytes[u]
        hops = links[holders[0] : holders[-1]]
        send = sum(tied_costs(nbytes, bw, lat, M)[0] for bw, lat in hops)
        bw, lat = min(bw for bw, _ in hops), max(lat for _, lat in hops)
        R = len(holders)
        replicate = ring_allreduce(nbytes, R, bw, lat)
        # Asynchronous stages update at different times: a replicated copy would drift, so it is sent.
        policy = "replicate" if replicate < send and not schedules.lookup(options.schedule).asynchronous else "send"
        for k in range(1, S):  # what this parameter adds to the stages it crosses
            transfer[u][k - 1] = 0 if policy == "replicate" else round(tied_costs(nbytes, links[k - 1][0], links[k - 1][1], M)[0] * NS)
        if policy == "replicate":
            tied_sync += replicate
            for s in holders[1:]:  # every holder keeps its own copy, and all-reduces its gradient over replicas
                param_bytes[s] += nbytes
        shared.append(SharedParam(read, tuple(holders), policy, send, replicate))
    # The solver's stage times include each stage's optimizer step (build_problem); report it apart.
    opt = table.optimizer_time or tuple((0.0,) * len(table.devices) for _ in table.nodes)
    without = tuple(tuple(c - round(o[order[s]] * NS) for s, c in enumerate(row)) for row, o in zip(problem.compute, opt))
    sharing = dataclasses.replace(problem, transfer=tuple(map(tuple, transfer)))
    overheads = [d.microbatch_overhead for d in devices]
    asynchronous = schedules.lookup(options.schedule).asynchronous  # no flush: the steady state, M micro-batches through the slowest stage

    def step(problem: Problem) -> float:
        ev = evaluate(problem, stage_of)
        return max(ev.time) / NS if asynchronous else ev.objective / M / NS

    total, pipeline = step(sharing), step(dataclasses.replace(sharing, compute=without))
    overhead = M * max(overheads) if asynchronous else sum(overheads) + (M - 1) * max(overheads)
    optimizer = total - pipeline
    data_parallel = 0.0
    R = options.data_parallel
    if R > 1:
        bwd = [0.0] * S
        for n, s in enumerate(stage_of):
            bwd[s] += table.bwd_time[n][order[s]]
        for s, d in enumerate(devices):
            allreduce = ring_allreduce(param_bytes[s], R, *d.link_to(d))
            data_parallel = max(data_parallel, allreduce - bwd[s] / M)  # overlaps the last micro-batch's backward
    terms = StepTerms(pipeline, overhead, optimizer, tied_sync, max(0.0, data_parallel))
    return terms, tuple(shared)


def _versions() -> dict[str, str]:
    out = {"torch": str(torch.__version__)}
    for pkg in ("autosplit", "ortools"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def _stage_reports(problem: Problem, table: CostTable, stage_of: Sequence[int], order: Sequence[int]) -> tuple[StageReport, ...]:
    ev = evaluate(problem, stage_of)
    reports = []
    for s, device in enumerate(table.devices[d] for d in order):
        members = [n for n, st in enumerate(stage_of) if st == s]
        reports.append(
            StageReport(
                device=device.torch_device or device.name,
                nodes=len(members),
                params=sum(table.param_counts[n] for n in members),
                modules=_stage_modules(table, members),
                compute=ev.compute[s] / NS,
                forward=sum(table.fwd_time[n][order[s]] for n in members),
                backward=sum(table.bwd_time[n][order[s]] for n in members),
                param_bytes=sum(table.param_bytes[n] for n in members) if table.param_bytes else 0,
                transfer=ev.transfer[s] / NS,
                time=ev.time[s] / NS,
                memory_state=ev.state_mem[s] * KIB,
                memory_activations=ev.act_mem[s] * KIB,
                memory_received=ev.recv_mem[s] * KIB,
                memory_sent=ev.send_mem[s] * KIB,
                memory_transient=ev.transient_mem * KIB,
                capacity=device.memory,
            )
        )
    return tuple(reports)


_ARTEFACT = re.compile(r"(^|\.)(_guards_fn|submod_\d+)(\.|$)")
"""Modules torch.export adds (its shape guards, higher-order ops' bodies): not the user's."""


def _unit(path: str) -> str:
    """The module a report names for ``path``: down to the first numbered layer (``model.layers.3``), else two levels."""
    parts = path.split(".") if path else []
    numbered = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return ".".join(parts[: numbered + 1 if numbered is not None else 2]) or "(root)"


def _ranges(names: Sequence[str]) -> list[str]:
    """Runs of consecutive numbered layers as one name: ``model.layers.0–4``."""
    out: list[tuple[str, int, int] | str] = []
    for name in names:
        prefix, _, last = name.rpartition(".")
        run = out[-1] if out else None
        if last.isdigit() and isinstance(run, tuple) and run[0] == prefix and run[2] + 1 == int(last):
            out[-1] = (prefix, run[1], int(last))
        else:
            out.append((prefix, int(last), int(last)) if last.isdigit() and prefix else name)
    return [r if isinstance(r, str) else f"{r[0]}.{r[1]}" + (f"–{r[2]}" if r[2] > r[1] else "") for r in out]


def _stage_modules(table: CostTable, members: Sequence[int]) -> tuple[str, ...]:
    """A stage named by the modules whose parameters it holds (numbered layers as ranges): the FQN
    lists of manual splits, in short."""
    owners = [n for n in members if table.param_counts[n]] or members
    names = [u for u in dict.fromkeys(_unit(table.module_paths[n]) for n in owners) if not _ARTEFACT.search(u)]
    return tuple(_ranges(names)) or ("(root)",)


def _module_stages(table: CostTable, stage_of: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Every module path, at every level (in the order the graph first runs it), and the stages its nodes run on."""
    stages: dict[str, set[int]] = {}
    for path, s in zip(table.module_paths, stage_of):
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            stages.setdefault(".".join(parts[:depth]), set()).add(s)
    return {path: tuple(sorted(found)) for path, found in stages.items()}


def _costs(traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, *, micro_batches: int) -> tuple[CostTable, str]:
    """The cost table ``options.costs`` asks for (with overrides), and a line saying where it came from."""
    costs, gm = options.costs, traced.captured.gm
    if isinstance(costs, (CostTable, Path)) or (isinstance(costs, str) and costs not in ("analytic", "measured")):
        table = _given_table(traced, specs, costs)
        source = f"given table ({costs if isinstance(costs, (str, Path)) else 'object'})"
    elif costs == "analytic":
        table = estimate(gm, specs, optimizer=options.optimizer, micro_batches=micro_batches)
        present = sorted({str(s.torch_device) for s in specs if uncalibrated(s)})
        source = "analytic" + (f" (uncalibrated for {', '.join(present)})" if present else "")
    else:
        table, source = _measured(traced, specs, ProfileOptions() if costs == "measured" else costs, options, micro_batches)
    if options.cost_overrides:
        n = len(options.cost_overrides)
        table = with_overrides(table, options.cost_overrides)
        source += f" + {n} override{'s' * (n > 1)}"
    return table, source


def _measured(
    traced: Traced, specs: tuple[DeviceSpec, ...], profiling: Any, options: PlanOptions, micro_batches: int
) -> tuple[CostTable, str]:
    present = sorted({s.torch_device for s in specs if s.torch_device is not None})
    if not present:
        raise CostModelError(
            advice(
                f"costs='measured' needs a device to measure on, but {[s.name for s in specs]} are all plan-only presets",
                "presets have no hardware here to profile on",
                "pass torch devices (e.g. 'cpu', 'cuda:0'), or costs='analytic' with calibrated specs (autosplit.calibrate)",
            )
        )
    captured, micro = traced.at_micro_batch(micro_batches)
    forwards_first = schedules.lookup(options.schedule).forwards_first
    profiles = {
        dev: profile(captured, micro, dev, fingerprint=traced.fingerprint, options=profiling,
                     micro_batches=micro_batches, forwards_first=forwards_first, optimizer=options.optimizer)
        for dev in present
    }
    table = estimate(
        traced.captured.gm, specs, optimizer=options.optimizer, micro_batches=micro_batches,
        profiles=[profiles.get(s.torch_device) if s.torch_device else None for s in specs],
    )
    hits = sum(p.cached for p in profiles.values())
    analytic = [s.name for s in specs if s.torch_device is None]
    return table, (
        f"measured on {', '.join(present)}" + (f" (cache: {hits} of {len(profiles)})" if hits else "")
        + (f"; analytic for {', '.join(dict.fromkeys(analytic))}" if analytic else "")
    )


def _given_table(traced: Traced, specs: tuple[DeviceSpec, ...], costs: CostTable | str | Path) -> CostTable:
    table = costs if isinstance(costs, CostTable) else CostTable.load(costs)
    nodes = tuple(n.name for n in traced.captured.gm.graph.nodes if n.op not in ("placeholder", "output"))
    if table.nodes != nodes:
        missing = sorted(set(nodes) - set(table.nodes))
        raise CostModelError(
            advice(
                f"the given cost table has {len(table.nodes)} nodes, the captured graph {len(nodes)} "
                f"(first missing: {missing[:3]})",
                "the table belongs to another model or input shape",
                "save a table from this model (CostTable.save) and edit it, or use cost_overrides=",
            )
        )
    if len(table.devices) != len(specs):
        raise CostModelError(
            advice(
                f"the given cost table has times for {len(table.devices)} devices, but {len(specs)} devices were given",
                "the table was made for other devices",
                "plan with the devices the table was made for, or save a table for these devices",
            )
        )
    return dataclasses.replace(table, devices=specs)


def _device_index(ref: int | str, specs: Sequence[DeviceSpec]) -> int:
    if isinstance(ref, int) and 0 <= ref < len(specs):
        return ref
    hits = [i for i, s in enumerate(specs) if str(ref) in (s.torch_device, s.name)]
    if len(hits) != 1:
        raise ConstraintError(
            advice(
                f"constraint names device {ref!r}, which matches {len(hits)} of the {len(specs)} devices "
                f"({[s.torch_device or s.name for s in specs]})",
                "a constraint must name exactly one device" + (" and several share that name" if hits else ""),
                f"name it by its index 0..{len(specs) - 1}",
            )
        )
    return hits[0]


def _module_nodes(module: str, table: CostTable) -> tuple[int, ...]:
    nodes = tuple(i for i, p in enumerate(table.module_paths) if p == module or p.startswith(module + "."))
    if not nodes:
        known = sorted({p for p in table.module_paths if p})
        close = difflib.get_close_matches(module, known, n=3)
        raise ConstraintError(
            advice(
                f"constraint names module {module!r}, but no graph node comes from it",
                "a misspelt name, or a module the forward never calls",
                f"did you mean {close}?" if close else f"a module of the model; they look like {known[:5]}",
            )
        )
    return nodes


def _user_constraints(table: CostTable, options: PlanOptions) -> list[UserConstraint]:
    """Module/device constraints as (node, device) rules; build_problem maps devices to stages."""
    specs, out = table.devices, []
    for module, ref in (options.pin or {}).items():
        d = _device_index(ref, specs)
        nodes = _module_nodes(module, table)
        forbid = tuple((n, other) for n in nodes for other in range(len(specs)) if other != d)
        out.append(UserConstraint(f"pin '{module}' to device {d} ({specs[d].torch_device or specs[d].name})", forbid))
    for module, refs in (options.avoid or {}).items():
        listed = [refs] if isinstance(refs, (int, str)) else list(refs)
        ds = sorted({_device_index(r, specs) for r in listed})
        nodes = _module_nodes(module, table)
        out.append(UserConstraint(f"keep '{module}' off devices {ds}", tuple((n, d) for n in nodes for d in ds)))
    for modules in options.together or ():
        nodes = tuple(sorted({n for m in modules for n in _module_nodes(m, table)}))
        out.append(UserConstraint(f"keep {list(modules)} together", (), nodes))
    return out
