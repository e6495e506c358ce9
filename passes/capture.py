"""Capture: ``nn.Module`` → ``torch.fx.GraphModule``, every node labelled with its module path.

Symbolic tracing comes first: it keeps the user's Python-level ops and module calls, and
is cheap. Models it cannot follow (data-dependent control flow, most ``transformers``
models) fall back to ``torch.export`` in non-strict mode, whose graph holds ATen ops.

Tied parameters (one ``Parameter`` owned by two modules, e.g. GPT's input embedding and
output projection) must be visible as *one* graph node, or codegen would place two
copies of it. Modules that own a tied parameter are therefore traced through instead of
kept as leaves, which turns the parameter into a single ``get_attr`` node.

Usage::

    captured = capture(model, (x,), {"attention_mask": mask})
    captured.gm.graph.print_tabular()
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.graph import _PyTreeCodeGen
from torch.utils import _pytree as pytree

from autosplit.errors import CaptureError, advice

__all__ = ["Captured", "capture", "flat_inputs", "fingerprint"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Captured:
    """A captured model: its graph, how it was captured, and each node's module path."""

    gm: fx.GraphModule
    method: str
    """``"symbolic_trace"`` or ``"export"``."""
    module_paths: Mapping[str, str]
    """Node name → qualified name of the innermost module the node came from (``""`` = root)."""


def _tied_owners(model: torch.nn.Module) -> set[str]:
    """Qualified names of modules that own a parameter also owned by another module."""
    owners: dict[int, set[str]] = defaultdict(set)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners[id(p)].add(mod_name)
    return {name for names in owners.values() if len(names) > 1 for name in names}


class _Tracer(fx.Tracer):
    """Default leaves (``torch.nn`` modules), except modules that own tied parameters."""

    def __init__(self, trace_through: set[str]):
        super().__init__()
        self.trace_through = trace_through
        # Buffers read in forward (masks, running stats) become get_attr nodes, so slicing
        # them by traced sizes works and codegen places them like parameters.
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if qualname in self.trace_through:
            return False
        return super().is_leaf_module(m, qualname)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        state = [*root.named_parameters(), *root.named_buffers()] if isinstance(root, torch.nn.Module) else []
        self._state_names = {id(t): name for name, t in reversed(state)}  # reversed: the first name wins
        return super().trace(root, concrete_args)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """fx's own lookup scans every parameter and buffer of the model on each read, which is
        quadratic in depth (seconds at 260 layers); this one is a dict lookup, same result."""
        name = self._state_names.get(id(attr_val)) if isinstance(attr_val, torch.Tensor) else None
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]


def _module_path(node: fx.Node) -> str:
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


def _symbolic_trace(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    # Optional arguments the example call leaves out (``attention_mask=None``) are traced
    # as their defaults, so ``if mask is not None`` takes the branch the call takes.
    sig = inspect.signature(model.forward)
    given = sig.bind_partial(*args, **kwargs).arguments
    concrete = {
        name: p.default
        for name, p in sig.parameters.items()
        if name not in given and p.default is not inspect.Parameter.empty
    }
    tracer = _Tracer(_tied_owners(model))
    graph = tracer.trace(model, concrete_args=concrete or None)
    name = model.__class__.__name__
    # Generating the module's Python code waits until something calls it or reads it: the
    # passes only interpret the graph, and for 10k nodes the code takes about a second.
    with _use_lazy_graph_module(True):
        return _make_graph_module(tracer.root, graph, name)


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    ep = torch.export.export(model, args, kwargs, strict=False)
    return ep.module()


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, method: str = "auto") -> Captured:
    """Capture ``model`` as an fx graph. ``method``: ``"auto"``, ``"symbolic_trace"`` or ``"export"``."""
    kwargs = dict(kwargs or {})
    if method not in ("auto", "symbolic_trace", "export"):
        raise CaptureError(advice(
            f"unknown capture method {method!r}", "autosplit captures with torch.fx or torch.export",
            "use 'auto', 'symbolic_trace' or 'export'",
        ))
    errors: list[str] = []
    gm = None
    used = method
    if method in ("auto", "symbolic_trace"):
        try:
            gm = _symbolic_trace(model, tuple(args), kwargs)
            used = "symbolic_trace"
        except Exception as e:  # noqa: BLE001 -- fx raises many types (TraceError, TypeError, ...); export is tried next
            errors.append(f"symbolic_trace: {type(e).__name__}: {e}")
            log.info("symbolic tracing failed (%s); falling back to torch.export", e)
    if gm is None and method in ("auto", "export"):
        try:
            gm = _export(model, tuple(args), kwargs)
            used = "export"
        except Exception as e:  # noqa: BLE001 -- reported below with the tracer's error, in a CaptureError
            errors.append(f"torch.export: {type(e).__name__}: {e}")
    if gm is None:
        details = "\n  ".join(line.splitlines()[0][:400] for line in errors)
        raise CaptureError(advice(
            f"could not capture {type(model).__name__}:\n  {details}\n",
            "Python control flow that depends on tensor values, or an op neither tracer supports",
            "move data-dependent branches into a leaf module (autosplit keeps standard torch.nn modules as "
            "leaves), replace `if tensor:` by torch.where / torch.cond, or pass method='export' with static "
            "example inputs",
        )) from None
    paths = {n.name: _module_path(n) for n in gm.graph.nodes}
    log.debug("captured %s with %s: %d nodes", type(model).__name__, used, len(gm.graph.nodes))
    return Captured(gm=gm, method=used, module_paths=paths)


def flat_inputs(captured: Captured, model: torch.nn.Module, args: tuple, kwargs: dict | None) -> list[Any]:
    """The values of the graph's placeholders, in order, for a call ``model(*args, **kwargs)``."""
    kwargs = dict(kwargs or {})
    if isinstance(captured.gm.graph._codegen, _PyTreeCodeGen):
        return list(pytree.tree_leaves((tuple(args), kwargs)))
    # Symbolic tracing makes one placeholder per forward parameter, in signature order
    # (concrete_args may rename them, so match by position, not by name).
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values = list(bound.arguments.values())
    placeholders = list(captured.gm.graph.find_nodes(op="placeholder"))
    if len(values) != len(placeholders):
        raise CaptureError(advice(
            f"{type(model).__name__}.forward takes {len(values)} arguments but the graph has "
            f"{len(placeholders)} placeholders", "symbolic tracing cannot follow *args/**kwargs signatures",
            "capture with method='export'",
        ))
    return values


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
