"""Capture: ``nn.Module`` → ``torch.fx.GraphModule``, every node labelled with its module path.

Symbolic tracing comes first: it keeps the user's Python-level ops and module calls, and
is cheap. Models it cannot follow (data-dependent control flow, most ``transformers``
models) fall back to ``torch.export`` in non-strict mode, whose graph holds ATen ops; so do
models whose trace would drop meaning — grad-mode and autocast regions, hooks, in-place
updates of weights inside ``forward`` (:mod:`autosplit.passes.fidelity`). A model whose first
call registers hooks (``transformers``' output recording: router logits, hidden states) is
exported twice and kept when they are observers installed once
(:func:`~autosplit.passes.fidelity.installed_once`). A capture is faithful or it is refused; the
user's model is never changed by it.

Tied parameters (one ``Parameter`` owned by two modules, e.g. GPT's input embedding and output
projection) must be one graph node, or codegen would place two copies of it: modules that own one
are traced through, not kept as leaves, which turns the parameter into a single ``get_attr`` node.

Usage::

    captured = capture(model, (x,), {"attention_mask": mask})
    captured.gm.graph.print_tabular()
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import logging
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.fx.config

from autosplit.compat import PyTreeCodeGen as _PyTreeCodeGen
from autosplit.compat import graph_codegen, make_graph_module, pytree
from autosplit.errors import CaptureError, advice
from autosplit.passes.autocast_reads import autocast_reads
from autosplit.passes.fidelity import ModelSnapshot, RefuseStateWrites, functions_applied, hook_kinds, installed_once, keep_functions
from autosplit.passes.param_dtype import inputs_in, params_in
from autosplit.passes.tracer import Tracer, tied_owners

__all__ = ["Captured", "capture", "flat_inputs", "fingerprint", "module_path", "with_defaults"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Captured:
    """A captured model: its graph, how it was captured, and each node's module path."""

    gm: fx.GraphModule
    method: str
    """``"symbolic_trace"`` or ``"export"``."""
    module_paths: Mapping[str, str]
    """Node name → qualified name of the innermost module the node came from (``""`` = root)."""
    fixed_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments the capture fixed that the caller left out (``use_cache=False`` for a
    ``transformers`` model in training); every call of the graph passes them too."""
    signature: inspect.Signature | None = None
    """The signature of the model's ``forward``, to bind calls to the graph's placeholders."""
    output_type: type | None = None
    """The model's own output class when the graph returns it as a plain ``dict`` (a
    ``transformers`` ``ModelOutput``, a dict subclass, a dataclass); :meth:`restore_output`."""

    param_dtype: torch.dtype | None = None
    """The dtype the floating parameters were exported in (None: their own; :mod:`~autosplit.passes.param_dtype`)."""
    reads_autocast: tuple[str, ...] = ()
    """The model's functions that asked whether autocast is on while it was captured (:mod:`~autosplit.passes.autocast_reads`)."""

    def restore_output(self, out: Any) -> Any:
        """``out`` as the model's own output class."""
        cls = self.output_type
        if cls is None or not isinstance(out, dict):
            return out
        return cls(**out) if _keyword_built(cls) else cls(out)


def _keyword_built(cls: Any) -> bool:
    """A dataclass or a named tuple: built from its fields by keyword."""
    return isinstance(cls, type) and (dataclasses.is_dataclass(cls) or (issubclass(cls, tuple) and hasattr(cls, "_fields")))


def module_path(node: fx.Node) -> str:
    """The module path of a captured node: a ``call_module``'s target, the module a ``get_attr`` reads from,
    else the innermost module of its ``nn_module_stack`` (``""``: the root's own code)."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        # torch.export writes e.g. "L['self'].layers.0" in some versions; keep the dotted tail.
        return path.split("L['self'].")[-1] if "L['self']" in path else path
    return ""


def _concrete_args(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments symbolic tracing takes as constants: optional ones the call leaves out or passes
    as ``None`` (so ``if mask is not None`` takes the branch the call takes; fx asserts the value
    at run time) and flags passed as ``bool``. A tensor default stays an input: baked in, fx
    would store it on the model as an attribute the stages cannot see."""
    sig = inspect.signature(model.forward)
    given = sig.bind_partial(*args, **kwargs).arguments
    concrete = {
        name: p.default
        for name, p in sig.parameters.items()
        if name not in given and p.default is not inspect.Parameter.empty and not isinstance(p.default, torch.Tensor)
    }
    concrete.update({
        name: value for name, value in given.items()
        if (value is None or isinstance(value, bool)) and sig.parameters[name].kind not in _VARIADIC
    })
    return concrete


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _strip_tensor_defaults(graph: fx.Graph) -> None:
    """fx stores a tensor default of ``forward`` as a ``_tensor_constant`` read in the
    placeholder's default; the caller passes the value instead (:func:`flat_inputs` fills defaults)."""
    for ph in graph.find_nodes(op="placeholder"):
        if ph.args and isinstance(ph.args[0], fx.Node):
            const = ph.args[0]
            ph.args = ()
            if not const.users:
                graph.erase_node(const)


