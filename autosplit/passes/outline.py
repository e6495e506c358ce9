"""Outlining: each repeated block of a graph (a decoder layer, ``model.layers.3``) as one module the
graph calls, so that FSDP2 can make it a unit of its own (DESIGN §4.9: torchtitan wraps each block).

A graph captured by ``torch.export`` reads every parameter by name (``get_attr``) and runs ATen ops:
FSDP2's hooks, which run around a module's ``forward``, never fire inside it, and the whole stage
would be one unit, gathered for the whole step. :func:`outline_blocks` replaces a block's nodes in a
stage ``GraphModule`` by one ``call_module`` to a sub-``GraphModule`` installed at the block's own path,
whose ``get_attr`` targets are relative to it: every parameter and buffer keeps its qualified name and
its object (``named_parameters()``, state dicts, DCP checkpoints and the optimizer see the same), and
the block's values are the sub-module's outputs, by position.

A *block* is the shallowest module on a node's path that is an indexed child (``layers.3``, ``h.0``:
a ``ModuleList``'s or ``Sequential``'s, the repeated layers); its nodes are those whose module path
lies in it (a ``get_attr``'s: the module owning the tensor it reads). :func:`outlinable_blocks` is the
one predicate the runtime (:func:`outline_blocks`) and the cost model
(:func:`autosplit.passes.costs.estimate`'s ``unit_params``) share. It refuses, leaving the block in its
stage's own unit, a block:

- whose nodes read a tensor outside it by name, or whose tensors a node outside reads (a tied weight);
- whose outputs, or views of them, a node outside writes in place (FSDP2's pre-backward hook on
  them would be dropped: :func:`autosplit.passes.outline.written_views`);
- whose container holds a parameter or buffer its nodes do not read (an exported graph's read that
  nothing uses counts: the unit holds it), or one the graph holds under another name too (it would
  vanish from, or be doubled in, the state dict);
- whose nodes (attribute reads aside, which have no inputs and may sit anywhere) are not one
  contiguous run of the graph: a contiguous run is an acyclic partition (a path out of it and back in
  would pass a node between its ends).

A block already a single module the graph calls (a symbolically traced leaf) is left as it is: it is
a unit candidate as it stands (:func:`autosplit.passes.outline.unit_targets`).

Recomputed blocks (activation checkpointing, :mod:`autosplit.passes.recompute_regions`): a region is
its stage's ``get_attr`` of the region module, one ``checkpoint`` call and a ``getitem`` per output,
marked with :data:`~autosplit.passes.recompute_regions.REGION_BLOCK`. They are outlined *around* the
region: the unit's graph calls the checkpoint, and the region module moves into the unit (it holds no
state), so the unit's parameters are gathered when its recomputation in the backward runs (FSDP2's
pre-backward hook fires on the unit's outputs before the checkpoint's backward), as torchtitan's
checkpointed blocks inside FSDP units are.

Usage::

    units = outline_blocks(stage)          # ["model.layers.0", "model.layers.1", ...]
    why = refused_blocks(stage)            # {"model.layers.5": "reads model.embed.weight, ..."}
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from autosplit.errors import CodegenError, advice
from autosplit.passes.capture import module_path
from autosplit.passes.recompute_regions import REGION_BLOCK, written_inputs

__all__ = [
    "block_path", "node_path", "outlinable_blocks", "outline_blocks", "refused_blocks", "unit_modules", "unit_targets", "written_views",
]

log = logging.getLogger(__name__)


def block_path(path: str) -> str:
    """The block a module path lies in: its shallowest prefix ending in an index (``model.layers.3`` of
    ``model.layers.3.mlp.up_proj``), or ``""``."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def node_path(gm: fx.GraphModule, node: fx.Node) -> str:
    """The module path of ``node``: a recompute region's block, else the path annotate recorded, else
    capture's (:func:`~autosplit.passes.capture.module_path`; ``""`` for nodes codegen made)."""
    if REGION_BLOCK in node.meta:
        return str(node.meta[REGION_BLOCK])
    info = node.meta.get("autosplit")
    return str(info.module_path) if info is not None else module_path(node)


