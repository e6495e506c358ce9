"""Annotate: shapes, bytes, FLOPs, parameters and saved activations of every node.

Runs the graph on fake tensors (``FakeTensorMode``: shapes and dtypes, no storage, no real
compute), so annotating a model costs milliseconds per node whatever its size. For each
compute node it replays the op on fresh inputs that require grad, under

- ``torch.utils.flop_counter.FlopCounterMode`` for forward and backward FLOPs,
- ``torch.autograd.graph.saved_tensors_hooks`` for the bytes autograd keeps for backward
  (parameters and views of them excluded: they are counted once, as model state), and
- the inputs' version counters for what it writes in place (``ReLU(inplace=True)``, ``x += y``).

Results land in ``node.meta["autosplit"]`` as a :class:`~autosplit.passes.annotations.NodeInfo`.
Replays are memoised by the node's signature (op, module config, input shapes, strides, dtypes
and grad flags), so the layers of a deep model are measured once; every later node of a known
signature is not run at all: its output is made from the recorded metadata. A mixed precision is
annotated under autocast's policy (:mod:`autosplit.passes.autocast_policy`); embedding tables
looked up by rows get their gradient's sparse size afterwards (:mod:`autosplit.passes.sparse_tables`).

Usage::

    annotate(captured, flat_inputs(captured, args, kwargs))
    info = node.meta["autosplit"]
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from autosplit.compat import FakeTensor, FakeTensorMode, pytree, unset_fake_temporarily
from autosplit.errors import CostModelError, advice
from autosplit.passes.annotations import NodeInfo
from autosplit.passes.autocast_policy import HALF, LOW_PRECISION, precision_context
from autosplit.passes.capture import Captured
from autosplit.passes.flop_formulas import flop_formulas
from autosplit.passes.sparse_tables import row_sparse

F = torch.nn.functional

aten = torch.ops.aten


__all__ = ["annotate", "fresh"]

log = logging.getLogger(__name__)


class _Measured(NamedTuple):
    """What replaying one node showed; nodes with the same signature share it."""

    fwd: int
    bwd: int
    saved: int
    """Bytes of what the node itself makes and autograd keeps."""
    saved_at: frozenset[int]
    """Positions, among the flat (args, kwargs), of the inputs autograd keeps."""
    saves_output: bool
    written_at: frozenset[int]
    """Positions of the inputs the node wrote in place (their version counter moved)."""
    output: Any
    """The output with each tensor as its :class:`_TensorMeta`, to make it again."""
    wgrad_share: float = 0.0
    """Of ``bwd``, the share of the gradient to the node's own parameters (a zero-bubble W pass)."""
    copies: int = 0
    """Of ``saved``, the bytes of the low-precision copies of parameters autocast made."""
    moves_nothing: bool = False
    """Each tensor it returned shares an input's storage and it wrote none: :attr:`NodeInfo.moves_nothing`."""


@dataclass(frozen=True)
class _TensorMeta:  # not a NamedTuple: pytree would walk into it
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> _TensorMeta:
        return cls(tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


class _Made:
    """A repeated node's output tensor, made from its metadata without building a tensor: what
    the next nodes' signatures and annotations read. Each is a new object, so identity still
    tells values apart; it becomes a fake tensor only when a node that reads it must run."""

    __slots__ = ("meta",)

    def __init__(self, meta: _TensorMeta):
        self.meta = meta

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.dtype

    def numel(self) -> int:
        return math.prod(self.meta.shape)

    def element_size(self) -> int:
        return self.meta.dtype.itemsize


_TENSORS = (torch.Tensor, _Made)


def _made(template: Any) -> Any:
    """The output a node's recorded template describes, with :class:`_Made` tensors."""
    if isinstance(template, _TensorMeta):
        return _Made(template)
    return pytree.tree_map(lambda x: _Made(x) if isinstance(x, _TensorMeta) else x, template)


def _make(x: Any, mode: FakeTensorMode) -> Any:
    """A fake tensor like the :class:`_Made` ``x``; other values as they are.

    Built from a meta tensor directly: seven times cheaper than ``empty_strided`` dispatched
    through the fake mode.
    """
    if not isinstance(x, _Made):
        return x
    x = x.meta
    with unset_fake_temporarily():
        meta = torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device="meta")
    return FakeTensor(mode, meta, x.device).requires_grad_(x.requires_grad)


