"""Codegen: an assignment → one ``GraphModule`` per stage, and a program that chains them.

Mechanism only: any assignment (from the solver, a manual split, a loaded file) that
passes ``validate`` can be applied.

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

Activation checkpointing (``recompute``, the plan's blocks by module path): within a stage, each
contiguous run of a recomputed block's nodes becomes one *region*, a sub-``GraphModule`` whose
placeholders are the values the run reads from outside it and whose outputs are the values read
after it. The stage calls it as ``torch.utils.checkpoint.checkpoint(self.recompute_h_1, *inputs,
use_reentrant=False)`` — the backward reruns it, with the forward's RNG state, instead of keeping
its activations — and names the results as the nodes they are. A region holds no state: its code
reads its stage's modules, parameters and buffers. A block whose rerun would differ or change state
again (in-place writes into what it reads, running statistics of batch norm in training) is refused.
A block that keeps some micro-batches (``partial``: :class:`~autosplit.plans.PartialRecompute`) is
called as ``recompute_unless_kept(self.recompute_h_1, *inputs, keep=1, window=2)``: the forward of a
micro-batch that keeps its activations calls the region plainly, the others under the checkpoint.
The micro-batch is the one the pipeline stage runs (:func:`micro_batch`); a forward outside one
recomputes.

Usage::

    program = generate(captured, stage_of_node, devices)
    print(program.stages[0].code)
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import difflib
import itertools
import logging
import operator
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint

from autosplit import debug
from autosplit.compat import FakeTensorMode, NormBase, OpOverload, graph_codegen, pytree, set_graph_codegen
from autosplit.compat import copy_attr as _copy_attr  # fx's own copy of an attribute into a GraphModule, containers and all
from autosplit.errors import CodegenError, advice
from autosplit.passes.capture import Captured
from autosplit.plans import PartialRecompute

__all__ = ["Chain", "Program", "generate", "generate_chain", "micro_batch", "move", "recompute_unless_kept", "retarget"]

log = logging.getLogger(__name__)

_MICRO_BATCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("autosplit_micro_batch", default=None)


@contextlib.contextmanager
def micro_batch(index: int) -> Iterator[None]:
    """Run a stage's forward as micro-batch ``index`` of its step (what :func:`recompute_unless_kept` reads)."""
    token = _MICRO_BATCH.set(index)
    try:
        yield
    finally:
        _MICRO_BATCH.reset(token)


def recompute_unless_kept(region: torch.nn.Module, *inputs: Any, keep: int, window: int) -> Any:
    """``region(*inputs)``, kept for the backward if this forward's micro-batch keeps its activations
    (:meth:`PartialRecompute.recomputes`), else under ``torch.utils.checkpoint`` (a forward outside a
    pipeline stage, which sets no micro-batch, recomputes: the plan counted no more)."""
    index = _MICRO_BATCH.get()
    if index is not None and not PartialRecompute("", keep, window).recomputes(index):
        return region(*inputs)
    return torch.utils.checkpoint.checkpoint(region, *inputs, use_reentrant=False)


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
    nodes: Sequence[fx.Node], stage: int, stage_of: Mapping[fx.Node, int], exported: set[fx.Node], regions: _Regions,
):
    """Graph of one stage: (graph, received nodes in order, sent nodes in order, regions to attach)."""
    members = set(nodes)
    received: list[fx.Node] = []
    for n in nodes:
        for u in n.all_input_nodes:
            if u not in members and u not in received:
                received.append(u)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for u in received:
        env[u] = graph.placeholder(u.name)
        env[u].meta = dict(u.meta)
    pending = regions.copy_nodes(graph, nodes, env)
    sent = [n for n in nodes if n in exported or any(stage_of.get(user, stage) != stage for user in n.users)]
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


def _placed(gm: fx.GraphModule, assignment: Mapping[str, int]) -> tuple[list[fx.Node], dict[fx.Node, int]]:
    """The graph's compute nodes and the stage of each, or a typed error if the plan leaves one out."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    missing = [n.name for n in nodes if n.name not in assignment]
    if missing:
        raise CodegenError(advice(
            f"assignment leaves {len(missing)} nodes unplaced (first: {missing[:3]})",
            "the plan was made for another graph, or edited", "validate the plan against this model, or re-plan",
        ))
    return nodes, {n: assignment[n.name] for n in nodes}


# -- activation checkpointing: a recomputed block's nodes in a stage as one region ---------------

_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
    operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
})
"""Python's in-place operators: each writes its first argument."""