def _symbolic_trace(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule | None, type | None, list[str]]:
    """Trace with torch.fx: (graph, output class, ``[]``), or ``(None, None, what the trace would drop)``."""
    tracer = Tracer(tied_owners(model))
    guard = RefuseStateWrites(model)
    try:
        with guard, keep_functions(tracer):
            graph = tracer.trace(model, concrete_args=_concrete_args(model, args, kwargs) or None)
    except CaptureError:
        if guard.stopped is None:
            raise
    if guard.stopped is not None:  # also when forward caught the error and went on
        return None, None, [guard.stopped]
    if tracer.watch.lost:
        return None, None, tracer.watch.lost
    _strip_tensor_defaults(graph)
    output = next(iter(graph.find_nodes(op="output")))
    made = output.args[0]
    if isinstance(made, fx.Node) and made.op == "call_function" and _keyword_built(made.target):
        # fx builds a returned dataclass or named tuple in the graph; return its fields and rebuild
        # it outside, so every stage boundary carries tensors only.
        output.args = ({**dict(zip(getattr(made.target, "_fields", ()), made.args)), **made.kwargs},)
        graph.erase_node(made)
        tracer.output_type = typing.cast(type, made.target)
    name = model.__class__.__name__
    # Generating the module's Python code waits until something calls it or reads it: the
    # passes only interpret the graph, and for 10k nodes the code takes about a second.
    return make_graph_module(tracer.root, graph, name), tracer.output_type, []


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """torch.export records each node's Python stack: a fifth of its time on a 70B Llama, for a
    field no pass reads (capture errors name modules and nodes, not source lines). A speed knob only:
    a torch without it (2.11, on the lent GPUs) records the stacks."""
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        yield
        return
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    with functions_applied() as functions, _no_stack_traces():
        ep = torch.export.export(model, args, kwargs, strict=False)
    if functions:
        names = ", ".join(f"{f.__module__}.{f.__qualname__}" for f in functions)
        raise CaptureError(advice(
            f"{type(model).__name__} applies the custom autograd Function {names}, which torch.export traces "
            "through: its backward would be lost",
            "only symbolic tracing keeps a custom Function (as one node that runs its own backward), and it "
            "could not trace this model",
            "make the model symbolically traceable (capture='symbolic_trace' says why it is not), or replace the "
            "Function by ops with the gradient you want",
        ))
    backward_hooked = [q or "the root" for q, m in model.named_modules() if any("backward" in k for k in hook_kinds(m))]
    if backward_hooked:
        raise CaptureError(advice(
            f"{type(model).__name__} has backward hooks on {backward_hooked[:4]}, which torch.export does not keep",
            "a backward hook changes gradients outside the graph",
            "apply the hook's effect in forward (e.g. a custom op), or remove the hook while planning and training split",
        ))
    return ep.module()


def _training_kwargs(model: torch.nn.Module, kwargs: dict) -> dict[str, Any]:
    """Keyword arguments fixed for training that the caller left out: ``use_cache=False`` where
    ``forward`` takes ``use_cache`` (``transformers`` models return a KV cache by default,
    which training never reads and neither tracer can return)."""
    if "use_cache" in kwargs or "use_cache" not in inspect.signature(model.forward).parameters:
        return {}
    log.warning("capturing %s with use_cache=False: the KV cache is an inference output; training does not read it",
                type(model).__name__)
    return {"use_cache": False}