def fresh(x: Any, state: set[int]) -> Any:
    """An input cut from the graph for replaying one node (``state``: ids of parameters, kept).

    A float tensor that needs a gradient becomes a non-leaf tensor that requires grad, so
    in-place ops stay legal and backward reaches it; one that does not (input data, masks)
    is copied, so a replay never writes the real value.
    """
    if not isinstance(x, torch.Tensor) or id(x) in state:
        return x
    if x.requires_grad:
        return x.detach().requires_grad_(True).clone()
    return x.detach().clone()


def _cut(value: Any) -> Any:
    """``value`` detached from its autograd graph, keeping whether each tensor needs a gradient."""
    return pytree.tree_map(lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, value)


_LOW_PARAMS = ("bf16", "bf16-fsdp")
"""The precisions that compute with bf16 parameters and floating inputs (no autocast)."""

_ATTENTION = frozenset({F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default})


class _Annotator(fx.Interpreter):
    def __init__(self, captured: Captured, precision: str = "fp32", device_type: str = "cpu"):
        super().__init__(captured.gm, garbage_collect_values=True)
        self.paths = captured.module_paths
        self.precision, self.device_type = precision, device_type
        self.formulas = flop_formulas()
        self._state_read = False  # inputs are faked first, then the model's state as nodes read it
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._fakes: dict[int, torch.Tensor] = {}  # id(real tensor) → its fake, so identity survives
        self._state_fakes: set[int] = set()  # ids of fakes standing for parameters
        self._seen_state: set[int] = set()  # real params/buffers already owned by some node
        self._measured: dict[tuple, _Measured] = {}  # signature → what its first node showed
        self._modules: dict[str, tuple] = {}  # call_module target → its part of the signature

    def fake(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self._fakes:
            f = self._fake_in_precision(t) if self.precision != "fp32" else self.fake_mode.from_tensor(t)
            if isinstance(t, torch.nn.Parameter):
                f.requires_grad_(t.requires_grad)
                self._state_fakes.add(id(f))
            self._fakes[id(t)] = f
        return self._fakes[id(t)]

    def _fake_in_precision(self, t: torch.Tensor) -> torch.Tensor:
        """A fake of ``t`` as the precision computes with it: floating parameters and inputs in bf16 for
        ``"bf16"`` and ``"bf16-fsdp"`` (buffers keep their dtype: an exported graph checks the dtypes it
        traced them in, and FSDP2's ``MixedPrecisionPolicy`` casts parameters only)."""
        low = self.precision in _LOW_PARAMS and t.is_floating_point() and (isinstance(t, torch.nn.Parameter) or not self._state_read)
        dtype = LOW_PRECISION[self.precision] if low else t.dtype
        with unset_fake_temporarily():
            meta = torch.empty_strided(tuple(t.shape), t.stride(), dtype=dtype, device="meta")
        return FakeTensor(self.fake_mode, meta, t.device)

    # -- state ----------------------------------------------------------------------------
    def _own(self, named: list[tuple[str, torch.Tensor]]) -> tuple[tuple[str, ...], int, int, int, int, int]:
        """(parameter names, bytes, count, buffer bytes, largest parameter's bytes, bytes of the bf16
        compute copy ``"bf16-fsdp"`` gathers of them) of the tensors no node owned before."""
        names, pbytes, pcount, bbytes, largest, copies = [], 0, 0, 0, 0, 0
        for name, t in named:
            if id(t) in self._seen_state:
                continue
            self._seen_state.add(id(t))
            low = t.is_floating_point() and isinstance(t, torch.nn.Parameter)
            size = t.numel() * (2 if low and self.precision == "bf16" else t.element_size())
            if isinstance(t, torch.nn.Parameter):
                names.append(name)
                pbytes += size
                pcount += t.numel()
                largest = max(largest, size)
                copies += 2 * t.numel() if low and self.precision == "bf16-fsdp" else 0
            else:
                bbytes += size
        return tuple(names), pbytes, pcount, bbytes, largest, copies

    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        return self.fake(value) if isinstance(value, torch.Tensor) else value

    def call_module(self, target, args, kwargs):
        mod = self.module.get_submodule(target)
        state = {k: self.fake(v) for k, v in [*mod.named_parameters(), *mod.named_buffers()]}
        return torch.func.functional_call(mod, state, tuple(args), dict(kwargs))

    # -- per node -------------------------------------------------------------------------
    def run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        flat, structure = pytree.tree_flatten((args, kwargs))  # once: deep models have many nodes
        try:
            key = self._signature(n, flat, structure) if n.op.startswith("call") else None
            if n.target is aten._assert_tensor_metadata.default and self.precision != "fp32":
                out, measured = None, _Measured(0, 0, 0, frozenset(), False, frozenset(), None, moves_nothing=True)  # checks fp32 dtypes
            elif key is not None and key in self._measured:
                # The same op on inputs of the same shapes: its output has the same metadata,
                # so it is made, not run (a deep model repeats most of its nodes).
                measured = self._measured[key]
                out = _made(measured.output)
            elif n.op.startswith("call"):
                with self.fake_mode:
                    out, measured = self._measure(n, args, kwargs)
                if key is not None:
                    self._measured[key] = measured
            else:
                with self.fake_mode:
                    out = getattr(self, n.op)(n.target, args, kwargs)
                measured = _Measured(0, 0, 0, frozenset(), False, frozenset(), None)
        except Exception as e:
            first = next((line for line in str(e).splitlines() if line.strip()), "")
            mismatch = "Device" in type(e).__name__ or "device" in first
            raise CostModelError(advice(
                f"could not run node {n.format_node()} (module '{self.paths.get(n.name, '')}') "
                f"on fake tensors: {type(e).__name__}: {first}",
                "the model's weights and the example inputs are on different devices" if mismatch
                else "an op without a fake-tensor kernel, or one that reads tensor values",
                "pass example inputs on the weights' device (or the meta device)" if mismatch
                else "capture with capture='export', or make the module a leaf",
            )) from e
        if n.op == "call_module":
            mod = self.module.get_submodule(str(n.target))
            prefix = f"{n.target}."
            owned = [(prefix + k, v) for k, v in [*mod.named_parameters(), *mod.named_buffers()]]
        elif n.op == "get_attr":
            real = fx.Interpreter.fetch_attr(self, str(n.target))
            owned = [(str(n.target), real)] if isinstance(real, torch.Tensor) else []
        else:
            owned = []
        params, pbytes, pcount, bbytes, largest, gathered = self._own(owned)
        inputs = [t for t in flat if isinstance(t, _TENSORS)]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, _TENSORS)]
        n.meta["autosplit"] = NodeInfo(
            module_path=self.paths.get(n.name, ""),
            output_shapes=tuple(tuple(int(d) for d in t.shape) for t in outputs),
            output_bytes=sum(t.numel() * t.element_size() for t in outputs),
            input_bytes=sum(t.numel() * t.element_size() for t in inputs),
            fwd_flops=measured.fwd,
            bwd_flops=measured.bwd,
            saved_bytes=measured.saved + gathered,  # the weight copy is held with the state (memory_model)
            saved_inputs=self._producers(n, flat, measured.saved_at),
            saves_output=measured.saves_output,
            params=params,
            param_bytes=pbytes,
            param_count=pcount,
            largest_param_bytes=largest,
            buffer_bytes=bbytes,
            half=any(t.dtype in HALF for t in (*inputs, *outputs)),
            mutates=self._producers(n, flat, measured.written_at),
            wgrad_share=measured.wgrad_share,
            weight_copy_bytes=measured.copies + gathered,
            moves_nothing=measured.moves_nothing,
        )
        return out

    def _producers(self, n: fx.Node, leaves: list[Any], positions: frozenset[int]) -> tuple[str, ...]:
        """Names of the input nodes whose values sit at ``positions`` of the flat (args, kwargs)."""
        if not positions:
            return ()
        owner = {id(t): u.name for u in n.all_input_nodes for t in pytree.tree_leaves(self.env.get(u))}
        return tuple(dict.fromkeys(owner[id(leaves[i])] for i in sorted(positions) if id(leaves[i]) in owner))

    def _signature(self, n: fx.Node, flat: list[Any], structure: pytree.TreeSpec) -> tuple | None:
        """What determines a node's FLOPs and saved bytes (strides too: a copy may be saved); None when it cannot be told safely."""

        def describe(x):
            if isinstance(x, _Made):
                m = x.meta
                return ("T", m.shape, m.stride, m.dtype, m.device, m.requires_grad, False)
            if isinstance(x, torch.Tensor):
                return ("T", tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad, id(x) in self._state_fakes)
            if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, slice)):
                return repr(x)
            return None  # an unusual value: measure this node on its own

        inputs = tuple(describe(x) for x in flat)
        if None in inputs:
            return None
        if n.op == "call_module":
            what: Any = self._module_signature(str(n.target))
        else:
            target = n.target
            what = target if isinstance(target, str) else (
                getattr(target, "__module__", ""), getattr(target, "__qualname__", repr(target))
            )
        return (n.op, what, structure, inputs)

    def _module_signature(self, target: str) -> tuple:
        """What of a module decides its cost; once per module (they do not change during annotation)."""
        if target not in self._modules:
            mod = self.module.get_submodule(target)
            state = tuple((k, tuple(v.shape), v.dtype, v.requires_grad) for k, v in [*mod.named_parameters(), *mod.named_buffers()])
            self._modules[target] = (type(mod), repr(mod), mod.training, state)
        return self._modules[target]

    def _attention_on_cpu(self, n: fx.Node, args_kwargs: Any) -> torch.device | None:
        """The device to move an attention node's output back to, when it must be measured on CPU
        fakes instead (None otherwise). On the meta device ``scaled_dot_product_attention`` runs the
        math path, which saves the (B, H, L, L) probabilities; the fused kernels training runs — flash
        or memory-efficient on GPUs, the CPU's flash kernel — save the log-sum-exp instead."""
        if n.target not in _ATTENTION:
            return None
        devices = {t.device for t in pytree.tree_leaves(args_kwargs) if isinstance(t, torch.Tensor)}
        return next(iter(devices)) if devices and all(d.type == "meta" for d in devices) else None

    def _moved(self, x: Any, device: torch.device) -> Any:
        """A fake like ``x`` (shape, strides, dtype, grad flag) on ``device``; other values as they are."""
        if not isinstance(x, torch.Tensor):
            return x
        with unset_fake_temporarily():
            meta = torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
        return FakeTensor(self.fake_mode, meta, device).requires_grad_(x.requires_grad)

    def _measure(self, n: fx.Node, args: tuple, kwargs: dict) -> tuple[Any, _Measured]:
        """Run ``n`` on fresh grad-requiring inputs; its output (cut from the graph) and what it costs."""

        args, kwargs = pytree.tree_map(lambda x: fresh(_make(x, self.fake_mode), self._state_fakes), (args, kwargs))
        back_to = self._attention_on_cpu(n, (args, kwargs))
        if back_to is not None:
            args, kwargs = pytree.tree_map(lambda x: self._moved(x, torch.device("cpu")), (args, kwargs))
        flat = pytree.tree_leaves((args, kwargs))
        position = {id(t): i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)}
        versions = {i: t._version for i, t in enumerate(flat) if isinstance(t, torch.Tensor)}
        own: dict[int, int] = {}
        saved_at: set[int] = set()
        from torch.utils.flop_counter import FlopCounterMode  # deferred: it imports triton (a third of a second) where installed

        policy = precision_context(self.precision, self.device_type, self._state_fakes)
        copies: dict[int, torch.Tensor] = getattr(policy, "copies", {})

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if id(base) in self._state_fakes:
                pass
            elif id(t) in position:
                saved_at.add(position[id(t)])
            elif id(base) in position:
                saved_at.add(position[id(base)])
            else:
                own[id(base)] = base.numel() * base.element_size()
            return t

        with (
            FlopCounterMode(display=False, custom_mapping=self.formulas) as fwd_counter,
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            policy,
        ):
            out = getattr(self, n.op)(n.target, args, kwargs)
        written_at = frozenset(i for i, v in versions.items() if flat[i]._version != v)
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        saves_output = any(id(t) in own or (t._base is not None and id(t._base) in own) for t in leaves)
        outs = [t for t in leaves if t.requires_grad]
        grad_inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if n.op == "call_module":
            grad_inputs += [self.fake(p) for p in self.module.get_submodule(str(n.target)).parameters() if p.requires_grad]
        bwd, wshare = 0, 0.0
        weights = [t for t in grad_inputs if id(t) in self._state_fakes]
        if outs and grad_inputs:
            ones = [torch.ones_like(o) for o in outs]
            wgrad = 0
            if weights and len(weights) < len(grad_inputs):  # the weight gradient alone, then the whole backward
                with FlopCounterMode(display=False, custom_mapping=self.formulas) as w_counter:
                    torch.autograd.grad(outs, weights, ones, allow_unused=True, retain_graph=True)
                wgrad = w_counter.get_total_flops()
            with FlopCounterMode(display=False, custom_mapping=self.formulas) as bwd_counter:
                torch.autograd.grad(outs, grad_inputs, ones, allow_unused=True)
            bwd = bwd_counter.get_total_flops()
            wshare = 1.0 if weights and len(weights) == len(grad_inputs) else min(1.0, wgrad / bwd) if bwd else 0.0
        out = _cut(out)
        if back_to is not None:
            out = pytree.tree_map(lambda x: self._moved(x, back_to), out)
        template = pytree.tree_map(lambda t: _TensorMeta.of(t) if isinstance(t, torch.Tensor) else t, out)
        measured = _Measured(
            fwd_counter.get_total_flops(), bwd, sum(own.values()), frozenset(saved_at), saves_output, written_at, template, wshare,
            sum(b for i, b in own.items() if i in copies), _moves_nothing(n, flat, leaves, written_at),
        )
        return out, measured


