"""Manual splits as plans: the splits users write today, costed and run like autosplit's own.

Each form becomes a stage per graph node, then a :class:`~autosplit.plans.Plan` checked (every
node placed, data flowing forward only, memory) and costed with the planner's cost model, so
it compares with autosplit's plan and runs on either runtime (:func:`manual_plan` reads them all):

- module names per stage — torchtitan's ``module_fqns_per_model_part`` (:func:`fqn_stages`);
  :func:`torchtitan_fqns` makes its even split of the repeated blocks, the input and output
  modules each weighing one block (``generate_llm_fqn_per_model_part``); :func:`megatron_fqns`
  Megatron's uneven first and last stages;
- ``torch.distributed.pipelining`` split points (:func:`split_point_stages`);
- DeepSpeed ``PipelineModule(partition_method=...)`` over the model's layer list (top-level
  modules, ``ModuleList``/``Sequential`` expanded, in execution order): ``"parameters"``,
  ``"uniform"``, ``"type:REGEX"`` (:func:`deepspeed_fqns`, ``partition_balanced``: the largest
  stage as small as possible);
- torchgpipe's ``balance`` (:func:`balance_fqns`).

Usage::

    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(x,))
    even = plan_from_fqns(planner, torchtitan_fqns(model, 2, repeated="blocks"))
    pipe = autosplit.distribute(model, None, example_inputs=(x,), loss_fn=loss_fn, plan=even)
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from autosplit import schedules
from autosplit.compiler.recost import recost
from autosplit.errors import ConstraintError, advice
from autosplit.plans import Plan, SolverInfo

__all__ = [
    "ManualSplit", "balance_fqns", "deepspeed_fqns", "execution_order", "fqn_stages", "layer_list", "manual_plan",
    "megatron_fqns", "partition", "plan_from_fqns", "split_point_stages", "torchtitan_fqns",
]


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


def layer_list(model: torch.nn.Module, order: Sequence[str] = (), expand: str = "") -> list[str]:
    """The model as DeepSpeed sees a ``PipelineModule``: its top-level modules, containers
    (``ModuleList``, ``Sequential``) expanded, ordered by ``order`` (module paths in execution order);
    the modules on the path to ``expand`` are expanded too (a transformers ``model.layers``)."""
    layers: list[str] = []

    def walk(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) or (expand + ".").startswith(path + "."):
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
    """Module names per stage as DeepSpeed's ``partition_method`` splits them: ``"parameters"``,
    ``"uniform"``, or ``"type:REGEX"`` (layers whose class name matches weigh one, others none)."""
    layers = layer_list(model, order)
    if method == "parameters":
        weights = [float(sum(p.numel() for p in model.get_submodule(layer).parameters())) for layer in layers]
    elif method == "uniform":
        weights = [1.0] * len(layers)
    elif method.startswith("type:"):
        pattern = re.compile(method[len("type:") :], re.IGNORECASE)
        kinds = [type(model.get_submodule(layer)).__name__ for layer in layers]
        weights = [float(bool(pattern.search(kind))) for kind in kinds]
        if not any(weights):
            raise ConstraintError(advice(
                f"partition_method={method!r} matches no layer", "no layer's class name matches the pattern",
                f"match one of the layer classes {sorted(set(kinds))}",
            ))
    else:
        raise ConstraintError(advice(
            f"partition_method={method!r} is not supported",
            "DeepSpeed's methods that need no profile are modelled",
            "use 'parameters', 'uniform' or 'type:REGEX'",
        ))
    return [layers[a:b] for a, b in partition(weights, stages)]


def _blocks(layers: list[str], repeated: str) -> list[str]:
    blocks = [layer for layer in layers if layer.startswith(repeated + ".")]
    if not blocks:
        raise ConstraintError(advice(
            f"no repeated blocks under {repeated!r}", "no layer of the model is named under it",
            f"name the ModuleList, one of {layers[:6]}",
        ))
    return blocks


def torchtitan_fqns(
    model: torch.nn.Module, stages: int, *, repeated: str, input_weight: int = 1, output_weight: int = 1,
    order: Sequence[str] = (),
) -> list[list[str]]:
    """torchtitan's even split (``generate_llm_fqn_per_model_part``): the blocks of ``repeated``
    (e.g. ``"layers"``) and the modules before and after them, weighing ``input_weight`` and
    ``output_weight`` blocks, dealt out evenly — the first stages take one more when they do not
    divide — the first stage's share less the input weight, the last stage's less the output weight."""
    layers = layer_list(model, order, expand=repeated)
    blocks = _blocks(layers, repeated)
    first, last = layers.index(blocks[0]), layers.index(blocks[-1])
    if stages == 1:
        return [layers]
    per, extra = divmod(len(blocks) + input_weight + output_weight, stages)
    if per < max(1, input_weight, output_weight):
        raise ConstraintError(advice(
            f"torchtitan's split of {len(blocks)} blocks (input weight {input_weight}, output weight {output_weight}) "
            f"into {stages} stages leaves {per} per stage",
            "every stage needs at least one block's share, and no less than the input and output weights",
            "fewer stages, or smaller input_weight/output_weight",
        ))
    out, taken = [], 0
    for s in range(stages):
        share = per + (s < extra) - (input_weight if s == 0 else 0) - (output_weight if s == stages - 1 else 0)
        take = blocks[taken:] if s == stages - 1 else blocks[taken:taken + share]
        taken += len(take)
        out.append([*(layers[:first] if s == 0 else []), *take, *(layers[last + 1:] if s == stages - 1 else [])])
    return out


def megatron_fqns(
    model: torch.nn.Module, stages: int, *, repeated: str, first: int | None = None, last: int | None = None,
    order: Sequence[str] = (),
) -> list[list[str]]:
    """Megatron-style uneven first and last stages: ``first`` (``last``) blocks of ``repeated`` on
    the first (last) stage — with the input (output) modules — and the rest evenly over the
    stages between (``num_layers_in_first_pipeline_stage`` / ``..._last_...``; like Megatron, the
    middle blocks must divide evenly)."""
    layers = layer_list(model, order)
    blocks = _blocks(layers, repeated)
    middle_stages = stages - (first is not None) - (last is not None)
    rest = len(blocks) - (first or 0) - (last or 0)
    if stages < 2 or middle_stages < 0 or rest < 0 or (middle_stages and rest % middle_stages) or (not middle_stages and rest):
        raise ConstraintError(advice(
            f"cannot give the first stage {first} and the last {last} of {len(blocks)} blocks, "
            f"the other {rest} evenly over {middle_stages} stages",
            "Megatron splits the blocks between the first and last stages evenly",
            "choose first/last so the remaining blocks divide by the stages between them",
        ))
    per = rest // middle_stages if middle_stages else 0
    counts = ([first] if first is not None else []) + [per] * middle_stages + ([last] if last is not None else [])
    cuts = itertools.accumulate(counts, initial=0)
    head, tail = layers[: layers.index(blocks[0])], layers[layers.index(blocks[-1]) + 1 :]
    out = [blocks[a:b] for a, b in itertools.pairwise(cuts)]
    out[0], out[-1] = head + out[0], out[-1] + tail
    return out


def balance_fqns(model: torch.nn.Module, balance: Sequence[int], order: Sequence[str] = ()) -> list[list[str]]:
    """torchgpipe's ``balance``: the number of consecutive layers on each stage, over a
    ``nn.Sequential``'s children (or, for another model, its layer list as :func:`layer_list`)."""
    layers = list(dict(model.named_children())) if isinstance(model, torch.nn.Sequential) else layer_list(model, order)
    if any(int(b) != b or b < 1 for b in balance) or sum(balance) != len(layers):
        raise ConstraintError(advice(
            f"balance {list(balance)} sums to {sum(balance)} layers, but the model has {len(layers)} ({layers[:4]} …)",
            "torchgpipe's balance counts every layer once, at least one per stage",
            f"give positive counts that sum to {len(layers)}",
        ))
    return [layers[a:b] for a, b in itertools.pairwise(itertools.accumulate(map(int, balance), initial=0))]


