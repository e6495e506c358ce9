"""Codegen: an assignment → one ``GraphModule`` per stage, and a program that chains them.

Mechanism only: any assignment (from the solver, a manual split, a loaded file) that
passes ``validate`` can be applied. This module holds the local program, run in one process;
the distributed form, a linear chain of stages, is :mod:`autosplit.passes.chain`, and the
recomputed blocks of both are :mod:`autosplit.passes.recompute_regions`.

- Stage ``s`` gets a graph with one placeholder per value it receives (graph inputs and
  outputs of earlier stages), the nodes assigned to it in their original order, and a
  tuple output of the values later stages or the model's output read. Its attributes
  (leaf modules, parameters, buffers) are the *same objects* as in the captured model,
  under the same qualified names, so no parameter is copied.
- The program keeps the captured graph's placeholders and its codegen (signature,
  defaults, kwargs, pytree flattening of ``torch.export`` graphs), calls the stages in
  order, and moves every value a stage receives to that stage's device with
  :func:`move`. Outputs land on the last stage's device.
- Parameters and buffers are moved in place (``tensor.data``), so ``Parameter`` objects,
  and an optimizer already holding them, stay valid.
- Each stage runs the plan's recomputed blocks under activation checkpointing
  (:mod:`autosplit.passes.recompute_regions`).

Usage::

    program = generate(captured, stage_of_node, devices)
    print(program.stages[0].code)
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autosplit.compat import graph_codegen, pytree, set_graph_codegen
from autosplit.errors import CodegenError, advice
from autosplit.passes.capture import Captured
from autosplit.passes.input_free import copy_closure, input_free
from autosplit.passes.recompute_regions import Regions, attach_regions
from autosplit.plans import PartialRecompute

__all__ = ["Program", "generate", "move", "placed"]

@torch.fx.wrap
def move(value: Any, device: str) -> Any:
    """Send every tensor in ``value`` to ``device`` (autograd carries gradients back)."""
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


@dataclass(frozen=True)
class Program:
    """The generated modules: ``program`` runs ``stages`` in order on ``devices``."""

    program: fx.GraphModule
    stages: tuple[fx.GraphModule, ...]
    devices: tuple[str, ...]


def _stage_graph(
    nodes: Sequence[fx.Node], stage: int, stage_of: Mapping[fx.Node, int], exported: Sequence[fx.Node], regions: Regions,
    free: Collection[str], returned: Sequence[fx.Node] = (),
):
    """Graph of one stage: (graph, received nodes in order, sent nodes in order, regions to attach).
    The input-free values its nodes read, and ``returned`` (input-free outputs of the model, on the
    last stage), it makes itself (:mod:`~autosplit.passes.input_free`)."""
    members = set(nodes)
    received: list[fx.Node] = []
    for n in nodes:
        for u in n.all_input_nodes:
            if u not in members and u.name not in free and u not in received:
                received.append(u)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for u in received:
        env[u] = graph.placeholder(u.name)
        env[u].meta = dict(u.meta)
    copy_closure(graph, [*(u for n in nodes for u in n.all_input_nodes), *returned], free, env)
    pending = regions.copy_nodes(graph, nodes, env)
    sent = [n for n in nodes if n in exported or any(stage_of.get(user, stage) != stage for user in n.users)] + list(returned)
    graph.output(tuple(env[n] for n in sent))
    graph.lint()
    return graph, received, sent, pending


def _place_state(gm: fx.GraphModule, nodes: Sequence[fx.Node], device: str) -> None:
    """Move the parameters and buffers the stage's nodes own to ``device``, in place."""
    tensors: list[torch.Tensor] = []
    for n in nodes:
        if n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            tensors += [*mod.parameters(), *mod.buffers()]
        elif n.op == "get_attr":
            value = operator.attrgetter(str(n.target))(gm)
            if isinstance(value, torch.Tensor):
                tensors.append(value)
    with torch.no_grad():
        for t in tensors:
            if t.device != torch.device(device):
                t.data = t.data.to(device)


def placed(gm: fx.GraphModule, assignment: Mapping[str, int]) -> tuple[list[fx.Node], dict[fx.Node, int]]:
    """The graph's compute nodes and the stage of each, or a typed error if the plan leaves one out."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    missing = [n.name for n in nodes if n.name not in assignment]
    if missing:
        raise CodegenError(advice(
            f"assignment leaves {len(missing)} nodes unplaced (first: {missing[:3]})",
            "the plan was made for another graph, or edited", "validate the plan against this model, or re-plan",
        ))
    return nodes, {n: assignment[n.name] for n in nodes}



def generate(
    captured: Captured, assignment: Mapping[str, int], devices: Sequence[str], *, recompute: Collection[str] = (),
    partial: Sequence[PartialRecompute] = (), selective: bool = False,
) -> Program:
    """Build the stage modules and the program for ``assignment`` (node name → stage index);
    ``recompute``: blocks (module paths) each stage runs under activation checkpointing, ``partial``
    those of them that keep some micro-batches, ``selective``: keeping their matmuls' outputs."""
    gm = captured.gm
    nodes, stage_of = placed(gm, assignment)
    regions = Regions(captured, nodes, recompute, partial, selective)
    output = next(iter(gm.graph.find_nodes(op="output")))
    exported = output.all_input_nodes
    free = input_free(gm)

    program = fx.Graph()
    set_graph_codegen(program, copy.deepcopy(graph_codegen(gm.graph)))
    env: dict[fx.Node, fx.Node] = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        env[ph] = program.node_copy(ph)
    stages = []
    for s, device in enumerate(devices):
        members = [n for n in nodes if stage_of[n] == s and n.name not in free]
        returned = [n for n in exported if n.name in free] if s == len(devices) - 1 else []
        graph, received, sent, pending = _stage_graph(members, s, stage_of, exported, regions, free, returned)
        stage = fx.GraphModule(gm, graph, class_name=f"Stage{s}")
        attach_regions(stage, pending, gm)
        _place_state(gm, members, device)
        stages.append(stage)
        args = tuple(program.call_function(move, (env[u], device)) for u in received)
        call = program.call_module(f"stage{s}", args)
        for i, n in enumerate(sent):  # keep the captured names, so generated code reads like the model
            env[n] = program.create_node("call_function", operator.getitem, (call, i), name=n.name)
    last = devices[-1]
    moved = {n: program.call_function(move, (env[n], last)) for n in output.all_input_nodes}
    program.node_copy(output, lambda n: moved[n])
    program.lint()
    root = torch.nn.Module()
    for s, stage in enumerate(stages):
        root.add_module(f"stage{s}", stage)
    return Program(fx.GraphModule(root, program, class_name="SplitProgram"), tuple(stages), tuple(devices))