_VIEWS = frozenset({
    "getitem", "getattr", "view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "expand", "expand_as",
    "narrow", "select", "squeeze", "unsqueeze", "flatten", "unflatten", "unfold", "as_strided", "diagonal", "detach",
    "split", "split_with_sizes", "chunk", "unbind", "tensor_split", "movedim", "moveaxis", "swapaxes", "swapdims",
    "contiguous", "to", "type", "type_as", "float", "double", "half", "bfloat16", "real", "imag", "view_as_real",
    "view_as_complex",
})
"""Ops that may return their first argument's memory (a view of it, or the tensor itself)."""


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


def _inplace(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``node`` writes its first argument and returns it, by its code: ``x += y``, a method or function
    named ``…_`` (torch's naming), ``inplace=True``, a module with ``inplace`` set."""
    name = _op_name(node)
    return (
        node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True
        or (name.endswith("_") and not name.startswith("_") and name != "requires_grad_")
        or (node.op == "call_module" and getattr(gm.get_submodule(str(node.target)), "inplace", False) is True)
    )


def _written(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The input nodes ``node`` writes in place: as the annotate pass measured them (version
    counters), else read from the code, conservatively (:func:`_inplace`, an ATen op whose schema
    writes, batch norm's running statistics in training)."""
    mutates = getattr(node.meta.get("autosplit"), "mutates", None)
    if mutates is not None:
        return [u for u in node.all_input_nodes if u.name in mutates]
    if isinstance(node.target, OpOverload):
        written: list[fx.Node] = []
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                fx.node.map_arg(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name), written.append)
        return written
    if node.target is torch.nn.functional.batch_norm:
        bound = {**dict(zip(("input", "running_mean", "running_var", "weight", "bias", "training"), node.args)), **node.kwargs}
        stats = (bound.get("running_mean"), bound.get("running_var")) if bound.get("training") else ()
        return [v for v in stats if isinstance(v, fx.Node)]
    first = node.args[0] if node.args else None
    return [first] if isinstance(first, fx.Node) and _inplace(gm, node) else []


def _aliases(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """``node`` and the values whose memory it may be, followed up through views and in-place ops
    (which alias their first argument): what a write into ``node`` writes."""
    chain = [node]
    while True:
        n = chain[-1]
        if isinstance(n.target, OpOverload):
            aliasing = any(r.alias_info is not None for r in n.target._schema.returns)
        else:
            aliasing = _op_name(n) in _VIEWS or _inplace(gm, n)
        first = n.args[0] if aliasing and n.args else None
        if not isinstance(first, fx.Node) or first in chain:
            return chain
        chain.append(first)


@dataclass
class _Pending:
    """A region made while its stage's graph was built; attached once the stage module exists."""

    block: str
    graph: fx.Graph
    call: fx.Node
    """The stage's ``checkpoint`` call, whose first argument becomes the region."""


class _Regions:
    """The plan's recomputed blocks over a captured graph: the block each node belongs to (the
    outermost of ``blocks`` holding its module path), and each stage's runs of a block's nodes
    made into regions (:meth:`copy_nodes`)."""

    def __init__(
        self, captured: Captured, nodes: Sequence[fx.Node], blocks: Collection[str], partial: Sequence[PartialRecompute] = (),
    ):
        self.gm = captured.gm
        self.partial = {p.block: p for p in partial}
        wanted = set(blocks)
        self.block_of: dict[fx.Node, str] = {}
        self.writes: list[tuple[fx.Node, fx.Node]] = []
        held: set[str] = set()  # every module path that holds a node: the blocks one can name
        for n in nodes if wanted else ():
            path = captured.module_paths.get(n.name, "")
            parts = path.split(".") if path else []
            prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            held.update(prefixes)
            block = next((p for p in prefixes if p in wanted), None)
            if block is not None:
                self.block_of[n] = block
        unknown = [b for b in dict.fromkeys(blocks) if b not in held]
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(held), n=5, cutoff=0.0)
            raise CodegenError(advice(
                f"recompute names {unknown[0]!r}, the module path of no node of the graph"
                + (f" ({len(unknown)} such blocks: {unknown[:5]})" if len(unknown) > 1 else ""),
                "a block is a module (by qualified name) whose forward the model calls; a module it never calls, "
                "or a misspelt name, holds no node",
                f"name blocks of this graph, such as {near}",
            ))
        self.order = {n: i for i, n in enumerate(self.gm.graph.nodes)} if self.block_of else {}
        if self.block_of:  # (node, what it writes in place), for _check
            self.writes = [(n, w) for n in nodes for w in _written(self.gm, n)]

    def copy_nodes(self, graph: fx.Graph, members: Sequence[fx.Node], env: dict[fx.Node, Any]) -> list[_Pending]:
        """Copy ``members`` (a stage's nodes, in order) into ``graph``; each maximal run of one
        recomputed block's nodes becomes ``checkpoint(region, *inputs, use_reentrant=False)`` and a
        ``getitem`` per value read outside the run, named as its node. A run of attribute reads
        alone, or whose values nothing outside it reads, is copied as it is."""
        pending = []
        for block, group in itertools.groupby(members, key=self.block_of.get):
            run = list(group)
            inside = set(run)
            outputs = [n for n in run if any(u not in inside for u in n.users)]
            if block is None or not outputs or all(n.op == "get_attr" for n in run):
                for n in run:
                    env[n] = graph.node_copy(n, env.__getitem__)
                continue
            inputs = list(dict.fromkeys(u for n in run for u in n.all_input_nodes if u not in inside))
            self._check(block, run, inputs)
            sub = fx.Graph()
            local: dict[fx.Node, fx.Node] = {}
            for u in inputs:
                local[u] = sub.placeholder(u.name)
                local[u].meta = dict(u.meta)
            for n in run:
                local[n] = sub.node_copy(n, local.__getitem__)
            sub.output(tuple(local[n] for n in outputs))
            sub.lint()
            args = (None, *(env[u] for u in inputs))  # the region itself once the stage exists (_attach)
            some = self.partial.get(block)
            target, kwargs = ((recompute_unless_kept, dict[str, Any](keep=some.keep, window=some.window)) if some else
                              (torch.utils.checkpoint.checkpoint, dict[str, Any](use_reentrant=False)))
            call = graph.create_node("call_function", target, args, kwargs, name=f"checkpoint_{block}")
            for i, n in enumerate(outputs):
                env[n] = graph.create_node("call_function", operator.getitem, (call, i), name=n.name)
            pending.append(_Pending(block, sub, call))
        return pending

    def _check(self, block: str, run: Sequence[fx.Node], inputs: Sequence[fx.Node]) -> None:
        """Refuse a region whose rerun in the backward would not compute what its forward did, or would
        change state again: one that writes in place into a value it reads from outside or into a
        parameter or buffer, whose inputs a later node writes, or that holds a module updating
        running statistics in training."""
        leave_out = f"leave {block!r} out of recompute (blocks inside it that do not may stay)"
        for n in run:
            if n.op != "call_module":
                continue
            for name, m in self.gm.get_submodule(str(n.target)).named_modules(prefix=str(n.target)):
                if isinstance(m, NormBase) and m.track_running_stats and m.training:
                    raise CodegenError(advice(
                        f"block {block!r} cannot be recomputed: it holds {name} ({type(m).__name__}), whose running "
                        "statistics update in training",
                        "recomputing the block in the backward would update them a second time", leave_out,
                    ))
        inside = set(run)
        read = {a for u in inputs for a in _aliases(self.gm, u)}
        for n, w in self.writes:
            aliases = _aliases(self.gm, w)
            if n in inside:
                hit = next((a for a in aliases if a not in inside or a.op == "get_attr"), None)
                if hit is not None:
                    what = "a parameter or buffer" if hit.op == "get_attr" else "a value the block reads from outside it"
                    raise CodegenError(advice(
                        f"block {block!r} cannot be recomputed: {n.name} writes in place into {hit.name}, {what}",
                        "recomputing the block in the backward would write it a second time, and read what it wrote", leave_out,
                    ))
            elif self.order[n] > self.order[run[0]] and read.intersection(aliases):
                raise CodegenError(advice(
                    f"block {block!r} cannot be recomputed: {n.name}, after it, writes in place into {w.name}, which the block reads",
                    "recomputing the block in the backward would read the written value", leave_out,
                ))


def _attach(stage: fx.GraphModule, pending: Sequence[_Pending], gm: fx.GraphModule) -> None:
    """Make each pending region a :class:`_Region` of ``stage``, named after its block
    (``recompute_h_1``), and its ``checkpoint`` call read it; the stage gets what the region reads
    of ``gm`` (the same objects, under the same names), as it does what its own nodes read."""
    for p in pending:
        for n in p.graph.nodes:
            if n.op in ("get_attr", "call_module"):
                try:
                    operator.attrgetter(str(n.target))(stage)
                except AttributeError:
                    _copy_attr(gm, stage, str(n.target))
        name = base = "recompute_" + re.sub(r"\W", "_", p.block)
        i = 0
        while hasattr(stage, name):
            i += 1
            name = f"{base}_{i}"
        region = _Region(p.graph, stage, name)
        stage.add_module(name, region)
        with stage.graph.inserting_before(p.call):
            p.call.update_arg(0, stage.graph.get_attr(name))
        log.debug("%s: block %s recomputed in the backward as %s (%d values in, %d out)", type(stage).__name__, p.block, name,
                  len(p.call.args) - 1, len(p.call.users))
        if debug.stage_code.isEnabledFor(logging.DEBUG):
            debug.stage_code.debug("%s.%s:\n%s", type(stage).__name__, name, region.code.strip())
    if pending:
        stage.recompile()


class _Region(fx.GraphModule):
    """A recomputed block's nodes in a stage, as the module its stage calls under
    ``torch.utils.checkpoint.checkpoint``. It holds no state of its own: the modules, parameters
    and buffers its code reads (``self.h…``) are looked up on its stage at each call, so nothing is
    registered twice (the stage's ``state_dict`` and parameter names stay the model's) and a stage
    whose tensors are replaced (materialised from meta, moved) is seen as it is."""

    def __init__(self, graph: fx.Graph, owner: fx.GraphModule | None, class_name: str):
        super().__init__(torch.nn.Module(), fx.Graph(), class_name=class_name)
        self.__dict__["_shared"] = frozenset(str(n.target).split(".")[0] for n in graph.nodes if n.op in ("get_attr", "call_module"))
        self.__dict__["_owner"] = owner  # not a submodule: the stage holds the region, never the reverse
        self.graph = graph

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("_shared", ()):
            return getattr(self.__dict__["_owner"], name)
        return super().__getattr__(name)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Region:
        copied = _Region(copy.deepcopy(self.graph, memo), None, type(self).__name__)
        memo[id(self)] = copied
        copied.__dict__["_owner"] = copy.deepcopy(self.__dict__["_owner"], memo)
        return copied


def generate(
    captured: Captured, assignment: Mapping[str, int], devices: Sequence[str], *, recompute: Collection[str] = (),
    partial: Sequence[PartialRecompute] = (),
) -> Program:
    """Build the stage modules and the program for ``assignment`` (node name → stage index);
    ``recompute``: blocks (module paths) each stage runs under activation checkpointing, ``partial``
    those of them that keep some micro-batches."""
    gm = captured.gm
    nodes, stage_of = _placed(gm, assignment)
    regions = _Regions(captured, nodes, recompute, partial)
    output = next(iter(gm.graph.find_nodes(op="output")))
    exported = set(output.all_input_nodes)

    program = fx.Graph()
    set_graph_codegen(program, copy.deepcopy(graph_codegen(gm.graph)))
    env: dict[fx.Node, fx.Node] = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        env[ph] = program.node_copy(ph)
    stages = []
    for s, device in enumerate(devices):
        members = [n for n in nodes if stage_of[n] == s]
        graph, received, sent, pending = _stage_graph(members, s, stage_of, exported, regions)
        stage = fx.GraphModule(gm, graph, class_name=f"Stage{s}")
        _attach(stage, pending, gm)
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


# -- the distributed form: a linear chain of stages ---------------------------------------------


@dataclass(frozen=True)
class Chain:
    """Stages that talk only to their neighbours, by position, in tensors (DESIGN §4.6).

    Stage ``s`` is called as ``stages[s](*received, **inputs)``: ``received`` are the tensors
    stage ``s − 1`` returned, in the order :attr:`crossings` ``[s − 1]`` names; ``inputs``
    are the model's graph inputs by placeholder name (every stage gets them all and reads
    what it uses, so no input is relayed). The last stage returns the tensor leaves of the
    model's output; :meth:`output` rebuilds its structure.
    """

    stages: tuple[fx.GraphModule, ...]
    crossings: tuple[tuple[str, ...], ...]
    """[boundary k − 1] names of the tensors crossing from stage k − 1 to stage k, in order
    (``node`` or ``node.i`` for the i-th tensor leaf of a tuple-valued node)."""
    inputs_meta: tuple[tuple[torch.Tensor, ...], ...]
    """[stage] meta tensors (shape, dtype, grad flag) of what the stage receives, per micro-batch."""
    outputs_meta: tuple[tuple[torch.Tensor, ...], ...]
    """[stage] meta tensors of what the stage returns, per micro-batch."""
    input_names: tuple[str, ...]
    """Placeholder names of the captured graph, in order."""
    _output: Any = None
    """(output node arguments, leaf slots, codegen, capture) to rebuild the model's output."""

    def output(self, leaves: Sequence[torch.Tensor]) -> Any:
        """The model's output (its nested structure) from the last stage's tensors."""
        args, slots, graph_codegen, captured = self._output
        it = iter(leaves)
        values = {slot: next(it) for slot in slots}
        out = fx.node.map_aggregate(args, lambda a: values[a] if isinstance(a, fx.Node) else a)
        return captured.restore_output(graph_codegen.process_outputs(out))

    def __call__(self, *flat_inputs: Any) -> Any:
        """Run the stages in turn in this process (for checking the chain against the model)."""
        inputs = dict(zip(self.input_names, flat_inputs))
        received: tuple = ()
        for stage in self.stages:
            received = stage(*received, **inputs)
        return self.output(received)


class _MicroValues(fx.Interpreter):
    """The value of every node for one micro-batch, on fake tensors: shapes, dtypes, grad flags
    and the Python values (shape ints) that crossings need; real state is never touched.

    ``precision`` — (the plan's precision, the stages' device type) — makes the dtypes those the
    stages compute: for ``"bf16"`` floating state and inputs are bf16; for ``"bf16-mixed"`` and
    ``"fp16-mixed"`` every node runs under ``torch.autocast`` on that device type, on fakes of that
    device type (autocast casts nothing on meta: a model on the meta device is faked there, and a
    ``device=meta`` argument of its graph's ops becomes that device)."""

    def __init__(self, gm: fx.GraphModule, precision: tuple[str, str] = ("fp32", "cpu")):
        from autosplit.passes.annotate import LOW_PRECISION

        super().__init__(gm, garbage_collect_values=False)
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._fakes: dict[int, torch.Tensor] = {}
        self.precision, device_type = precision
        self._low = LOW_PRECISION.get(self.precision)
        self._home = torch.device(device_type) if self.precision.endswith("-mixed") else None
        """The device type the fakes live on under autocast; None: each tensor's own."""
        if self._home is not None and self._home.type != "cpu" and not torch.get_device_module(self._home.type).is_available():
            raise CodegenError(advice(
                f"the dtypes crossing stages under precision={self.precision!r} on {device_type} need that device's autocast",
                f"no {device_type} device is available in this process, and autocast is off without one",
                f"build the stages in a process that has a {device_type} device",
            ))

    def fake(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self._fakes:
            bf16 = self.precision == "bf16" and t.is_floating_point()
            if not bf16 and (self._home is None or t.device.type == self._home.type):
                fake = self.mode.from_tensor(t)
            else:  # remade as the stages hold it: in bf16, or on the stages' device type
                from autosplit.compat import FakeTensor, unset_fake_temporarily

                with unset_fake_temporarily():
                    meta = torch.empty_strided(tuple(t.shape), t.stride(), dtype=self._low if bf16 else t.dtype, device="meta")
                fake = FakeTensor(self.mode, meta, self._home if self._home is not None else t.device)
            self._fakes[id(t)] = fake
            if t.requires_grad:
                fake.requires_grad_(True)
        return self._fakes[id(t)]

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        return self.fake(value) if isinstance(value, torch.Tensor) else value

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        mod = self.module.get_submodule(str(target))
        state = {k: self.fake(v) for k, v in [*mod.named_parameters(), *mod.named_buffers()]}
        return torch.func.functional_call(mod, state, tuple(args), dict(kwargs))

    def _at_home(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """``device=meta`` arguments (a graph torch.export traced on meta) moved to the fakes' device type."""
        home = self._home
        if home is None:
            return args, kwargs
        swap = lambda v: home if isinstance(v, torch.device) and v.type == "meta" else v  # noqa: E731
        return fx.node.map_aggregate(args, swap), fx.node.map_aggregate(kwargs, swap)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_function(target, *self._at_home(args, kwargs))

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_method(target, *self._at_home(args, kwargs))

    def run_node(self, n: fx.Node) -> Any:
        with self.mode:
            if self._home is None:
                return super().run_node(n)
            with torch.autocast(self._home.type, dtype=self._low):
                return super().run_node(n)

    def values(self, inputs: Sequence[Any]) -> dict[fx.Node, Any]:
        try:
            self.run(*[self.fake(x) if isinstance(x, torch.Tensor) else x for x in inputs])
        except Exception as e:
            if self.precision == "fp32":
                raise
            raise CodegenError(advice(
                f"the values crossing stages could not be traced under precision={self.precision!r}: {type(e).__name__}: "
                + next((line for line in str(e).splitlines() if line.strip()), "")[:300],
                "their dtypes are found by running the graph on fake tensors as the stages hold them (bf16, or "
                "under autocast on the stages' device type), which this graph refuses",
                "plan with precision='fp32', or build the model on a real device (a graph traced on meta may fix that device)",
            )) from e
        return dict(self.env)


def _meta(t: torch.Tensor) -> torch.Tensor:
    m = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return m.requires_grad_(True) if t.requires_grad and t.is_floating_point() else m


def _constant(value: Any) -> Any:
    """A Python value as a graph constant (``torch.Size`` as the tuple it is)."""
    return pytree.tree_map(lambda x: tuple(x) if isinstance(x, torch.Size) else x, value)


def _slot_names(node: fx.Node, value: Any) -> list[tuple[str, int]]:
    """(name, leaf index) of each tensor leaf of ``value``: ``node`` alone, or ``node.i``."""
    leaves = pytree.tree_leaves(value)
    if isinstance(value, torch.Tensor):
        return [(node.name, 0)]
    return [(f"{node.name}.{i}", i) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]


def _last_use(
    nodes: Sequence[fx.Node], stage_of: Mapping[fx.Node, int], num_stages: int, replicated: Collection[fx.Node], output: fx.Node
) -> dict[fx.Node, int]:
    """The last stage that needs each node's value: a value is relayed through every stage up to it.
    A replicated parameter is read where it is used, so it never leaves its own stage; the model's
    outputs are needed by the last stage, which returns them."""
    last_use = {n: max((stage_of.get(u, num_stages - 1) for u in n.users), default=stage_of[n]) for n in nodes}
    last_use.update({n: stage_of[n] for n in replicated})
    for n in output.all_input_nodes:
        if n in stage_of:
            last_use[n] = num_stages - 1
    return last_use


def _receive(
    graph: fx.Graph, root: dict[str, Any], received: Sequence[fx.Node], values: Mapping[fx.Node, Any]
) -> tuple[dict[fx.Node, Any], list[torch.Tensor]]:
    """Placeholders in ``graph`` for the tensor leaves of the ``received`` values, and each received
    value rebuilt from them: (stage environment, meta tensors of the placeholders in order).

    Python values are fixed per micro-batch, so a value without tensors becomes a constant, and a
    tuple-valued one is rebuilt from its received leaves and its constant ones (its tree spec is
    added to ``root``)."""
    env: dict[fx.Node, Any] = {}
    metas = []
    for n in received:
        slots = _slot_names(n, values[n])
        leaves = pytree.tree_leaves(values[n])
        phs = {i: graph.placeholder(name.replace(".", "_")) for name, i in slots}
        metas += [_meta(leaves[i]) for _, i in slots]
        if isinstance(values[n], torch.Tensor):
            env[n] = phs[0]
        elif not phs:  # no tensor inside (a shape int, a tuple of them): a constant here
            env[n] = _constant(values[n])
        else:  # rebuild the value: tensor leaves received, the rest fixed per micro-batch
            spec_name = f"_spec_{n.name}"
            rebuilt = [phs[i] if i in phs else leaf for i, leaf in enumerate(leaves)]
            root[spec_name] = pytree.tree_structure(values[n])
            env[n] = graph.call_function(pytree.tree_unflatten, (rebuilt, graph.get_attr(spec_name)), name=n.name)
    return env, metas


def _send(
    graph: fx.Graph, env: Mapping[fx.Node, Any], crossing: Sequence[fx.Node], values: Mapping[fx.Node, Any], own: bool = False,
) -> tuple[list[fx.Node], list[torch.Tensor]]:
    """The contiguous tensor leaves of the values ``crossing`` to the next stage, in order, and their
    meta tensors: only tensors cross, in contiguous memory (what gloo sends); with ``own``, each in
    memory of its own (a copy), never a view."""
    sent, metas = [], []
    for n in crossing:
        leaves = pytree.tree_leaves(values[n])
        for _, i in _slot_names(n, values[n]):
            if isinstance(values[n], torch.Tensor):
                leaf = env[n]
            else:
                leaf = graph.call_function(operator.getitem, (graph.call_function(pytree.tree_leaves, (env[n],)), i))
            sent.append(graph.call_function(torch.clone, (leaf,), {"memory_format": torch.contiguous_format}) if own
                        else graph.call_method("contiguous", (leaf,)))
            metas.append(_meta(leaves[i]))
    return sent, metas


def _model_outputs(
    env: Mapping[fx.Node, Any], output: fx.Node, values: Mapping[fx.Node, Any]
) -> tuple[list[Any], list[torch.Tensor], list[fx.Node]]:
    """What the last stage returns: the tensor leaves of the model's output, their meta tensors, and
    the nodes they are (so :meth:`Chain.output` can rebuild the structure). A non-tensor node in the
    output is a typed error: the pipelined runtime returns tensors only."""
    sent, metas, slots = [], [], []
    for a in pytree.tree_leaves(output.args[0]) if not isinstance(output.args[0], fx.Node) else [output.args[0]]:
        if isinstance(a, fx.Node) and isinstance(values.get(a), torch.Tensor):
            sent.append(env[a])
            metas.append(_meta(values[a]))
            slots.append(a)
        elif isinstance(a, fx.Node):
            raise CodegenError(
                advice(
                    f"model output {a.name} is a {type(values.get(a)).__name__}, not a tensor",
                    "the pipelined runtime sends and returns tensors only",
                    "return tensors from forward (or a dict/tuple of them)",
                )
            )
    return sent, metas, slots


def _stage_module(gm: fx.GraphModule, root: dict[str, Any], graph: fx.Graph, stage: int) -> fx.GraphModule:
    """The stage's module: ``graph`` over ``root`` plus the modules, parameters and buffers of ``gm``
    it reads, the same objects under the same names (nothing is copied)."""
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr") and node.target not in root:
            root[str(node.target)] = operator.attrgetter(str(node.target))(gm)
    graph.lint()
    return fx.GraphModule(root, graph, class_name=f"Stage{stage}")


def generate_chain(
    captured: Captured, assignment: Mapping[str, int], num_stages: int, micro_inputs: Sequence[Any],
    *, replicate: Collection[str] = (), own_outputs: bool = False, precision: tuple[str, str] = ("fp32", "cpu"),
    recompute: Collection[str] = (), partial: Sequence[PartialRecompute] = (),
) -> Chain:
    """The chain form of ``assignment`` (node name → stage) for micro-batches like ``micro_inputs``
    (the graph's placeholder values for one micro-batch).

    - a value needed ``j`` stages on is received and returned unchanged by the stages between
      (relayed), as the cost model charges it;
    - only tensors cross: a Python value (a shape int, a tuple's non-tensor leaves) is fixed
      per micro-batch, so the receiving stage holds it as a constant; a tuple-valued node
      crosses as its tensor leaves and is rebuilt;
    - every crossing is made contiguous (gloo sends contiguous memory only); with ``own_outputs``, a
      copy of its own: torch's split backward (zero bubble) detaches a stage's outputs in place,
      which a view (a ``Linear`` on 3-D input returns one) refuses;
    - the positional order of crossings is the graph's order, recorded in :attr:`Chain.crossings`;
    - a parameter named in ``replicate`` (a tied weight) never crosses: every stage that reads it
      reads it itself, and the runtime sums its gradient over those stages once per step.
    - ``precision`` (the plan's precision, the stages' device type): the metadata carry the dtypes
      the stages compute and exchange under it (bf16 state, or autocast: see ``_MicroValues``).
    - the blocks (module paths) in ``recompute`` run under activation checkpointing (``partial``:
      those that keep some micro-batches), as in :func:`generate`; crossings are unchanged by them.
    """
    gm = captured.gm
    S = num_stages
    nodes, stage_of = _placed(gm, assignment)
    regions = _Regions(captured, nodes, recompute, partial)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    output = next(iter(gm.graph.find_nodes(op="output")))
    values = _MicroValues(gm, precision).values(micro_inputs)

    replicate = set(replicate)
    replicated = {n for n in nodes if n.op == "get_attr" and str(n.target) in replicate}
    last_use = _last_use(nodes, stage_of, S, replicated, output)

    def crossing(k: int) -> list[fx.Node]:  # values crossing boundary k (stage k − 1 → k), in graph order
        return [n for n in nodes if stage_of[n] < k <= last_use[n]]

    stages, crossings, inputs_meta, outputs_meta = [], [], [], []
    out_slots: list[Any] = []
    for s in range(S):
        graph = fx.Graph()
        root: dict[str, Any] = {}  # what the stage's graph reads by name: modules, parameters, buffers, tree specs
        env, metas = _receive(graph, root, crossing(s) if s > 0 else [], values)
        inputs = graph.placeholder("**inputs")
        for ph in placeholders:
            if any(stage_of.get(u) == s or (s == S - 1 and u is output) for u in ph.users):
                env[ph] = graph.create_node("call_function", operator.getitem, (inputs, ph.name), name=ph.name)
        for u in replicated:  # this stage's own read of a replicated parameter
            if stage_of[u] != s and any(stage_of.get(v) == s for v in u.users):
                env[u] = graph.get_attr(str(u.target))
        # An attribute read nothing uses (torch.export keeps one per alias of a tied weight)
        # is left out, so a stage holds only the parameters it computes with.
        members = [n for n in nodes if stage_of[n] == s and (n.users or n.op != "get_attr")]
        pending = regions.copy_nodes(graph, members, env)
        if s < S - 1:
            sent, meta_out = _send(graph, env, crossing(s + 1), values, own_outputs)
            crossings.append(tuple(name for n in crossing(s + 1) for name, _ in _slot_names(n, values[n])))
        else:
            sent, meta_out, out_slots = _model_outputs(env, output, values)
        graph.output(tuple(sent))
        stages.append(_stage_module(gm, root, graph, s))
        _attach(stages[-1], pending, gm)
        inputs_meta.append(tuple(metas))
        outputs_meta.append(tuple(meta_out))
    return Chain(
        stages=tuple(stages),
        crossings=tuple(crossings),
        inputs_meta=tuple(inputs_meta),
        outputs_meta=tuple(outputs_meta),
        input_names=tuple(ph.name for ph in placeholders),
        _output=(output.args[0], tuple(out_slots), graph_codegen(gm.graph), captured),
    )


def retarget(gm: fx.GraphModule, device: torch.device) -> int:
    """Make a stage cut from a capture on the meta device run on ``device``: torch.export writes
    the device of the tensors it traced into ops that create or check tensors (``arange``,
    ``zeros``, ``_assert_tensor_metadata``, ``to``), so every ``device=meta`` argument becomes
    ``device``, in the stage's graph and in the bodies of its higher-order ops. Returns how many
    arguments changed (the code of each graph that changed is regenerated)."""
    changed = 0

    def swap(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, torch.device) and value.type == "meta":
            changed += 1
            return device
        return value

    for module in gm.modules():  # higher-order ops' bodies (grad-mode, autocast regions) are graphs of their own
        if not isinstance(module, fx.GraphModule):
            continue
        before = changed
        for node in module.graph.nodes:
            node.args = fx.node.map_aggregate(node.args, swap)
            node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
        if changed > before:
            module.recompile()
    return changed
