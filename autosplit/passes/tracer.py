"""The symbolic tracer capture runs (:func:`~autosplit.passes.capture.capture`): ``torch.fx``'s, with
``torch.nn`` modules as leaves except those that own a tied parameter (one ``Parameter`` owned by two
modules must be one ``get_attr`` node, or codegen would place two copies of it), a watch on what the
trace would drop (:class:`~autosplit.passes.fidelity.Watch`), the model's own output class kept, and
parameter reads looked up in a dict.

Usage::

    tracer = Tracer(tied_owners(model))
    graph = tracer.trace(model)
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any

import torch
import torch.fx as fx

from autosplit.passes.fidelity import Watch

__all__ = ["Tracer", "tied_owners"]


def tied_owners(model: torch.nn.Module) -> set[str]:
    """Qualified names of modules that own a parameter also owned by another module."""
    owners: dict[int, set[str]] = defaultdict(set)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners[id(p)].add(mod_name)
    return {name for names in owners.values() if len(names) > 1 for name in names}


class Tracer(fx.Tracer):
    """Default leaves (``torch.nn`` modules), except modules that own tied parameters; watches
    for what the trace drops (:class:`~autosplit.passes.fidelity.Watch`)."""

    def __init__(self, trace_through: set[str]):
        super().__init__()
        self.trace_through = trace_through
        # Buffers read in forward (masks, running stats) become get_attr nodes, so slicing
        # them by traced sizes works and codegen places them like parameters.
        self.proxy_buffer_attributes = True
        self.watch = Watch()
        self.output_type: type | None = None
        self._arg_depth = 0

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if qualname in self.trace_through:
            return False
        return super().is_leaf_module(m, qualname)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        state = [*root.named_parameters(), *root.named_buffers()] if isinstance(root, torch.nn.Module) else []
        self._state_names = {id(t): name for name, t in reversed(state)}  # reversed: the first name wins
        if isinstance(root, torch.nn.Module):
            self.watch.module_traced_through("", root)
        return super().trace(root, concrete_args)

    def call_module(self, m: torch.nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        qualname = self.path_of_module(m)
        if not self.is_leaf_module(m, qualname):
            self.watch.module_traced_through(qualname, m)
        return super().call_module(m, forward, args, kwargs)

    def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **more: Any) -> fx.Proxy:
        stack = list(self.module_stack.values())
        self.watch.node_created(kind, stack[-1][0] if stack else "")
        return super().create_proxy(kind, target, args, kwargs, *rest, **more)

    def create_arg(self, a: Any) -> Any:
        # The last top-level call is the return value of forward: remember its own class where
        # fx would flatten it to a plain dict (a dict subclass, a dataclass such as ModelOutput).
        if self._arg_depth == 0:
            self.output_type = type(a) if isinstance(a, dict) and type(a) not in (dict, OrderedDict) else None
        self._arg_depth += 1
        try:
            return super().create_arg(a)
        finally:
            self._arg_depth -= 1

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """fx's own lookup scans every parameter and buffer of the model on each read, which is
        quadratic in depth (seconds at 260 layers); this one is a dict lookup, same result."""
        name = self._state_names.get(id(attr_val)) if isinstance(attr_val, torch.Tensor) else None
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]