def capture(
    model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, method: str = "auto", param_dtype: torch.dtype | None = None,
) -> Captured:
    """Capture ``model`` as an fx graph. ``method``: ``"auto"``, ``"symbolic_trace"`` or ``"export"``.
    ``"auto"`` traces symbolically and falls back to ``torch.export`` where symbolic tracing fails or
    would drop meaning (:mod:`autosplit.passes.fidelity`). The model is left exactly as it was, whether
    capture succeeds or fails. ``param_dtype``: captured as it computes with its floating parameters
    and inputs cast to that dtype (:mod:`autosplit.passes.param_dtype`)."""
    if method not in ("auto", "symbolic_trace", "export"):
        raise CaptureError(advice(
            f"unknown capture method {method!r}", "autosplit captures with torch.fx or torch.export",
            "pass capture='auto', 'symbolic_trace' or 'export'",
        ))
    fixed = _training_kwargs(model, dict(kwargs or {}))
    kwargs = {**fixed, **(kwargs or {})}
    args, kwargs = inputs_in((tuple(args), kwargs), param_dtype)
    snapshot = ModelSnapshot.of(model)
    try:
        with params_in(model, param_dtype), autocast_reads() as reads:
            gm, used, output_type, reasons = _capture(model, args, kwargs, method)
            if snapshot.added_hooks(model):
                gm, used, output_type = _hooked_on_first_call(model, args, kwargs, method, snapshot, gm if used == "export" else None)
    finally:
        snapshot.restore(model)
    changed = snapshot.changes(model)
    if changed:
        raise CaptureError(advice(
            f"capturing {type(model).__name__} changed the model: {'; '.join(changed[:4])}",
            "forward changes the model's state at trace time in a way autosplit could not stop",
            "move the state change out of forward (e.g. an EMA update into the training loop)",
        ))
    if reasons:
        log.info("symbolic tracing would drop %s; captured with torch.export", "; ".join(reasons))
    paths = {n.name: module_path(n) for n in gm.graph.nodes}
    log.debug("captured %s with %s: %d nodes", type(model).__name__, used, len(gm.graph.nodes))
    return Captured(
        gm=gm, method=used, module_paths=paths, fixed_kwargs=fixed, signature=inspect.signature(model.forward),
        output_type=output_type, param_dtype=param_dtype if used == "export" else None, reads_autocast=tuple(reads),
    )


def _hooked_on_first_call(
    model: torch.nn.Module, args: tuple, kwargs: dict, method: str, snapshot: ModelSnapshot, first: fx.GraphModule | None,
) -> tuple[fx.GraphModule, str, None]:
    """The graph of a model whose first call registered hooks (``transformers`` installs its
    output-recording hooks so): both calls exported, and the second accepted by
    :func:`~autosplit.passes.fidelity.installed_once` when it equals the first
    (:mod:`autosplit.passes.fidelity` says why that is safe)."""
    name = type(model).__name__
    hooked = ", ".join(q or "the root" for q in list(snapshot.added_hooks(model))[:4])
    if method == "symbolic_trace":
        raise CaptureError(advice(
            f"{name}'s forward registered hooks on {hooked} while it was traced",
            "symbolic tracing does not run hooks, so what they record for the output is lost",
            "pass capture='auto' or capture='export' (torch.export runs them)",
        ))
    if first is None:  # symbolically traced: the hooks did not run; export the first call again
        snapshot.restore(model)
        first = _export(model, args, kwargs)
    second = installed_once(model, snapshot, lambda: _export(model, args, kwargs))
    if _structure(first) != _structure(second):
        raise CaptureError(advice(
            f"{name}'s first call computes another graph than its second ({len(first.graph.nodes)} vs "
            f"{len(second.graph.nodes)} nodes), after it registered hooks on {hooked}",
            "hooks installed during the first call act from the second call on only",
            "call the model once before planning, so that its hooks are in place from the start",
        ))
    log.info("%s registered observing hooks on %s on its first call, once; captured with them", name, hooked)
    return second, "export", None


def _structure(gm: fx.GraphModule) -> tuple[str, str]:
    """The graph's :func:`fingerprint` and the structure of its output."""
    codegen = graph_codegen(gm.graph)
    return fingerprint(gm), str(codegen.pytree_info.out_spec if isinstance(codegen, _PyTreeCodeGen) else None)


def _capture(model: torch.nn.Module, args: tuple, kwargs: dict, method: str) -> tuple[fx.GraphModule, str, type | None, list[str]]:
    """(graph, method used, output class, what symbolic tracing would have dropped)."""
    errors: list[str] = []
    lost: list[str] = []
    if method in ("auto", "symbolic_trace"):
        try:
            gm, output_type, lost = _symbolic_trace(model, args, kwargs)
        except Exception as e:  # noqa: BLE001 -- fx raises many types (TraceError, TypeError, ...); export is tried next
            errors.append(f"symbolic_trace: {type(e).__name__}: {e}")
            log.info("symbolic tracing failed (%s); falling back to torch.export", e)
        else:
            if gm is not None:
                return gm, "symbolic_trace", output_type, []
            if method == "symbolic_trace":
                raise CaptureError(advice(
                    f"symbolic tracing of {type(model).__name__} would silently drop: " + "; ".join(lost),
                    "torch.fx records only the ops on traced values; context managers, hooks, custom Functions' "
                    "backwards and eager writes into weights happen at trace time and are lost",
                    "pass capture='auto' or capture='export' (torch.export records grad-mode and autocast regions "
                    "and root hooks), or move the construct out of forward",
                ))
            errors.append("symbolic_trace would drop: " + "; ".join(lost))
    if method in ("auto", "export"):
        try:
            return _export(model, args, kwargs), "export", None, lost
        except CaptureError as e:
            if errors:
                e.add_note("symbolic tracing was tried first: " + " | ".join(line.splitlines()[0][:300] for line in errors))
            raise
        except Exception as e:  # noqa: BLE001 -- reported below with the tracer's error, in a CaptureError
            errors.append(f"torch.export: {type(e).__name__}: {e}")
    _refuse_flex_attention(model, args, kwargs)
    details = "\n  ".join(line.splitlines()[0][:400] for line in errors)
    if lost:  # the tracer that would have worked drops meaning: say that first
        raise CaptureError(advice(
            f"could not capture {type(model).__name__} faithfully:\n  {details}\n",
            "symbolic tracing would silently drop what it names, and torch.export could not capture the model",
            "move that construct out of forward (an EMA or momentum update into the training loop after "
            "optimizer.step(); a hook's effect into forward), then plan again",
        )) from None
    raise CaptureError(advice(
        f"could not capture {type(model).__name__}:\n  {details}\n",
        "most often Python control flow on tensor values, or an input or output type torch.export does not know",
        "move data-dependent branches into a leaf module (autosplit keeps standard torch.nn modules as leaves) or "
        "use torch.where / torch.cond; register custom output classes with torch.utils._pytree; or pass "
        "capture='export' with static example inputs",
    )) from None


