"""Manual splits as plans: the splits users write today, costed and run like autosplit's own.

- :func:`torchtitan_fqns` — torchtitan's ``module_fqns_per_model_part``: the repeated blocks
  spread evenly over the stages, the input modules and the output modules each weighing one
  block (``generate_llm_fqn_per_model_part``);
- :func:`deepspeed_fqns` — DeepSpeed ``PipelineModule(partition_method=...)`` over the model's
  layer list (top-level modules, ``ModuleList``/``Sequential`` expanded, in execution order):
  ``"parameters"`` balances parameter counts (``partition_balanced``: the largest stage as small
  as possible), ``"uniform"`` balances layer counts;
- :func:`plan_from_fqns` — any list of module names per stage as a :class:`~autosplit.plan.Plan`,
  checked (every module of the graph placed, data flowing forward only) and costed with the
  planner's cost model, so it can be compared with autosplit's plan or run by either runtime.

Usage::

    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(x,))
    even = plan_from_fqns(planner, torchtitan_fqns(model, 2, repeated="blocks"))
    pipe = autosplit.distribute(model, None, example_inputs=(x,), loss_fn=loss_fn, plan=even)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from autosplit.compiler import compile_plan
from autosplit.errors import ConstraintError, advice
from autosplit.plan import Plan, SolverInfo

__all__ = ["deepspeed_fqns", "layer_list", "plan_from_fqns", "torchtitan_fqns", "partition"]


def partition(weights: Sequence[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous, non-empty ranges ``[a, b)`` of ``weights`` whose largest sum is as small as possible
    (DeepSpeed's ``partition_balanced``; uniform weights give ``partition_uniform``'s counts)."""
    n = len(weights)
    if not 1 <= stages <= n:
        raise ConstraintError(advice(
            f"cannot cut {n} layers into {stages} non-empty stages",
            "every stage needs at least one layer",
            f"use 1..{n} stages",
        ))
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for b in range(s, n - (stages - s) + 1):
            for a in range(s - 1, b):
                worst = max(best[s - 1][a], prefix[b] - prefix[a])
                if worst < best[s][b]:
                    best[s][b], cut[s][b] = worst, a
    ranges, b = [], n
    for s in range(stages, 0, -1):
        ranges.append((cut[s][b], b))
        b = cut[s][b]
    return ranges[::-1]


