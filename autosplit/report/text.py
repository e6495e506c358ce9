"""The partition report as text: one row per stage, then the step's terms and the solver's provenance.

Usage::

    print(plan_report(plan))
"""

from __future__ import annotations

import io
import re
from typing import Any

from rich.console import Console
from rich.table import Table

from autosplit.engine_profiles import trust
from autosplit.plans import LOSS_COSTED, Plan
from autosplit.units import format_bytes
from autosplit.units import format_ms as _ms

__all__ = ["layerless_notes", "plan_report"]

_LAYERS = re.compile(r"^(.*\.)?(\d+)(?:–(\d+))?$")
"""A stage's module name that is a numbered layer or a run of them (``model.layers.3``, ``model.layers.0–4``)."""


def _engine_gap(plan: Plan) -> str:
    engine, free = plan.engine_gap or ("", plan.step_time)
    return (f"planned as {engine} runs it (whole layers): {_ms(plan.step_time)}; the best plan without that restriction "
            f"{_ms(free)} ({plan.step_time / free - 1:+.1%})")


def plan_report(plan: Plan, width: int = 140) -> str:
    """The partition report as text: one row per device, then the solver's provenance."""
    table = Table(title=f"autosplit plan: {len(plan.assignment)} nodes on {len(plan.devices)} devices")
    for col in ("stage", "device", "modules", "nodes", "params", "memory / cap", "compute", "transfers", "stage time", ""):
        table.add_column(col, justify="left" if col in ("device", "modules", "") else "right", no_wrap=col != "modules")
    for s, st in enumerate(plan.stages):
        table.add_row(
            str(s), f"{plan.stage_devices[s]}: {st.device}", _span(st.modules), str(st.nodes), f"{st.params:,}",
            f"{format_bytes(st.memory)} / {format_bytes(st.capacity)}",
            _ms(st.compute), _ms(st.transfer), _ms(st.time), "◀ bottleneck" if s == plan.bottleneck else "",
        )
    sv = plan.solver
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    console.print(table)
    replayed = (f"replayed step bound {_ms(sv.step_bound)} (every split's work spread evenly over the ranks), "
                f"step gap {plan.step_gap:.2%}; " if sv.step_bound is not None and plan.step_gap is not None else "")
    provenance = (
        f"split by hand ({sv.name}), no solver ran; {replayed}objective {_ms(sv.objective)} under the solver's model"
        if sv.status == "MANUAL" else
        f"solver {sv.name}: {sv.status}, objective {_ms(sv.objective)}"
        + (" (the schedule's closed form, which the replay refines)"
           if plan.stages_per_rank > 1 or sv.step_bound is not None else "")
        + f", bound {_ms(sv.bound)}, "
        f"gap {sv.gap:.2%}, {sv.wall_time:.2f}s (limit {sv.time_limit:g}s, seed {sv.seed}); "
        + f"{replayed}{sv.units} units; dynamic program {_ms(sv.baseline) if sv.baseline is not None else 'found no split'}"
    )
    console.print(
        f"predicted step time {_ms(plan.step_time)} ({plan.schedule}, {plan.micro_batches} micro-batches, {plan.precision}"
        f"{f', {len(plan.float8_linears)} linears in FP8 {plan.float8}' if plan.float8 else ''}); "
        f"{provenance}; costs {plan.costs}; captured by {plan.capture}, graph {plan.fingerprint}"
    )
    for caveat in _caveats(plan):
        console.print(caveat)
    if plan.terms is not None:
        t = plan.terms
        console.print(
            f"step = pipeline {_ms(t.pipeline)} + runtime overhead {_ms(t.overhead)} + optimizer {_ms(t.optimizer)} "
            f"+ tied-weight sync {_ms(t.tied_sync)} + data-parallel collectives {_ms(t.data_parallel)} "
            f"(exposed; mesh {' × '.join(f'{k} {v}' for k, v in plan.mesh.items())}"
            f"{f', experts over ep {plan.expert_parallel} of its dp_shard × tp' if plan.expert_parallel > 1 else ''})"
        )
    if plan.tensor_parallel > 1:
        _print_tensor_parallel(console, plan)
    if plan.float8_linears or plan.float8_kept:
        _print_float8(console, plan)
    for p in plan.shared_params:
        console.print(
            f"shared parameter {p.name} on stages {list(p.stages)}: {p.policy} "
            f"(send per micro-batch {_ms(p.send)}, replicate + all-reduce {_ms(p.replicate)} per step)"
        )
    if plan.made_with is not None:
        made_costs, made_step = plan.made_with
        console.print(f"as saved: step {_ms(made_step)} with costs {made_costs}; now {_ms(plan.step_time)} with costs {plan.costs}")
    for s, st in enumerate(plan.stages):
        console.print(
            f"  stage {s} memory: state {format_bytes(st.memory_state)} (params + grads + optimizer + buffers), "
            f"activations {format_bytes(st.memory_activations)}, received {format_bytes(st.memory_received)}, "
            f"sent {format_bytes(st.memory_sent)}, "
            + (f"gradient buffers {format_bytes(st.memory_buffers)}, " if st.memory_buffers else "")
            + f"transient {format_bytes(st.memory_transient)}"
        )
        if st.recompute:
            how = " selectively (keeping its matmuls' and attention's outputs)" if plan.recompute_selective else ""
            console.print(f"    recomputes {_span(st.recompute)}{how} in its backward: {format_bytes(st.recompute_saves)} of activations "
                          "not held")
            for some in (some for some in plan.recompute_partial if some.block in st.recompute):
                console.print(f"      {some.block} keeps micro-batch i's activations where i mod {some.window} < {some.keep} "
                              f"({some.recomputed(plan.micro_batches)} of {plan.micro_batches} recompute)")
    if plan.stages_per_rank > 1:
        for r, peak in enumerate(plan.rank_memory):
            mine = [s for s, d in enumerate(plan.stage_devices) if d == r]
            console.print(f"  device {r} (stages {mine}) peak {format_bytes(peak)} of {format_bytes(plan.stages[mine[0]].capacity)}, "
                          f"replayed in the {plan.schedule} order")
    for note in layerless_notes(plan):
        console.print(note)
    if plan.alternatives:
        _print_alternatives(console, plan)
    return out.getvalue().rstrip()