def _members(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Each block's nodes, in graph order. An attribute read nothing uses is one too: torch.export keeps
    one per parameter, used or not, and the unit holds it (a stage, whose code never has one, holds
    such a tensor apart, at its root: :func:`~autosplit.runtime.placement.keep_unread`)."""
    members: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        block = block_path(node_path(gm, n))
        if block:
            members.setdefault(block, []).append(n)
    return members


def _targets(gm: fx.GraphModule, members: Sequence[fx.Node]) -> list[str]:
    """The qualified names the block's nodes read, its regions' reads included (a region's code reads
    its stage's modules and tensors)."""
    targets: list[str] = []
    for n in members:
        if n.op not in ("get_attr", "call_module"):
            continue
        value = operator.attrgetter(str(n.target))(gm)
        if REGION_BLOCK in n.meta and isinstance(value, fx.GraphModule):
            targets += [str(r.target) for r in value.graph.nodes if r.op in ("get_attr", "call_module")]
        else:
            targets.append(str(n.target))
    return list(dict.fromkeys(targets))


def _tensors(value: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.nn.Module):
        return [*value.named_parameters(remove_duplicate=False), *value.named_buffers(remove_duplicate=False)]
    return [("", value)] if isinstance(value, torch.Tensor) else []


def _state_refusal(gm: fx.GraphModule, block: str, members: Sequence[fx.Node], names: Mapping[int, list[str]]) -> str:
    """Why the block's container cannot become its unit as it stands: a tensor its nodes do not read,
    a name outside it, or a tensor the graph holds under another name too; ``""`` if none."""
    try:
        container = gm.get_submodule(block)
    except AttributeError:
        return f"no module {block!r} holds its tensors"
    read: set[int] = set()
    for target in _targets(gm, members):
        if not (target + ".").startswith(block + "."):
            return f"its code reads {target}, outside it"
        read.update(id(t) for _, t in _tensors(operator.attrgetter(target)(gm)))
    held = _tensors(container)
    unread = next((name for name, t in held if id(t) not in read), None)
    if unread is not None:
        return f"{block}.{unread} is a parameter or buffer its nodes never read (it would leave the state dict)"
    mine = {id(t) for _, t in held}
    twice = next((name for i in mine for name in names.get(i, ()) if not name.startswith(block + ".")), None)
    return f"its tensor is also {twice} (a tied weight)" if twice is not None else ""


def _refusal(
    gm: fx.GraphModule, block: str, members: Sequence[fx.Node], place: Mapping[fx.Node, int], names: Mapping[int, list[str]],
) -> str:
    """Why ``block`` cannot be outlined, ``""`` if it can (the module docstring's rules)."""
    inside = set(members)
    runs = [place[n] for n in members if n.op != "get_attr"]
    if not runs:
        return "it runs nothing (attribute reads only)"
    if runs != list(range(runs[0], runs[0] + len(runs))):
        return "its nodes are not one contiguous run of the graph"
    outside = next((u for n in members for u in n.all_input_nodes if u not in inside and u.op == "get_attr"), None)
    if outside is not None:
        return f"it reads {outside.target} by name, outside it (a tied weight)"
    leaked = next((n for n in members if n.op == "get_attr" and any(u not in inside for u in n.users)), None)
    if leaked is not None:
        return f"a node outside it reads its {leaked.target} (a tied weight)"
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    if not outputs:
        return "nothing outside it reads its values"
    if written_views(gm, outputs):
        return "a node outside it writes in place into its output (FSDP2's pre-backward hook would be dropped)"
    return _state_refusal(gm, block, members, names)


def _sorted(gm: fx.GraphModule) -> tuple[dict[str, list[fx.Node]], dict[str, str]]:
    """(outlinable block → its nodes, refused block → why)."""
    place = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op != "get_attr")}
    ok: dict[str, list[fx.Node]] = {}
    refused: dict[str, str] = {}
    names: dict[int, list[str]] = {}  # id(tensor) → every name the graph module holds it under
    for name, t in _tensors(gm):
        names.setdefault(id(t), []).append(name)
    for block, members in _members(gm).items():
        if all(n.op == "get_attr" or (n.op == "call_module" and str(n.target) == block) for n in members):
            continue  # already one module the graph calls (or no code): a unit candidate as it stands
        why = _refusal(gm, block, members, place, names)
        if why:
            refused[block] = why
        else:
            ok[block] = members
    return ok, refused