def _nodes(traced: Any) -> list[Any]:
    return [n for n in traced.captured.gm.graph.nodes if n.op not in ("placeholder", "output")]


def _unknown_module(traced: Any, name: str, what: str) -> ConstraintError:
    """A module name that matches no node: inside a module the capture keeps whole, or unknown."""
    paths = {p for p in traced.captured.module_paths.values() if p}
    whole = sorted((p for p in paths if name.startswith(p + ".")), key=len)
    if whole:
        return ConstraintError(advice(
            f"{what} {name!r} is inside {whole[-1]!r}, which the capture keeps as one node (a torch.nn module "
            "is traced as a leaf)",
            "a split can only fall between the graph's nodes",
            f"split at {whole[-1]!r} itself, or at a module beside it",
        ))
    close = difflib.get_close_matches(name, sorted(paths), n=3)
    return ConstraintError(advice(
        f"{what} {name!r} names no module of the captured graph",
        "the name is misspelt, or the module is not called in forward",
        f"use a module path such as {close or sorted(paths)[:3]}",
    ))


def fqn_stages(traced: Any, fqns_per_stage: Sequence[Sequence[str]]) -> dict[str, int]:
    """Node name → stage for module names per stage (torchtitan's form).

    A node belongs to the listed module that contains it (the longest name wins); a node of no
    listed module (a residual add, a reshape at the root) joins the latest stage of its inputs,
    or, without inputs, the earliest stage of its users.
    """
    paths = traced.captured.module_paths
    owner: dict[str, int] = {}
    for s, fqns in enumerate(fqns_per_stage):
        for fqn in fqns:
            if fqn in owner:
                raise ConstraintError(advice(
                    f"module {fqn!r} is listed on stages {owner[fqn]} and {s}", "each module runs on one stage",
                    "list every module once",
                ))
            owner[fqn] = s
    nodes = _nodes(traced)
    for fqn in owner:
        if not any(paths.get(n.name, "") == fqn or paths.get(n.name, "").startswith(fqn + ".") for n in nodes):
            raise _unknown_module(traced, fqn, "module")
    stage: dict[Any, int] = {}
    for n in nodes:
        path = paths.get(n.name, "")
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
                raise ConstraintError(advice(
                    f"the split puts {n.name} ({paths.get(n.name) or 'root'}) on stage {stage[n]}, "
                    f"before its input {u.name} ({paths.get(u.name) or 'root'}) on stage {stage[u]}",
                    "a pipeline's data flows from each stage to later ones only",
                    "list the modules of each stage in execution order",
                ))
    return {n.name: s for n, s in stage.items()}