def _caveats(plan: Plan) -> list[str]:
    """What the predictions leave out or rest on: the engine's restriction, uncalibrated costs, a loss not costed."""
    out = [_engine_gap(plan)] if plan.engine_gap is not None else []
    if (line := trust(plan.devices)) is not None:
        out.append(line)
    if "uncalibrated" in plan.costs:
        out.append("the predicted times are a roofline estimate nobody fitted to these devices: calibrate them "
                   "(autosplit.calibrate, autosplit.calibration.measure_runtime) or plan with costs='measured' before trusting them")
    if LOSS_COSTED not in plan.costs:
        out.append("the loss is not costed: the stage returning the output also runs it and holds its saved tensors, one per "
                   "micro-batch in flight, beyond these figures (plan with loss_fn= and example_target= to cost it)")
    return out


def _print_tensor_parallel(console: Any, plan: Plan) -> None:
    """What tensor parallelism splits, and what stays whole on every tp rank and why."""
    by_dim = {d: sum(1 for v in plan.tp_shards.values() if v == d) for d in (0, 1)}
    console.print(f"tensor parallel over tp {plan.tensor_parallel}: {len(plan.tp_shards)} parameters split "
                  f"({by_dim[0]} along dim 0: column-parallel and vocabulary; {by_dim[1]} along dim 1: row-parallel)"
                  + ("; sequence parallel between the split layers" if plan.sequence_parallel else ""))
    for path, why in list(plan.tp_whole.items())[:12]:
        console.print(f"  whole on every tp rank: {path or 'the root'}: {why}")
    if len(plan.tp_whole) > 12:
        console.print(f"  … and {len(plan.tp_whole) - 12} more modules kept whole")


