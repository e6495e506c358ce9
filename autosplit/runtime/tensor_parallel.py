"""Tensor parallelism on the mesh's ``tp`` dimension: a stage's parameters as DTensors, its forward
run by DTensor's sharding propagation, plain tensors at its boundary.

Each rank's stage module (an fx graph: ``symbolic_trace``'s with ``call_module`` leaves, or
``torch.export``'s ATen ops reading parameters by name) keeps its code; only its parameters change.
:func:`parallelize_stage` makes every parameter a DTensor on ``mesh["tp"]``: ``Shard(d)`` for the names
the plan's :attr:`~autosplit.plans.Plan.tp_shards` lists (0: a column-parallel Linear's weight and bias,
a vocab-parallel embedding; 1: a row-parallel Linear's weight), ``Replicate()`` for every other. The
graph's global shapes stay valid (a ``view(b, s, n_heads, head_dim)`` with constants): DTensor
propagates the placements through each op and inserts the collectives torch's rules choose; a
row-parallel product's partial sum is reduced right after it, as torchtitan's ``RowwiseParallel`` does
(:func:`_reduce_partial_sums`). Around each forward:

- every tensor input (tokens, masks, the previous stage's activations) enters as a ``Replicate``
  DTensor (``DTensor.from_local``: its gradient is reduced to a whole one in backward, so the
  previous stage receives the same plain gradient on every tp rank);
- tensors the graph makes itself (``arange``, masks, constants) and buffers are replicated implicitly
  (:func:`tp_scope`, around the whole step: forward and backward);
- every DTensor output is redistributed to ``Replicate`` and handed on as its local tensor, so torch's
  pipelining exchanges plain tensors between stages, as ``PipelineStage`` does on a mesh.

The order per stage is torchtitan's: tensor parallelism, then compile, then FSDP2 (``fully_shard``
over ``mesh["dp_shard"]`` composes with the tp DTensors: both meshes come from one root mesh).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autosplit.compat import ASSERT_TENSOR_METADATA
from autosplit.errors import ConstraintError, advice

__all__ = [
    "Reductions", "check_tp_shards", "parallelize_stage", "place_gradients", "replicate_partial", "stage_shards", "to_token_shards",
    "to_whole", "tp_scope",
]


def check_tp_shards(model: torch.nn.Module, shards: Mapping[str, int], tp: int) -> None:
    """Refuse (:class:`ConstraintError`, on every rank alike) a ``tp_shards`` entry that names no
    parameter of ``model`` or a dimension its tensor does not have, and a tied weight split one way
    under one name and another way under another."""
    if tp <= 1:
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    unknown = sorted(set(shards) - set(params))
    if unknown:
        raise ConstraintError(advice(
            f"the plan's tp_shards name {len(unknown)} parameter(s) the model does not have: {unknown[:5]}",
            "tp_shards maps the model's own parameter names (model.named_parameters()) to the dimension split over tp",
            "name the model's parameters (e.g. 'blocks.0.fc.weight'), or re-plan for this model",
        ))
    short = {name: (d, params[name].dim()) for name, d in shards.items() if d >= params[name].dim()}
    if short:
        name, (d, ndim) = next(iter(short.items()))
        raise ConstraintError(advice(
            f"tp_shards splits {name!r} along dimension {d}, and it has {ndim}",
            "a bias is split along 0 with its column-parallel weight; a row-parallel weight along 1",
            f"split {name!r} along a dimension below {ndim}, or leave it out (replicated)",
        ))
    by_tensor: dict[int, dict[str, int | None]] = {}
    for name, p in params.items():
        by_tensor.setdefault(id(p), {})[name] = shards.get(name)
    for names in by_tensor.values():
        if len(set(names.values())) > 1:
            raise ConstraintError(advice(
                f"the tied parameter {sorted(names)} is split differently under its names: {names}",
                "one tensor has one placement on the tp mesh",
                "give every name of a tied weight the same entry in tp_shards (or none)",
            ))


def stage_shards(shards: Mapping[str, int], tensors: Mapping[str, str]) -> dict[str, int]:
    """The plan's ``tp_shards`` (model names) as this stage's local names (``tensors``: model name →
    local name, :attr:`~autosplit.runtime.materialise.StageNames.tensors`)."""
    return {tensors[name]: d for name, d in shards.items() if name in tensors}


@dataclass(frozen=True)
class Reductions:
    """Where a stage graph reduces its partial sums: after ``reduced`` (row-parallel outputs and lookups),
    all-reduced (:func:`_reduce_partial_sums`); under ``sequence`` parallelism reduce-scattered along the
    tokens instead, and all-gathered whole after ``gathered`` (each column-parallel group's input:
    :func:`_split_sequence`). Node names of the captured graph
    (:class:`~autosplit.passes.tensor_parallel.TensorParallelRules`' collectives)."""

    reduced: frozenset[str]
    gathered: frozenset[str]
    sequence: bool = False


def parallelize_stage(module: torch.nn.Module, tp_mesh: Any, shards: Mapping[str, int], reductions: Reductions | None = None) -> None:
    """Every parameter of ``module`` (local names; a tensor held under several names replaced once, under
    all of them) a DTensor on ``tp_mesh``: ``Shard(shards[name])`` or ``Replicate()``; and hooks that run
    its forward on DTensors with plain tensors in and out (module docstring); ``reductions``: where its
    partial sums are reduced (under sequence parallelism, the activations between the split layers
    sharded along the tokens)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    made: dict[int, torch.nn.Parameter] = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) not in made:
            placement = Shard(shards[name]) if name in shards else Replicate()
            made[id(p)] = torch.nn.Parameter(distribute_tensor(p.detach(), tp_mesh, [placement]), p.requires_grad)
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, made[id(p)])
    for graph_module in [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]:  # outlined blocks too
        _drop_metadata_asserts(graph_module)
        _reduce_after_lookups(graph_module)
        if reductions is not None:
            (_split_sequence if reductions.sequence else _reduce_partial_sums)(graph_module, reductions)
    _boundary_hooks(module, tp_mesh)


def _drop_metadata_asserts(module: torch.nn.Module) -> list[str]:
    """Erase the ``aten._assert_tensor_metadata`` nodes of a ``torch.export`` stage graph (what a
    ``.to(dtype)`` leaves behind: a check of its input's dtype, no output): DTensor has no sharding
    strategy for the op (torch 2.13: "Operator aten._assert_tensor_metadata.default does not have a
    sharding strategy registered") and would refuse the forward. The check is the capture's, which
    already held; nothing the stage computes changes. Returns the erased nodes' names."""
    if not isinstance(module, torch.fx.GraphModule):
        return []
    graph, target = module.graph, ASSERT_TENSOR_METADATA
    erased = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is target and not node.users:
            erased.append(node.name)
            graph.erase_node(node)
    if erased:
        module.recompile()
    return erased


def replicate_partial(t: Any) -> Any:
    """``t`` with every partial placement reduced (a DTensor redistributed to ``Replicate`` on those mesh
    dimensions); anything else as it is. Called by the stage graph after each embedding lookup."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor) or not any(p.is_partial() for p in t.placements):
        return t
    placements = [Replicate() if p.is_partial() else p for p in t.placements]
    whole = t.redistribute(t.device_mesh, placements)
    # The gradient coming back is reduced to these placements before it reaches the redistribution
    # (from_local's backward), whose own backward would otherwise have to turn a partial-sum gradient
    # into the lookup's _MaskPartial, which torch 2.13 refuses ("Redistribution from one partial type
    # (P(sum)) to another (MaskP(...)) is unsupported"); a Replicate gradient it keeps as it is.
    return DTensor.from_local(whole.to_local(grad_placements=placements), t.device_mesh, placements, run_check=False)


def _reduce_after_lookups(module: torch.nn.Module) -> list[str]:
    """After each embedding lookup of the stage graph (``aten.embedding``, ``F.embedding`` or an
    ``nn.Embedding`` leaf), a call of :func:`replicate_partial` that its users read instead.

    A vocabulary-parallel table (``Shard(0)``) looks up a ``_MaskPartial`` result, which DTensor reduces
    correctly only at once: added to another partial sum (Llama's residual ``embedding + o_proj(...)``,
    a row-parallel product), torch 2.13 fails in ``_MaskPartial._reduce_value`` (a bare
    ``AssertionError``: the mask it kept is gone). torch's own ``parallelize_module`` reduces there
    (``RowwiseParallel`` on an embedding outputs ``Replicate``); so does this: the same all-reduce,
    one op earlier, and the same values. Returns the names of the lookups."""
    if not isinstance(module, torch.fx.GraphModule):
        return []
    graph = module.graph
    lookups = {torch.ops.aten.embedding.default, torch.nn.functional.embedding, torch.embedding}
    found = []
    for node in list(graph.nodes):
        leaf = node.op == "call_module" and isinstance(module.get_submodule(node.target), torch.nn.Embedding)
        if not (leaf or (node.op == "call_function" and node.target in lookups)):
            continue
        _call_after(graph, node, replicate_partial)
        found.append(node.name)
    if found:
        module.recompile()
    return found


def to_token_shards(t: Any) -> Any:
    """``t`` (a DTensor holding a partial sum or a whole tensor) sharded along its tokens — the dimension
    before the features — over tp: a reduce-scatter of a row-parallel product (torchtitan's
    ``RowwiseParallel(output_layouts=Shard(1))``); anything else (a vocabulary-parallel head's logits) as it is."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor) or t.ndim < 2 or not all(p.is_partial() or p.is_replicate() for p in t.placements):
        return t
    return t.redistribute(t.device_mesh, [Shard(t.ndim - 2)] * len(t.placements))


def to_whole(t: Any) -> Any:
    """``t`` whole on every tp rank where it is sharded along its tokens: the all-gather before a
    column-parallel group (torchtitan's ``ColwiseParallel(input_layouts=Shard(1))``)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor) or not any(p.is_shard(t.ndim - 2) for p in t.placements):
        return t
    return t.redistribute(t.device_mesh, [Replicate()] * len(t.placements))


def _reduce_partial_sums(module: torch.fx.GraphModule, reductions: Reductions) -> list[str]:
    """A call of :func:`replicate_partial` after each node of ``reductions.reduced`` (a lookup has its own,
    :func:`_reduce_after_lookups`), which its users read instead: torchtitan's ``RowwiseParallel``
    (``output_layouts=Replicate()``). Left to DTensor (torch 2.13), a row-parallel product's partial sum
    stays partial through every op linear in it — the residual add, the next norm's scaling — and the next
    layer's column-parallel linears, reading a partial input, gather their weights and compute whole.
    Returns the nodes reduced."""
    graph, reduced = module.graph, []
    for node in list(graph.nodes):
        if node.name in reductions.reduced and not (len(node.users) == 1 and next(iter(node.users)).target is replicate_partial):
            _call_after(graph, node, replicate_partial)
            reduced.append(node.name)
    if reduced:
        module.recompile()
    return reduced


def _split_sequence(module: torch.fx.GraphModule, sequence: Reductions) -> list[str]:
    """Sequence parallelism in the stage graph: a call of :func:`to_token_shards` after each node of
    ``sequence.reduced`` (after the reduction :func:`_reduce_after_lookups` put behind a lookup) and of
    :func:`to_whole` after each of ``sequence.gathered``, which their users read instead. Between them —
    norms, residual adds, dropout — DTensor runs each op on ``1/tp`` of the tokens. Returns the nodes turned.

    Every placement DTensor propagates is exact, so where a graph reads a sharded tensor other than as
    planned, DTensor redistributes it and the values stay the unsplit model's."""
    graph, turned = module.graph, []
    for node in list(graph.nodes):
        turn = to_token_shards if node.name in sequence.reduced else to_whole if node.name in sequence.gathered else None
        if turn is None:
            continue
        after = node
        if turn is to_token_shards and len(node.users) == 1 and next(iter(node.users)).target is replicate_partial:
            after = next(iter(node.users))
        _call_after(graph, after, turn)
        turned.append(node.name)
    if turned:
        module.recompile()
    return turned


def _call_after(graph: torch.fx.Graph, node: torch.fx.Node, function: Any) -> torch.fx.Node:
    """A call ``function(node)`` inserted after ``node``, which every other user of ``node`` reads instead."""
    with graph.inserting_after(node):
        made = graph.call_function(function, (node,))
    node.replace_all_uses_with(made, delete_user_cb=lambda user: user is not made)
    return made


def place_gradients(params: Any) -> int:
    """Every gradient brought to its parameter's placements where DTensor's rules left it elsewhere;
    returns how many. Called once per step, after the schedule's last backward:

    - a replicated parameter read by a split computation gets a ``Partial`` gradient (where a partial sum
      reaches an op other than the reductions :func:`_reduce_partial_sums` puts after the products the
      rules name): reduced here (an all-reduce over ``tp``);
    - a vocabulary-parallel table (``Shard(0)``) can get a ``Replicate`` gradient from the lookup's
      backward: each rank keeps its rows.

    Left as they were, the optimizer would redistribute inside each update, the tied copies' sum
    (:meth:`~autosplit.runtime.flushed.FlushedStep._sum_tied_gradients`, on local tensors) would add a
    whole gradient to a shard, and :meth:`~autosplit.runtime.loop.TrainingLoop.clip_grad_norm_` would
    refuse a partial one."""
    from torch.distributed.tensor import DTensor

    placed = 0
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
            placed += 1
    return placed


def tp_scope(tp: int) -> contextlib.AbstractContextManager[Any]:
    """The scope a step of stages split over ``tp`` ranks runs in, forward and backward:
    ``implicit_replication`` (tensors the graph makes itself, and those its backward saved, as
    ``Replicate``: a GPT's positions from ``arange`` looked up in a replicated table are read again by
    ``embedding_dense_backward``); for ``tp`` 1 nothing. Not re-entrant (torch's flag is a plain bool,
    torch 2.13): the runtime enters it once around each step."""
    if tp <= 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def _boundary_hooks(module: torch.nn.Module, tp_mesh: Any) -> None:
    """Plain tensors in as ``Replicate`` DTensors, DTensors out as whole plain tensors."""
    from torch.distributed.tensor import DTensor, Replicate

    def enter(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            return DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False)
        return t

    def leave(t: Any) -> Any:
        if isinstance(t, DTensor):  # to_local() is a view, which the split backward's detach_() refuses: a copy
            return t.redistribute(tp_mesh, [Replicate()]).to_local().clone()
        return t

    def before(_: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(enter(a) for a in args), {k: enter(v) for k, v in kwargs.items()}

    def after(_: torch.nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, (tuple, list)):
            return type(output)(leave(t) for t in output)
        return leave(output)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)