def layer_list(model: torch.nn.Module, order: Sequence[str] = ()) -> list[str]:
    """The model as DeepSpeed sees a ``PipelineModule``: its top-level modules, containers
    (``ModuleList``, ``Sequential``) expanded, ordered by ``order`` (module paths in execution order)."""
    layers: list[str] = []

    def walk(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
                walk(path + ".", child)
            else:
                layers.append(path)

    walk("", model)
    first = {}
    for i, path in enumerate(order):
        for layer in layers:
            if layer not in first and (path == layer or path.startswith(layer + ".")):
                first[layer] = i
    return sorted(layers, key=lambda layer: first.get(layer, len(order)))


def deepspeed_fqns(model: torch.nn.Module, stages: int, method: str = "parameters", order: Sequence[str] = ()) -> list[list[str]]:
    """Module names per stage as DeepSpeed's ``partition_method`` (``"parameters"`` or ``"uniform"``) splits them."""
    layers = layer_list(model, order)
    if method == "parameters":
        weights = [float(sum(p.numel() for p in model.get_submodule(layer).parameters())) for layer in layers]
    elif method == "uniform":
        weights = [1.0] * len(layers)
    else:
        raise ConstraintError(advice(
            f"partition_method={method!r} is not supported",
            "only DeepSpeed's two weightless methods are modelled",
            "use 'parameters' or 'uniform'",
        ))
    return [layers[a:b] for a, b in partition(weights, stages)]


def torchtitan_fqns(
    model: torch.nn.Module, stages: int, *, repeated: str, input_weight: float = 1, output_weight: float = 1,
    order: Sequence[str] = (),
) -> list[list[str]]:
    """torchtitan's even split: the blocks of ``repeated`` (e.g. ``"layers"``) spread evenly, the
    modules before them weighing ``input_weight`` blocks and those after ``output_weight``."""
    layers = layer_list(model, order)
    blocks = [layer for layer in layers if layer.startswith(repeated + ".")]
    if not blocks:
        raise ConstraintError(advice(
            f"no repeated blocks under {repeated!r}",
            "no layer of the model is named under it",
            f"name the ModuleList, one of {layers[:6]}",
        ))
    first, last = layers.index(blocks[0]), layers.index(blocks[-1])
    units = [layers[:first], *([b] for b in blocks), layers[last + 1 :]]
    weights = [input_weight, *[1.0] * len(blocks), output_weight]
    keep = [i for i, u in enumerate(units) if u]
    ranges = partition([weights[i] for i in keep], stages)
    return [[m for i in keep[a:b] for m in units[i]] for a, b in ranges]


def plan_from_fqns(planner: Any, fqns_per_stage: Sequence[Sequence[str]], *, name: str = "manual") -> Plan:
    """``fqns_per_stage`` (module names per stage, torchtitan's form) as a checked, costed plan
    for ``planner``'s model and devices (stage ``s`` on device ``s``).

    A node belongs to the listed module that contains it (the longest name wins); a node of no
    listed module (a residual add, a reshape at the root) joins the latest stage of its inputs,
    or, without inputs, the earliest stage of its users.
    """
    traced = planner.traced
    specs = planner.specs()
    if len(fqns_per_stage) != len(specs):
        raise ConstraintError(
            advice(
                f"the split has {len(fqns_per_stage)} stages for {len(specs)} devices",
                "a manual split puts stage s on device s",
                "give one module list per device",
            )
        )
    owner = {fqn: s for s, fqns in enumerate(fqns_per_stage) for fqn in fqns}
    gm = traced.captured.gm
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    stage: dict[Any, int] = {}
    for n in nodes:
        path = traced.captured.module_paths.get(n.name, "")
        hits = [f for f in owner if path == f or path.startswith(f + ".")]
        if hits:
            stage[n] = owner[max(hits, key=len)]
    for n in nodes:  # forward: the latest stage among the inputs
        if n not in stage:
            inputs = [stage[u] for u in n.all_input_nodes if u in stage]
            if inputs:
                stage[n] = max(inputs)
    for n in reversed(nodes):  # backward: the earliest stage among the users
        if n not in stage:
            users = [stage[u] for u in n.users if u in stage]
            stage[n] = min(users) if users else 0
    for n in nodes:
        for u in n.all_input_nodes:
            if u in stage and stage[u] > stage[n]:
                raise ConstraintError(
                    advice(
                        f"the split puts {n.name} ({traced.captured.module_paths.get(n.name) or 'root'}) on stage {stage[n]}, "
                        f"before its input {u.name} ({traced.captured.module_paths.get(u.name) or 'root'}) on stage {stage[u]}",
                        "a pipeline's data flows from each stage to later ones only",
                        "list the modules of each stage in execution order",
                    )
                )
    given = Plan(
        assignment={n.name: stage[n] for n in nodes},
        devices=specs,
        stage_devices=tuple(range(len(specs))),
        stages=(),
        step_time=0.0,
        micro_batches=planner.options.micro_batches_for(len(specs)),
        schedule=planner.options.schedule,
        solver=SolverInfo(name=name, status="MANUAL", objective=0.0, bound=0.0, gap=0.0, wall_time=0.0,
                          time_limit=0.0, seed=0),
        fingerprint=traced.fingerprint,
        capture=traced.captured.method,
    )
    made = compile_plan(traced, specs, planner.options, given=given)
    predicted = made.terms.pipeline if made.terms else made.step_time
    return dataclasses.replace(made, made_with=None, solver=dataclasses.replace(made.solver, objective=predicted))