def outlinable_blocks(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """The blocks of ``gm`` that :func:`outline_blocks` makes modules of their own, with their nodes in
    graph order: the one predicate the runtime and the cost model share (the module docstring)."""
    return _sorted(gm)[0]


def refused_blocks(gm: fx.GraphModule) -> dict[str, str]:
    """The blocks of ``gm`` left in their stage's own unit, each with why (the module docstring)."""
    return _sorted(gm)[1]


def outline_blocks(gm: fx.GraphModule) -> list[str]:
    """Replace, in place, each block :func:`outlinable_blocks` accepts by one ``call_module`` to a
    sub-``GraphModule`` at the block's path (same tensors, same names); returns their paths, in order.
    The refused ones are logged and left as they are."""
    ok, refused = _sorted(gm)
    for block, why in refused.items():
        log.info("block %s stays in its stage's own FSDP unit: %s", block, why)
    for block, members in ok.items():
        _outline(gm, block, members)
    if ok:
        gm.graph.lint()
        gm.recompile()
    return list(ok)


def _outline(gm: fx.GraphModule, block: str, members: Sequence[fx.Node]) -> None:
    inside = set(members)
    inputs = list(dict.fromkeys(u for n in members for u in n.all_input_nodes if u not in inside))
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    prefix = block + "."
    sub, local = fx.Graph(), {}
    for u in inputs:
        local[u] = sub.placeholder(u.name)
        local[u].meta = dict(u.meta)
    moved: list[str] = []  # region modules at the stage's root, moved into the unit
    for n in members:
        local[n] = sub.node_copy(n, local.__getitem__)
        if n.op in ("get_attr", "call_module") and not str(n.target).startswith(prefix):
            moved.append(str(n.target))
        elif n.op in ("get_attr", "call_module"):
            local[n].target = str(n.target)[len(prefix):]
    sub.output(tuple(local[n] for n in outputs))
    root = {t[len(prefix):]: operator.attrgetter(t)(gm) for t in _targets(gm, members) if t.startswith(prefix)}
    root.update({t: operator.attrgetter(t)(gm) for t in moved})
    unit = fx.GraphModule(root, sub, class_name="Block" + "".join(p.title() for p in block.replace("_", ".").split(".")))
    container = gm.get_submodule(block)
    _same_state(container, unit, block)
    kept = set(container.state_dict(keep_vars=True))
    for name, t in container.named_buffers():  # a non-persistent buffer stays out of the state dict
        if name not in kept:
            owner, _, leaf = name.rpartition(".")
            unit.get_submodule(owner).register_buffer(leaf, t, persistent=False)
    parent, _, leaf = block.rpartition(".")
    setattr(gm.get_submodule(parent), leaf, unit)
    for target in moved:
        delattr(gm, target)
    last = next(n for n in reversed(members) if n.op != "get_attr")  # members are in graph order
    with gm.graph.inserting_after(last):
        call = gm.graph.call_module(block, tuple(inputs))
    previous = call
    for i, n in enumerate(outputs):
        with gm.graph.inserting_after(previous):
            previous = gm.graph.call_function(operator.getitem, (call, i))
        previous.meta = {k: v for k, v in n.meta.items() if k not in ("autosplit", "nn_module_stack", REGION_BLOCK)}
        n.replace_all_uses_with(previous, delete_user_cb=lambda user: user not in inside)
    for n in reversed(members):
        gm.graph.erase_node(n)


def _same_state(container: torch.nn.Module, unit: torch.nn.Module, block: str) -> None:
    """The unit holds exactly the container's tensors, by name and object (what the predicate checked)."""
    before = {(name, id(t)) for name, t in _tensors(container)}
    after = {(name, id(t)) for name, t in _tensors(unit)}
    if before != after:
        raise CodegenError(advice(
            f"outlining block {block!r} would change its tensors: {sorted(n for n, _ in before ^ after)[:4]}",
            "the block's nodes read other tensors than its module holds", "report this graph to autosplit",
        ))


def unit_modules(module: torch.nn.Module, tables: Sequence[torch.nn.Parameter] = ()) -> list[torch.nn.Module]:
    """The modules :func:`unit_targets` names."""
    return [module.get_submodule(name) for name in unit_targets(module, tables)]


def unit_targets(module: torch.nn.Module, tables: Sequence[torch.nn.Parameter] = ()) -> list[str]:
    """The modules of a graph that can be FSDP units of their own, by target: the modules it calls
    (``call_module``: FSDP2's hooks run around their forward; a block
    :func:`~autosplit.passes.outline.outline_blocks` made a module is one) that own parameters no other
    module holds and the graph reads nowhere else (``get_attr``: a tied weight read by name is gathered
    with the stage's own unit), nor a sparse-gradient table (``tables``). Empty for a module that is not
    an fx graph, and for an exported one not outlined (it reads every parameter by name)."""
    if not isinstance(module, fx.GraphModule):
        return []
    called = {str(n.target) for n in module.graph.nodes if n.op == "call_module"}
    read = {str(n.target) for n in module.graph.nodes if n.op == "get_attr"}
    owners: dict[int, int] = {}
    for _, sub in module.named_modules(remove_duplicate=False):
        for p in sub.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    apart = {id(t) for t in tables}
    for name in read:
        try:
            apart.add(id(module.get_parameter(name)))
        except AttributeError:  # a buffer or a constant
            continue
    written = _written_views(module)
    units = []
    for name in sorted(called):
        sub = module.get_submodule(name)
        own = list(sub.parameters())
        if own and name not in written and not any(owners.get(id(p), 0) > 1 or id(p) in apart for p in own):
            units.append(name)
    return units


_VIEWS = frozenset({
    "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "expand_as",
    "contiguous", "t", "narrow", "select", "split", "chunk", "unbind", "view_as", "getitem", "movedim", "as_strided",
    "detach", "type_as", "to", "float", "half", "bfloat16", "double", "swapaxes", "diagonal", "real", "imag", "split_with_sizes",
})


def written_views(gm: fx.GraphModule, producers: Sequence[fx.Node]) -> list[fx.Node]:
    """The nodes of ``producers`` (a module's call, or an outlined block's outputs) whose output, or a
    view of it, some node writes in place: FSDP2 hooks a unit's output for its backward, and a write in
    place into it drops the hook (the unit would not be gathered for its backward), so such a module is
    no unit of its own."""
    def is_view(n: fx.Node) -> bool:
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        return str(name).split(".")[0] in _VIEWS

    hit = []
    for n in producers:
        aliases, todo = {n}, [n]
        while todo:
            for user in todo.pop().users:
                if user not in aliases and user.op in ("call_method", "call_function") and is_view(user):
                    aliases.add(user)
                    todo.append(user)
        if any(set(written_inputs(gm, user)) & aliases for a in aliases for user in a.users):
            hit.append(n)
    return hit


def _written_views(gm: fx.GraphModule) -> set[str]:
    """The targets of the modules the graph calls whose output some node writes in place (:func:`written_views`)."""
    return {str(n.target) for n in written_views(gm, [n for n in gm.graph.nodes if n.op == "call_module"])}