def split_point_stages(traced: Any, split_spec: Mapping[str, Any] | Sequence[str]) -> dict[str, int]:
    """Node name → stage for ``torch.distributed.pipelining`` split points: ``{"blocks.4":
    SplitPoint.BEGINNING}`` cuts the graph before the module's first node, ``SplitPoint.END``
    after its last; plain module names (a list) mean ``BEGINNING``. As in ``pipeline()``, the cut
    falls in the graph's (execution) order."""
    spec = dict(split_spec) if isinstance(split_spec, Mapping) else dict.fromkeys(split_spec, "beginning")
    paths = traced.captured.module_paths
    nodes = _nodes(traced)
    cuts = []
    for name, point in spec.items():
        where = str(getattr(point, "name", point) or "beginning").lower()
        if where not in ("beginning", "end"):
            raise ConstraintError(advice(
                f"split point {name!r}: {point!r} is not BEGINNING or END",
                "torch.distributed.pipelining's SplitPoint has these two values",
                "use SplitPoint.BEGINNING, SplitPoint.END, or the strings 'beginning' / 'end'",
            ))
        inside = [i for i, n in enumerate(nodes) if paths.get(n.name, "") == name or paths.get(n.name, "").startswith(name + ".")]
        if not inside:
            raise _unknown_module(traced, name, "split point")
        cut = inside[0] if where == "beginning" else inside[-1] + 1
        if not 0 < cut < len(nodes):
            raise ConstraintError(advice(
                f"split point {name!r} ({where}) falls at the {'start' if cut == 0 else 'end'} of the graph",
                "it would leave a stage with no work", "split between two modules of the model",
            ))
        cuts.append((cut, name))
    cuts.sort()
    for (a, first), (b, second) in itertools.pairwise(cuts):
        if a == b:
            raise ConstraintError(advice(
                f"split points {first!r} and {second!r} cut the graph at the same place",
                "the stage between them would be empty", "drop one of them",
            ))
    return {n.name: bisect.bisect_right([c for c, _ in cuts], i) for i, n in enumerate(nodes)}


ManualSplit = Plan | str | Mapping[str, Any] | Sequence[int] | Sequence[str] | Sequence[Sequence[str]]
"""Every form :func:`manual_plan` reads: a plan; a DeepSpeed ``partition_method``; pipelining
split points (a mapping, or a list of module names); a torchgpipe ``balance`` (a list of
ints); module names per stage (torchtitan's ``module_fqns_per_model_part``)."""