def annotate(captured: Captured, inputs: list[Any], *, precision: str = "fp32", device_type: str = "cpu") -> fx.GraphModule:
    """Write a :class:`NodeInfo` into ``node.meta["autosplit"]`` of every node; returns the graph module.

    ``precision`` (:attr:`~autosplit.options.PlanOptions.precision`) on a ``device_type`` target:
    each node is run as that precision runs it — the mixed ones under autocast (CUDA's policy for a
    GPU: its fp32 ops stay fp32), ``"bf16"`` with bf16 parameters, buffers and floating inputs,
    ``"bf16-fsdp"`` with bf16 parameters and floating inputs (its parameters' bytes those of the fp32
    master weights, and the bf16 copy FSDP2 gathers held with them: ``weight_copy_bytes``) — so
    its FLOPs, bytes, saved tensors and dtype (``half``: the tensor-core peak applies) are its own.
    """
    annotator = _Annotator(captured, precision, device_type)
    fake_inputs = [annotator.fake(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    annotator._state_read = True
    annotator.run(*fake_inputs)
    row_sparse(captured.gm)
    return captured.gm


def _moves_nothing(n: fx.Node, flat: list[Any], outputs: list[torch.Tensor], written: frozenset[int]) -> bool:
    """:attr:`~autosplit.passes.annotations.NodeInfo.moves_nothing`: each tensor ``n`` returned shares the storage of
    one in ``flat`` (its arguments), and it wrote none in place (by its version counters, its schema, or a name ending
    in ``_``)."""
    schema = getattr(n.target, "_schema", None)
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if written or (schema is not None and schema.is_mutable) or name.split(".")[0].endswith("_"):
        return False
    try:
        mine = {StorageWeakRef(t.untyped_storage()) for t in flat if isinstance(t, torch.Tensor)}
        return all(StorageWeakRef(t.untyped_storage()) in mine for t in outputs)
    except (RuntimeError, NotImplementedError):  # a tensor without a storage (sparse, nested): it may move bytes
        return False