def _refuse_flex_attention(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Where a model that could not be captured runs FlexAttention (torchtitan 0.3's language models do),
    say why and what to switch, instead of the tracers' own messages."""
    flex = [q or type(model).__name__ for q, m in model.named_modules() if "FlexAttention" in type(m).__name__]
    masks = [x for x in pytree.tree_leaves((args, kwargs)) if type(x).__name__ == "BlockMask"]
    if not (flex or masks):
        return
    raise CaptureError(advice(
        f"{type(model).__name__} runs FlexAttention ({', '.join(flex[:2]) or 'a BlockMask among its inputs'}"
        f"{' …' if len(flex) > 2 else ''}), whose mask is a BlockMask: neither tracer takes a BlockMask as an input (torch.export "
        "takes tensors and containers of them), and torch's FlexAttention has no backward on a CPU",
        "torchtitan 0.3 builds its language models with FlexAttention and a document-causal BlockMask made by the training loop",
        "plan the same model built with causal scaled-dot-product attention: in torchtitan, set each layer config's "
        "attention.inner_attention = ScaledDotProductAttention.Config() (the same modules and parameters, so the plan and its "
        "export apply to the FlexAttention model), and pass the tokens alone",
    )) from None


def flat_inputs(captured: Captured, args: tuple, kwargs: Mapping[str, Any] | None) -> list[Any]:
    """The values of the graph's placeholders, in order, for a call ``model(*args, **kwargs)``."""
    kwargs = {**captured.fixed_kwargs, **(kwargs or {})}
    if isinstance(graph_codegen(captured.gm.graph), _PyTreeCodeGen) or captured.signature is None:
        return list(pytree.tree_leaves((tuple(args), kwargs)))
    # Symbolic tracing makes one placeholder per forward parameter, in signature order
    # (concrete_args may rename them, so match by position, not by name).
    bound = captured.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = list(bound.arguments.values())
    placeholders = list(captured.gm.graph.find_nodes(op="placeholder"))
    if len(values) != len(placeholders):
        raise CaptureError(advice(
            f"forward takes {len(values)} arguments but the graph has "
            f"{len(placeholders)} placeholders", "symbolic tracing cannot follow *args/**kwargs signatures",
            "capture with capture='export'",
        ))
    return values


def with_defaults(captured: Captured, args: tuple, kwargs: Mapping[str, Any] | None) -> tuple[tuple, dict[str, Any]]:
    """The call ``(args, kwargs)`` with every default of ``forward`` written out, so that a tensor
    default of the batch's rows is cut into micro-batches like any input (a symbolically traced
    graph takes it as one; an exported one holds it, so its call is left as it is)."""
    if captured.method == "export" or captured.signature is None:
        return tuple(args), dict(kwargs or {})
    bound = captured.signature.bind(*args, **{**captured.fixed_kwargs, **(kwargs or {})})
    bound.apply_defaults()
    return tuple(bound.args), dict(bound.kwargs)


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}"


def fingerprint(gm: fx.GraphModule) -> str:
    """Hash of the graph's structure (ops, targets, edges) and its parameter shapes.

    Input shapes are left out on purpose: a plan stays valid for another batch size.
    """
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        inputs = ",".join(a.name for a in n.all_input_nodes)
        h.update(f"{n.op}|{n.name}|{_target_name(n.target)}|{inputs}\n".encode())
    for name, p in gm.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return h.hexdigest()[:16]