def execution_order(traced: Any) -> list[str]:
    """Module paths in the order the graph first computes in them (reads of weights left out:
    torch.export lifts them all to the front, in the parameters' order)."""
    paths = traced.captured.module_paths
    return list(dict.fromkeys(paths[n.name] for n in traced.captured.gm.graph.nodes
                              if n.op not in ("placeholder", "get_attr", "output") and paths.get(n.name)))


def manual_plan(planner: Any, split: ManualSplit, *, name: str = "manual", check_memory: bool = True) -> Plan:
    """``split``, in any form users write one, as a checked plan costed by ``planner``'s cost model
    (stage ``s`` on device ``s``). ``check_memory=False`` returns a plan over a cap instead of
    raising (its stages show by how much)."""
    model, S = planner.model, len(planner.specs()) * planner.options.rank_stages
    order = execution_order(planner.traced)
    if isinstance(split, Plan):  # re-costed under the planner's options, as every other candidate
        return _costed(planner, split.stage_of, name, check_memory, split.stage_devices)
    if isinstance(split, str):
        stage = fqn_stages(planner.traced, deepspeed_fqns(model, S, split, order))
    elif isinstance(split, Mapping):
        stage = split_point_stages(planner.traced, split)
    elif split and all(isinstance(x, int) for x in split):
        stage = fqn_stages(planner.traced, balance_fqns(model, list(split), order))  # type: ignore[arg-type]
    elif split and all(isinstance(x, str) for x in split):
        stage = split_point_stages(planner.traced, list(split))  # type: ignore[arg-type]
    elif split and all(isinstance(x, (list, tuple)) and all(isinstance(f, str) for f in x) for x in split):
        stage = fqn_stages(planner.traced, split)  # type: ignore[arg-type]
    else:
        raise ConstraintError(advice(
            f"manual split {name!r} of type {type(split).__name__} is not a form autosplit reads",
            "a manual split is a Plan, a DeepSpeed partition_method, split points, a balance list or module lists",
            "e.g. 'parameters', {'blocks.4': SplitPoint.BEGINNING}, [3, 3], [['wte', 'blocks.0'], ['blocks.1', 'head']]",
        ))
    return _costed(planner, stage, name, check_memory)


def plan_from_fqns(planner: Any, fqns_per_stage: Sequence[Sequence[str]], *, name: str = "manual") -> Plan:
    """``fqns_per_stage`` (module names per stage, torchtitan's form) as a checked, costed plan
    for ``planner``'s model and devices (stage ``s`` on device ``s``); see :func:`fqn_stages`."""
    return manual_plan(planner, [list(fqns) for fqns in fqns_per_stage], name=name)


def _costed(
    planner: Any, stage: Mapping[str, int], name: str, check_memory: bool, stage_devices: Sequence[int] | None = None
) -> Plan:
    """A stage per node as a plan (stage ``s`` on device ``stage_devices[s]``; by default ``s``, or
    with several stages per rank where the schedule places it), validated and costed on the same
    footing as autosplit's."""
    traced, specs, options = planner.traced, planner.specs(), planner.options
    v = options.rank_stages
    S = len(specs) * v
    if stage_devices is not None:
        order = tuple(stage_devices)
    else:
        order = tuple(schedules.lookup(options.schedule).rank_of(s, S, len(specs)) for s in range(S))
    used = sorted(set(stage.values()))
    if used != list(range(S)) or len(order) != S:
        raise ConstraintError(advice(
            f"split {name!r} fills stages {used} for {len(specs)} devices × {v} stage(s) per device",
            f"a manual split gives every stage a non-empty part, {v} per device as the {options.schedule} schedule places them",
            f"give exactly {S} non-empty stages",
        ))
    given = Plan(
        assignment={node: s if v > 1 else order[s] for node, s in stage.items()},
        devices=specs,
        stage_devices=order,
        stages=(),
        step_time=0.0,
        micro_batches=planner.options.micro_batches_for(len(specs), traced.batch),
        schedule=planner.options.schedule,
        precision=planner.options.precision,
        stages_per_rank=v,
        objective="pipeline",
        solver=SolverInfo(name=name, status="MANUAL", objective=0.0, bound=0.0, gap=0.0, wall_time=0.0,
                          time_limit=0.0, seed=0),
        fingerprint=traced.fingerprint,
        capture=traced.captured.method,
    )
    made = recost(traced, specs, planner.options, given, check_memory=check_memory, decide_recompute=True)
    return dataclasses.replace(made, made_with=None)
