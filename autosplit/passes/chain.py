"""Codegen's chain form: an assignment → stages that talk only to their neighbours (DESIGN §4.6).

``torch.distributed.pipelining`` stages form a linear chain: stage ``i`` receives only from
``i − 1`` and sends only to ``i + 1``, by position, tensors only, contiguous, with shapes fixed
after the first step. :func:`generate_chain` cuts the captured graph into such stages for
micro-batches of one shape: values needed further on are relayed, Python values crossing a
boundary become constants of the receiving stage, tuples cross as their tensor leaves, and the
positional order of the crossings is recorded (:attr:`Chain.crossings`, kept in the plan). The
stages' static input and output metadata come from a fake-tensor run at the micro-batch's shape,
so ``PipelineStage`` needs no shape-inference round trip. :func:`retarget` makes a stage cut from
a capture on the meta device run on a real one.

Usage::

    chain = generate_chain(captured, plan.stage_of, len(plan.stage_devices), micro_inputs)
    out = chain(*flat_inputs)          # the stages in turn, in this process
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autosplit.compat import FakeTensorMode, graph_codegen, pytree
from autosplit.errors import CodegenError, advice
from autosplit.passes.autocast_policy import LOW_PRECISION
from autosplit.passes.capture import Captured
from autosplit.passes.codegen import placed
from autosplit.passes.input_free import copy_closure, input_free
from autosplit.passes.recompute_regions import Regions, attach_regions
from autosplit.plans import PartialRecompute

__all__ = ["Chain", "generate_chain", "retarget"]

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
    stages compute: for ``"bf16"`` floating state and inputs are bf16, for ``"bf16-fsdp"`` floating
    parameters and inputs (FSDP2's ``MixedPrecisionPolicy`` casts no buffer); for ``"bf16-mixed"`` and
    ``"fp16-mixed"`` every node runs under ``torch.autocast`` on that device type, on fakes of that
    device type (autocast casts nothing on meta: a model on the meta device is faked there, and a
    ``device=meta`` argument of its graph's ops becomes that device)."""

    def __init__(self, gm: fx.GraphModule, precision: tuple[str, str] = ("fp32", "cpu")):
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

    def fake(self, t: torch.Tensor, *, state: bool = True) -> torch.Tensor:
        if id(t) not in self._fakes:
            cast = self.precision == "bf16" or (self.precision == "bf16-fsdp" and (isinstance(t, torch.nn.Parameter) or not state))
            bf16 = cast and t.is_floating_point()
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
            self.run(*[self.fake(x, state=False) if isinstance(x, torch.Tensor) else x for x in inputs])
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
    nodes: Sequence[fx.Node], stage_of: Mapping[fx.Node, int], num_stages: int, replicated: Collection[fx.Node], output: fx.Node,
    free: Collection[str],
) -> dict[fx.Node, int]:
    """The last stage that needs each node's value: a value is relayed through every stage up to it.
    A replicated parameter is read where it is used, and an input-free value made where it is read
    (:mod:`~autosplit.passes.input_free`), so neither leaves its own stage; the model's other outputs
    are needed by the last stage, which returns them."""
    last_use = {n: max((stage_of.get(u, num_stages - 1) for u in n.users), default=stage_of[n]) for n in nodes}
    last_use.update({n: stage_of[n] for n in replicated})
    for n in output.all_input_nodes:
        if n in stage_of:
            last_use[n] = num_stages - 1
    last_use.update({n: stage_of[n] for n in nodes if n.name in free})  # the last stage makes those it returns
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
    recompute: Collection[str] = (), partial: Sequence[PartialRecompute] = (), selective: bool = False,
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
      those that keep some micro-batches; ``selective``: keeping their matmuls' outputs), as in
      :func:`~autosplit.passes.codegen.generate`; crossings are unchanged by them.
    """
    gm = captured.gm
    S = num_stages
    nodes, stage_of = placed(gm, assignment)
    regions = Regions(captured, nodes, recompute, partial, selective)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    output = next(iter(gm.graph.find_nodes(op="output")))
    values = _MicroValues(gm, precision).values(micro_inputs)

    replicate = set(replicate)
    replicated = {n for n in nodes if n.op == "get_attr" and str(n.target) in replicate}
    free = input_free(gm)
    last_use = _last_use(nodes, stage_of, S, replicated, output, free)

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
        members = [n for n in nodes if stage_of[n] == s and (n.users or n.op != "get_attr") and n.name not in free]
        read = [u for n in members for u in n.all_input_nodes] + (output.all_input_nodes if s == S - 1 else [])
        copy_closure(graph, read, free, env)  # the input-free values it reads: made here, never received
        pending = regions.copy_nodes(graph, members, env)
        if s < S - 1:
            sent, meta_out = _send(graph, env, crossing(s + 1), values, own_outputs)
            crossings.append(tuple(name for n in crossing(s + 1) for name, _ in _slot_names(n, values[n])))
        else:
            sent, meta_out, out_slots = _model_outputs(env, output, values)
        graph.output(tuple(sent))
        stages.append(_stage_module(gm, root, graph, s))
        attach_regions(stages[-1], pending, gm)
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