def _print_float8(console: Any, plan: Plan) -> None:
    """Which linears run in FP8, and why each other stays bf16."""
    total = len(plan.float8_linears) + len(plan.float8_kept)
    console.print(f"FP8 linears ({plan.float8 or 'none'}): {len(plan.float8_linears)} of {total}"
                  + (f": {_span(plan.float8_linears)}" if plan.float8_linears else ""))
    for path, why in plan.float8_kept[:12]:
        console.print(f"  bf16: {path}: {why}")
    if len(plan.float8_kept) > 12:
        console.print(f"  … and {len(plan.float8_kept) - 12} more linears kept in bf16")


def _print_alternatives(console: Any, plan: Plan) -> None:
    """The configurations a search tried, fastest first: each one's mesh, schedule, step and peak."""
    console.print(f"configurations tried ({len(plan.alternatives)}, fastest first; split by the DP, replayed):")
    for a in plan.alternatives[:12]:
        peak = max(a.rank_memory, default=0)
        mesh = _mesh(a.data_parallel, a.dp_shard, a.tensor_parallel, a.expert_parallel, a.context_parallel)
        console.print(f"  {f'pp {len(a.rank_memory)} × {mesh}: ' if mesh and a.rank_memory else mesh + ': ' if mesh else ''}" + (
            f"{a.schedule} × {a.stages_per_rank} stage(s) per device × {a.micro_batches} micro-batches"
            f"{', recomputing selectively' if a.selective else ''}: "
            f"{_ms(a.step_time)}, peak {format_bytes(peak)}" if a.fits else a.note))


def _mesh(data_parallel: int, dp_shard: int, tp: int = 1, ep: int = 1, cp: int = 1) -> str:
    """``"dp_shard 8"``, ``"dp_replicate 4"``, ``"dp_replicate 2 × dp_shard 4 × cp 2 × tp 8 (ep 16)"``; ``""`` with neither."""
    named = (("dp_replicate", data_parallel // dp_shard), ("dp_shard", dp_shard), ("cp", cp), ("tp", tp))
    parts = [f"{name} {n}" for name, n in named if n > 1]
    return " × ".join(parts) + f" (ep {ep})" * (ep > 1)


def _span(modules: tuple[str, ...]) -> str:
    if len(modules) <= 3:
        return ", ".join(modules)
    return f"{modules[0]} … {modules[-1]} ({len(modules)})"


def _layer_count(modules: tuple[str, ...]) -> int:
    """How many numbered layers (``model.layers.3``, runs ``model.layers.0–4``) a stage's modules name."""
    count = 0
    for name in modules:
        found = _LAYERS.match(name)
        if found and found.group(1):
            count += 1 + (int(found.group(3)) - int(found.group(2)) if found.group(3) else 0)
    return count


def layerless_notes(plan: Plan) -> list[str]:
    """Why each stage that holds none of the model's repeated layers, where others do, holds what it
    holds: its compute in layers (at the least per layer of the stages that hold only layers), beside
    the slowest stage's. The solver chose the split as the fastest it found by its own model, so the
    note says what the split trades: a stage of no layers (the head alone) costs as much as the layers
    it would otherwise take, or nothing the slowest stage would not dictate anyway."""
    counts = [_layer_count(st.modules) for st in plan.stages]
    if not any(counts) or all(counts):
        return []
    per_layer = min((st.compute / n for st, n in zip(plan.stages, counts) if n and len(st.modules) == 1), default=None)
    per_layer = per_layer or min(st.compute / n for st, n in zip(plan.stages, counts) if n)
    slowest = plan.stages[plan.bottleneck]
    notes = []
    for s, (st, n) in enumerate(zip(plan.stages, counts)):
        if n:
            continue
        weight = st.compute / per_layer if per_layer else 0.0
        notes.append(
            f"stage {s} holds no repeated layer, only {_span(st.modules)}: its compute {_ms(st.compute)} weighs as much as "
            f"{weight:.1f} layer(s) ({_ms(per_layer)} each); the slowest stage, {plan.bottleneck}, holds "
            f"{counts[plan.bottleneck]} layer(s) and takes {_ms(slowest.time)}"
            + (" (a split by hand)" if plan.solver.status == "MANUAL" else
               f", and the split was the fastest the solver found by its model ({sum(counts)} layers on "
               f"{sum(1 for c in counts if c)} of {len(counts)} stages)")
        )
    return notes
