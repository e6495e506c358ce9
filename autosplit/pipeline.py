"""The compiler, top to bottom: capture → annotate → estimate → order → build → solve → validate → codegen.

Usage::

    plan = autosplit.plan(model, ["A100-80GB"] * 8, example_inputs=(x,))      # plan only
    split = autosplit.autosplit(model, ["cpu"] * 4, example_inputs=(x,))      # plan + build
    split = autosplit.autosplit(model, ["cpu"] * 4, example_inputs=(x,), plan="plan.json")
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Union

import torch

from autosplit.devices import DeviceLike, DeviceSpec, resolve_devices
from autosplit.errors import ConstraintError, CostModelError, DeviceError
from autosplit.passes.annotate import annotate
from autosplit.passes.capture import Captured, capture, fingerprint, flat_inputs
from autosplit.passes.codegen import generate
from autosplit.passes.costs import CostTable, estimate, with_overrides
from autosplit.passes.profile import ProfileOptions, micro_batch, profile
from autosplit.plan import Plan, SolverInfo, StageReport
from autosplit.runtime import SplitModule
from autosplit.solver import Problem, build_problem, evaluate, solve, validate
from autosplit.solver.order import choose_order
from autosplit.solver.problem import KIB, NS, SCHEDULES, UserConstraint

__all__ = ["plan", "autosplit"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _timed(name: str, timings: dict[str, float]):
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start
    log.info("pass %-9s %8.3fs", name, timings[name])


@dataclass(frozen=True)
class _Compiled:
    captured: Captured
    plan: Plan


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for pkg in ("autosplit", "ortools"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def _stage_reports(problem: Problem, table, stage_of: Sequence[int], order: Sequence[int]) -> tuple[StageReport, ...]:
    ev = evaluate(problem, stage_of)
    reports = []
    for s, device in enumerate(table.devices[d] for d in order):
        members = [n for n, st in enumerate(stage_of) if st == s]
        # Name a stage by the modules whose parameters it holds (the FQN lists of manual splits).
        owners = [n for n in members if table.param_counts[n]] or members
        modules = list(dict.fromkeys(".".join(table.module_paths[n].split(".")[:2]) or "(root)" for n in owners))
        reports.append(
            StageReport(
                device=device.torch_device or device.name,
                nodes=len(members),
                params=sum(table.param_counts[n] for n in members),
                modules=tuple(modules),
                compute=ev.compute[s] / NS,
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


CostsLike = Union[str, ProfileOptions, CostTable, Path]


def _costs(
    captured: Captured, inputs: list[Any], specs: tuple[DeviceSpec, ...], costs: CostsLike, *,
    optimizer: str, micro_batches: int, fingerprint: str,
) -> tuple[CostTable, str]:
    """The cost table ``costs`` asks for, and a line saying where it came from."""
    if isinstance(costs, (CostTable, Path)) or (isinstance(costs, str) and costs not in ("analytic", "measured")):
        return _given_table(captured, specs, costs), f"given table ({costs if isinstance(costs, (str, Path)) else 'object'})"
    if costs == "analytic":
        return estimate(captured.gm, specs, optimizer=optimizer, micro_batches=micro_batches), "analytic"
    options = ProfileOptions() if costs == "measured" else costs
    if not isinstance(options, ProfileOptions):
        raise CostModelError(
            f"costs={costs!r} is not understood; pass 'analytic', 'measured', autosplit.ProfileOptions(...), "
            "a CostTable or the path of a saved one"
        )
    present = sorted({s.torch_device for s in specs if s.torch_device is not None})
    if not present:
        raise CostModelError(
            f"costs='measured' needs a device to measure on, but {[s.name for s in specs]} are all plan-only "
            "presets; pass torch devices (e.g. 'cpu', 'cuda:0'), or costs='analytic' with calibrated specs "
            "(autosplit.calibrate)"
        )
    micro = micro_batch(inputs, micro_batches)
    profiles = {dev: profile(captured, micro, dev, fingerprint=fingerprint, options=options) for dev in present}
    table = estimate(
        captured.gm, specs, optimizer=optimizer, micro_batches=micro_batches,
        profiles=[profiles.get(s.torch_device) for s in specs],
    )
    hits = sum(p.cached for p in profiles.values())
    analytic = [s.name for s in specs if s.torch_device is None]
    return table, (
        f"measured on {', '.join(present)}" + (f" (cache: {hits} of {len(profiles)})" if hits else "")
        + (f"; analytic for {', '.join(dict.fromkeys(analytic))}" if analytic else "")
    )


def _given_table(captured: Captured, specs: tuple[DeviceSpec, ...], costs: CostTable | str | Path) -> CostTable:
    table = costs if isinstance(costs, CostTable) else CostTable.load(costs)
    nodes = tuple(n.name for n in captured.gm.graph.nodes if n.op not in ("placeholder", "output"))
    if table.nodes != nodes:
        missing = sorted(set(nodes) - set(table.nodes))
        raise CostModelError(
            f"the given cost table has {len(table.nodes)} nodes, the captured graph {len(nodes)} "
            f"(first missing: {missing[:3]}); the table belongs to another model or input shape. "
            "Save a table from this model (CostTable.save) and edit it, or use cost_overrides="
        )
    if len(table.devices) != len(specs):
        raise CostModelError(
            f"the given cost table has times for {len(table.devices)} devices, but {len(specs)} devices were given"
        )
    return dataclasses.replace(table, devices=specs)


def _device_index(ref: int | str, specs: Sequence[DeviceSpec]) -> int:
    if isinstance(ref, int) and 0 <= ref < len(specs):
        return ref
    hits = [i for i, s in enumerate(specs) if str(ref) in (s.torch_device, s.name)]
    if len(hits) != 1:
        raise ConstraintError(
            f"constraint names device {ref!r}, which matches {len(hits)} of the {len(specs)} devices "
            f"({[s.torch_device or s.name for s in specs]}); name it by its index 0..{len(specs) - 1}"
        )
    return hits[0]


def _module_nodes(module: str, table) -> tuple[int, ...]:
    nodes = tuple(i for i, p in enumerate(table.module_paths) if p == module or p.startswith(module + "."))
    if not nodes:
        known = sorted({p for p in table.module_paths if p})
        close = difflib.get_close_matches(module, known, n=3)
        raise ConstraintError(
            f"constraint names module {module!r}, but no graph node comes from it"
            + (f"; did you mean {close}?" if close else f"; modules look like {known[:5]}")
        )
    return nodes


def _user_constraints(
    table,
    pin: Mapping[str, int | str] | None,
    avoid: Mapping[str, int | str | Sequence[int | str]] | None,
    together: Sequence[Sequence[str]] | None,
) -> list[UserConstraint]:
    """Module/device constraints as (node, device) rules; build_problem maps devices to stages."""
    specs, out = table.devices, []
    for module, ref in (pin or {}).items():
        d = _device_index(ref, specs)
        nodes = _module_nodes(module, table)
        forbid = tuple((n, other) for n in nodes for other in range(len(specs)) if other != d)
        out.append(UserConstraint(f"pin '{module}' to device {d} ({specs[d].torch_device or specs[d].name})", forbid))
    for module, refs in (avoid or {}).items():
        refs = [refs] if isinstance(refs, (int, str)) else list(refs)
        ds = sorted({_device_index(r, specs) for r in refs})
        nodes = _module_nodes(module, table)
        out.append(UserConstraint(f"keep '{module}' off devices {ds}", tuple((n, d) for n in nodes for d in ds)))
    for modules in together or ():
        nodes = tuple(sorted({n for m in modules for n in _module_nodes(m, table)}))
        out.append(UserConstraint(f"keep {list(modules)} together", (), nodes))
    return out


def _compile(
    model: torch.nn.Module,
    devices: Sequence[DeviceLike],
    *,
    example_inputs: tuple,
    example_kwargs: Mapping[str, Any] | None,
    memory: Mapping[int | str, int | str] | None,
    micro_batches: int | None,
    schedule: str,
    optimizer: str,
    time_limit: float,
    seed: int,
    capture_method: str,
    given: Plan | None,
    costs: CostsLike = "analytic",
    cost_overrides: Mapping[str, Mapping[str, float]] | None = None,
    pin: Mapping[str, int | str] | None = None,
    avoid: Mapping[str, Any] | None = None,
    together: Sequence[Sequence[str]] | None = None,
) -> _Compiled:
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    if given is not None:  # a saved plan fixes the devices and the schedule it was made for
        devices, micro_batches, schedule = devices or given.devices, given.micro_batches, given.schedule
    if schedule not in SCHEDULES:
        raise ConstraintError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    specs: tuple[DeviceSpec, ...] = resolve_devices(devices, memory)
    # GPipe (Huang et al. 2019, §2.2): with M ≥ 4·S micro-batches the pipeline bubble is negligible.
    M = 1 if schedule == "sequential" else (micro_batches or 4 * len(specs))
    timings: dict[str, float] = {}

    with _timed("capture", timings):
        captured = capture(model, example_inputs, dict(example_kwargs or {}), method=capture_method)
        graph_id = fingerprint(captured.gm)
    if given is not None:
        given.check_fingerprint(graph_id, {n.name for n in captured.gm.graph.nodes if n.op not in ("placeholder", "output")})
    inputs = flat_inputs(captured, model, example_inputs, example_kwargs)
    with _timed("annotate", timings):
        annotate(captured, inputs)
    with _timed("estimate", timings):
        table, source = _costs(captured, inputs, specs, costs, optimizer=optimizer, micro_batches=M, fingerprint=graph_id)
        if cost_overrides:
            table = with_overrides(table, cost_overrides)
            source += f" + {len(cost_overrides)} override{'s' * (len(cost_overrides) > 1)}"
    rules = _user_constraints(table, pin, avoid, together)
    with _timed("order", timings):
        order = given.stage_devices if given is not None else choose_order(
            table, micro_batches=M, schedule=schedule, constraints=rules
        )
    with _timed("build", timings):
        problem = build_problem(table, micro_batches=M, schedule=schedule, order=order, constraints=rules)
    if given is not None:  # no solving; its predictions are refreshed under the costs asked for
        stage_of = tuple(given.stage_of[name] for name in problem.nodes)
        with _timed("validate", timings):
            validate(problem, stage_of)
        refreshed = dataclasses.replace(
            given, stages=_stage_reports(problem, table, stage_of, order), costs=source,
            step_time=evaluate(problem, stage_of).objective / M / NS,
        )
        return _Compiled(captured, refreshed)
    with _timed("solve", timings):
        solution = solve(problem, time_limit=time_limit, seed=seed)
    with _timed("validate", timings):
        validate(problem, solution.stage_of)

    plan = Plan(
        assignment={name: order[s] for name, s in zip(problem.nodes, solution.stage_of)},
        devices=specs,
        stage_devices=tuple(order),
        stages=_stage_reports(problem, table, solution.stage_of, order),
        step_time=solution.objective / M / NS,
        micro_batches=M,
        schedule=schedule,
        solver=SolverInfo(
            name=solution.solver,
            status=solution.status,
            objective=solution.objective / M / NS,
            bound=solution.bound / M / NS,
            gap=solution.gap,
            wall_time=solution.wall_time,
            time_limit=time_limit,
            seed=seed,
            baseline=None if solution.baseline is None else solution.baseline / M / NS,
            units=solution.units,
        ),
        fingerprint=graph_id,
        capture=captured.method,
        costs=source,
        versions=_versions(),
        timings=timings,
    )
    return _Compiled(captured, plan)


def plan(
    model: torch.nn.Module,
    devices: Sequence[DeviceLike],
    *,
    example_inputs: tuple,
    example_kwargs: Mapping[str, Any] | None = None,
    memory: Mapping[int | str, int | str] | None = None,
    micro_batches: int | None = None,
    schedule: str = "gpipe",
    optimizer: str = "adam",
    time_limit: float = 10.0,
    seed: int = 0,
    capture: str = "auto",
    costs: CostsLike = "analytic",
    cost_overrides: Mapping[str, Mapping[str, float]] | None = None,
    pin: Mapping[str, int | str] | None = None,
    avoid: Mapping[str, int | str | Sequence[int | str]] | None = None,
    together: Sequence[Sequence[str]] | None = None,
) -> Plan:
    """Plan ``model`` onto ``devices`` without building modules (devices may be hardware you lack).

    ``devices``: torch device strings (``["cpu"] * 4``: four logical devices), presets
    (``"A100-80GB"``) or :class:`DeviceSpec`. ``memory`` caps devices by index or name
    (``{"cuda:0": "20GiB"}``). ``micro_batches`` defaults to 4 × devices (GPipe);
    ``schedule`` is ``"gpipe"``, ``"1f1b"`` or ``"sequential"``; ``optimizer`` sets the
    optimizer state counted per parameter (``"adam"``, ``"sgd"``, ...).

    Constraints, by module qualified name and device index or name: ``pin={"blocks.0": 0}``,
    ``avoid={"head": ["cuda:0"]}``, ``together=[("wte", "head")]``. A set that cannot hold
    is explained in those terms (:class:`InfeasiblePlanError`). When devices differ (speed,
    memory, islands), which device takes which stage is part of the decision.

    ``costs``: ``"analytic"`` (roofline from FLOPs and bytes), ``"measured"`` (profile every
    node on the devices present, cached on disk; :class:`ProfileOptions` to set repeats,
    threads, cache), a :class:`CostTable` or the path of a saved one. ``cost_overrides``
    sets a node's or a module's cost: ``{"blocks.3": {"fwd": 2e-3, "bwd": 4e-3}}`` (seconds
    for the whole batch; ``saved_bytes`` too).
    """
    return _compile(
        model, devices, example_inputs=example_inputs, example_kwargs=example_kwargs, memory=memory,
        micro_batches=micro_batches, schedule=schedule, optimizer=optimizer, time_limit=time_limit,
        seed=seed, capture_method=capture, given=None, pin=pin, avoid=avoid, together=together,
        costs=costs, cost_overrides=cost_overrides,
    ).plan


def autosplit(
    model: torch.nn.Module,
    devices: Sequence[DeviceLike] | None,
    *,
    example_inputs: tuple,
    example_kwargs: Mapping[str, Any] | None = None,
    plan: Plan | str | Path | None = None,
    memory: Mapping[int | str, int | str] | None = None,
    micro_batches: int | None = None,
    schedule: str = "gpipe",
    optimizer: str = "adam",
    time_limit: float = 10.0,
    seed: int = 0,
    capture: str = "auto",
    costs: CostsLike = "analytic",
    cost_overrides: Mapping[str, Mapping[str, float]] | None = None,
    pin: Mapping[str, int | str] | None = None,
    avoid: Mapping[str, int | str | Sequence[int | str]] | None = None,
    together: Sequence[Sequence[str]] | None = None,
) -> SplitModule:
    """Partition ``model`` over ``devices`` and return a module that trains exactly like it.

    The returned :class:`SplitModule` shares ``model``'s parameters (moved to their
    devices in place) and carries the plan as ``.plan``. Pass ``plan`` (a :class:`Plan`
    or a JSON path) to rebuild a saved split without solving; ``devices=None`` then
    takes the plan's devices. Other options: see :func:`plan`.
    """
    given = Plan.load(plan) if isinstance(plan, (str, Path)) else plan
    if devices is None and given is None:
        raise DeviceError("devices=None needs a plan to take the devices from; pass devices such as ['cpu'] * 2")
    compiled = _compile(
        model, devices, example_inputs=example_inputs, example_kwargs=example_kwargs, memory=memory,
        micro_batches=micro_batches, schedule=schedule, optimizer=optimizer, time_limit=time_limit,
        seed=seed, capture_method=capture, given=given, pin=pin, avoid=avoid, together=together,
        costs=costs, cost_overrides=cost_overrides,
    )
    plan = compiled.plan
    targets = [plan.devices[d].torch_device for d in plan.stage_devices]
    if None in targets:
        absent = [d.name for d in compiled.plan.devices if d.torch_device is None]
        raise DeviceError(
            f"cannot build modules for {absent}: presets describe hardware to plan for, not a device to run on. "
            "Use autosplit.plan(...) for planning only, or pass torch devices such as 'cuda:0' or 'cpu'."
        )
    timings = dict(compiled.plan.timings)
    with _timed("codegen", timings):
        program = generate(compiled.captured, plan.stage_of, targets)
    return SplitModule(model, program, dataclasses.replace(compiled.plan, timings=timings))
