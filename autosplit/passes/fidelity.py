"""What a capture would silently drop, found while it runs — and the user's model kept as it was.

``torch.fx``'s symbolic tracer runs ``forward`` in Python with proxies in place of tensors.
What happens at trace time and is not an op on a proxy never reaches the graph:

- **grad-mode and autocast regions** (``with torch.no_grad():`` around a frozen backbone,
  ``with torch.autocast(...)``): the context manager runs while tracing, the ops inside
  are recorded without it — the split would train the backbone, or compute in fp32;
- **custom ``torch.autograd.Function``\\ s**: their ``forward`` is traced through and their
  ``backward`` is lost (a gradient-reversal layer would pass gradients unchanged);
- **hooks** of the modules it traces through — the root's included — since it calls
  ``forward``, not ``__call__``;
- **eager writes into parameters and buffers** (an EMA teacher or MoCo's momentum encoder
  updated inside ``forward`` through ``.parameters()``): the write would run once, on the
  user's real weights, while planning, and never while training.

:class:`Watch` records the first three while the tracer runs; :class:`RefuseStateWrites`
stops the fourth *before* the write happens. ``capture`` then falls back to
``torch.export`` (which records grad-mode and autocast regions as higher-order ops, keeps
root hooks, and traces on fake weights) or refuses. A custom Function is kept by symbolic
tracing as one node that calls ``Function.apply`` (:func:`keep_functions`), so its own
backward runs; ``torch.export`` traces through it, so it is refused there
(:func:`functions_applied`).

:class:`ModelSnapshot` is the contract that planning never changes the user's model:
parameters, buffers (identity, version, ``requires_grad``), hooks and attributes, compared
before and after; what forward does to a module's Python state while it is traced (attributes
added or rebound, hooks registered) is undone by :meth:`ModelSnapshot.restore`.

**Hooks a library installs on the first call.** ``transformers`` registers forward hooks on a
model's layers, attention and MoE routers the first time an output it records is asked for
(``output_router_logits=True``, ``output_hidden_states`` …), and marks the model so it never
installs them again; each hook appends a module's output to a collector the model's outer
``forward`` returns (the router logits). Such a model's state changes once, then never. Hooks
registered *while capturing* are accepted by :func:`installed_once` only when all of these hold:

1. captured **again** from the state the first call left, the model's hooks and attributes do
   not change (the state is a fixed point of forward: every later call runs from the same
   state, so it traces the same graph; a forward that registers a hook per call is refused);
2. in that second call every such hook **returns** ``None``: it observes, and neither replaces a
   module's inputs nor its output (a hook that changes values is refused, whoever installs it);
3. both calls are captured with ``torch.export`` — which calls every module with its hooks, so
   what an observer feeds into the output (the recorded router logits) is in the graph, where
   symbolic tracing would lose it — and the two graphs are the same (the caller compares them):
   the first call is no exception, hooks that start acting only from the second call are refused.

Planning then leaves the model **exactly as it was**: the hooks and the library's mark are both
removed (:meth:`ModelSnapshot.restore`), so the model's next call installs them once, as its
first call would have; after planning and one call the model is as after one call. Removing
the hooks without the mark would make the library install a second set and record every
output twice.

Usage::

    snapshot = ModelSnapshot.of(model)
    with RefuseStateWrites(model) as guard, keep_functions(tracer):
        graph = tracer.trace(model)
    snapshot.restore(model)
    assert not snapshot.changes(model)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from autosplit.compat import TENSOR_DATA, TorchDispatchMode, pytree
from autosplit.errors import CaptureError, advice

__all__ = ["ModelSnapshot", "RefuseStateWrites", "Watch", "functions_applied", "hook_kinds", "installed_once", "keep_functions"]

_DEVICE_TYPES = ("cpu", "cuda")
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_FORWARD_HOOKS = _HOOKS[:2]
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
"""Per-hook flags, keyed by the same handle id as the hook."""
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
"""``training``, the parameter, buffer, submodule and hook dicts: compared by :meth:`ModelSnapshot.changes`, not rebound."""
_T = TypeVar("_T")


def _global_state() -> tuple:
    """Grad mode, inference mode and the autocast state per device type."""
    autocast = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None)
        for d in _DEVICE_TYPES
    )
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)


def _describe(state: tuple) -> str:
    grad, inference, autocast = state
    parts = []
    if inference:
        parts.append("torch.inference_mode()")
    elif not grad:
        parts.append("torch.no_grad()")
    parts += [f"torch.autocast({d!r}, dtype={dtype})" for d, (on, dtype) in zip(_DEVICE_TYPES, autocast) if on]
    return " + ".join(parts) or "torch.enable_grad()"


class Watch:
    """What symbolic tracing of one model drops, in the user's terms (:attr:`lost`, one line per construct)."""

    def __init__(self) -> None:
        self.entry = _global_state()
        self._regions: dict[str, list[str]] = {}  # a grad/autocast state → the modules its ops came from
        self._hooks: list[str] = []

    def node_created(self, op: str, module_path: str) -> None:
        """Called for every node: a region of other grad/autocast state than at entry is dropped."""
        state = _global_state()
        if state != self.entry and op != "placeholder":
            paths = self._regions.setdefault(_describe(state), [])
            if module_path not in paths:
                paths.append(module_path)

    def module_traced_through(self, qualname: str, module: torch.nn.Module) -> None:
        kinds = hook_kinds(module)
        if kinds:
            name = qualname or f"the root module ({type(module).__name__})"
            self._hooks.append(f"{', '.join(kinds)} on {name} (symbolic tracing calls forward, not the module with its hooks)")

    @property
    def lost(self) -> list[str]:
        regions = [
            f"a `with {state}:` region around the ops of {', '.join(p or 'the root' for p in paths[:4])}"
            f"{' …' if len(paths) > 4 else ''} (symbolic tracing records the ops without it)"
            for state, paths in self._regions.items()
        ]
        return regions + self._hooks


def hook_kinds(module: torch.nn.Module) -> list[str]:
    """The kinds of hooks registered on ``module`` or globally for every module."""
    from torch.nn.modules import module as nn_module

    own = [name.strip("_").replace("_", " ") for name in _HOOKS if getattr(module, name, None)]
    global_ = [
        f"global {name.strip('_').replace('_global_', '').replace('_', ' ')}"
        for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks")
        if getattr(nn_module, name, None)
    ]
    return own + global_


_TENSOR_DATA = TENSOR_DATA


class RefuseStateWrites(TorchDispatchMode):
    """Stops, before it runs, every eager op that would write into the model's parameters or
    buffers (their ``.data`` included: the check is by storage), and every assignment to their
    ``.data``. Ops on tracing proxies never reach the dispatcher, so only what would run on
    real tensors at trace time is seen."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.stopped: str | None = None
        """The first write stopped, in the user's terms (None: none was tried)."""
        self._names: dict[StorageWeakRef, str] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            with contextlib.suppress(RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
                self._names.setdefault(StorageWeakRef(t.untyped_storage()), name)

    def _state_name(self, t: Any) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        try:
            return self._names.get(StorageWeakRef(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return None

    def __enter__(self) -> RefuseStateWrites:
        data = _TENSOR_DATA

        def set_data(t: torch.Tensor, value: torch.Tensor) -> None:
            name = self._state_name(t)
            if name is not None:
                self._stop(f"an assignment to {name}.data inside forward")
            data.__set__(t, value)

        torch.Tensor.data = property(data.__get__, set_data)  # type: ignore[assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        del torch.Tensor.data
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for name in filter(None, map(self._state_name, pytree.tree_leaves(value))):
                    self._stop(f"an in-place update of {name} inside forward ({func})")
        return func(*args, **kwargs)

    def _stop(self, construct: str) -> None:
        self.stopped = self.stopped or construct
        raise CaptureError(advice(
            f"{construct} was stopped before it ran", "symbolic tracing runs forward's eager code on the real weights",
            "capture with torch.export (capture='auto' does), or move the update out of forward",
        ))


# -- custom autograd Functions ---------------------------------------------------------------------

_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]


@functools.cache
def _applier(function: type[torch.autograd.Function]) -> Any:
    """A graph target that calls ``function.apply``: the Function runs with its own backward."""

    def apply(*args: Any, **kwargs: Any) -> Any:
        return function.apply(*args, **kwargs)

    apply.__name__ = f"{function.__name__}_apply"
    apply.__qualname__ = f"{function.__qualname__}.apply"
    apply.__module__ = __name__  # not torch's: fx then calls it through a global, not by dotted name
    apply.autograd_function = function  # type: ignore[attr-defined]
    return apply


def _is_users(function: type) -> bool:
    return not function.__module__.startswith("torch.")


@contextlib.contextmanager
def keep_functions(tracer: fx.Tracer) -> Iterator[None]:
    """While ``tracer`` runs, ``SomeFunction.apply`` on proxies becomes one ``call_function`` node."""

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves((args, kwargs))):
            return tracer.create_proxy("call_function", _applier(cls), args, kwargs)
        return _FUNCTION_APPLY.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.autograd.Function.apply = _FUNCTION_APPLY  # type: ignore[method-assign]


@contextlib.contextmanager
def functions_applied() -> Iterator[list[type]]:
    """The user-defined autograd Functions applied while the block runs (torch's own left out)."""
    seen: list[type] = []

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if _is_users(cls) and cls not in seen:
            seen.append(cls)
        return _FUNCTION_APPLY.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield seen
    finally:
        torch.autograd.Function.apply = _FUNCTION_APPLY  # type: ignore[method-assign]


# -- the user's model, before and after -----------------------------------------------------------


def _tensor_state(t: torch.Tensor) -> tuple:
    return (id(t), t.requires_grad, t.device, t.dtype, tuple(t.shape), t.grad is None)


@dataclass(frozen=True)
class ModelSnapshot:
    """Everything of a model that planning must leave as it was (values by version counter)."""

    attributes: dict[str, frozenset[str]]
    tensors: dict[str, tuple]
    versions: dict[str, int]
    """Each tensor's version counter: bumped by every in-place write (a write undone still counts)."""
    hooks: dict[str, tuple]
    training: dict[str, bool]
    values: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False, repr=False)
    """Each module's own attributes (not torch's internals), by object: :meth:`restore` rebinds them."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelSnapshot:
        modules = dict(model.named_modules(remove_duplicate=False))
        state = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        return cls(
            attributes={q: frozenset(vars(m)) for q, m in modules.items()},
            tensors={name: _tensor_state(t) for name, t in state},
            versions={name: t._version for name, t in state},
            hooks={q: tuple(tuple(getattr(m, h, {}).items()) for h in _HOOKS) for q, m in modules.items()},
            training={q: m.training for q, m in modules.items()},
            values={q: {k: v for k, v in vars(m).items() if k not in _MODULE_INTERNALS} for q, m in modules.items()},
        )

    def added_hooks(self, model: torch.nn.Module) -> dict[str, list[tuple[str, int]]]:
        """Hooks registered since the snapshot: module path → ``(hook dict, handle id)`` (empty: none)."""
        added: dict[str, list[tuple[str, int]]] = {}
        for q, m in model.named_modules():  # a shared module once: its hook dicts are one
            before = self.hooks.get(q, ((),) * len(_HOOKS))
            new = [(h, key) for h, old in zip(_HOOKS, before) for key in getattr(m, h, {}) if key not in dict(old)]
            if new:
                added[q] = new
        return added

    def restore(self, model: torch.nn.Module) -> None:
        """Undo what a traced ``forward`` did to the modules' Python state: attributes added since
        the snapshot removed (``torch.fx`` stores traced tensor constants on the root as
        ``_tensor_constant0`` …; ``transformers`` marks a model whose hooks it installed), attributes
        rebound put back, hooks added removed. Parameters, buffers, training flags and hooks removed
        are left as they are, for :meth:`changes` to report."""
        modules = dict(model.named_modules(remove_duplicate=False))
        for q, entries in self.added_hooks(model).items():
            for h, key in entries:
                for name in (h, *_HOOK_FLAGS):
                    getattr(modules[q], name, {}).pop(key, None)
        for q, m in modules.items():
            for name in set(vars(m)) - self.attributes.get(q, frozenset()):
                delattr(m, name)
            for name, value in self.values.get(q, {}).items():
                if name in vars(m) and vars(m)[name] is not value:
                    m.__dict__[name] = value

    def changes(self, model: torch.nn.Module, *, versions: bool = True) -> list[str]:
        """What differs from the snapshot, one line each (empty: untouched). ``versions=False``
        ignores writes (a pass that writes and restores values is checked by value instead)."""
        now = ModelSnapshot.of(model)
        out = []
        for q in sorted(set(self.attributes) | set(now.attributes)):
            added = now.attributes.get(q, frozenset()) - self.attributes.get(q, frozenset())
            removed = self.attributes.get(q, frozenset()) - now.attributes.get(q, frozenset())
            if added or removed:
                out.append(f"attributes of {q or 'the root'}: added {sorted(added)}, removed {sorted(removed)}")
        fields = ("object", "requires_grad", "device", "dtype", "shape", "gradient")
        for name in sorted(set(self.tensors) | set(now.tensors)):
            a, b = self.tensors.get(name), now.tensors.get(name)
            if a is None or b is None:
                out.append(f"{name}: {'added' if a is None else 'removed'}")
            elif a != b:
                out.append(f"{name}: {', '.join(f for f, x, y in zip(fields, a, b) if x != y)} changed")
            elif versions and self.versions[name] != now.versions[name]:
                out.append(f"{name}: written in place ({now.versions[name] - self.versions[name]} writes)")
        out += [f"hooks of {q or 'the root'} changed" for q in self.hooks if self.hooks[q] != now.hooks.get(q)]
        out += [f"training flag of {q or 'the root'} changed" for q in self.training if self.training[q] != now.training.get(q)]
        return out


def installed_once(model: torch.nn.Module, before: ModelSnapshot, again: Callable[[], _T]) -> _T:
    """``again()`` — the model captured a second time — where the hooks registered since ``before``
    (by the first capture) are shown to be observers installed once: during the second call no
    hook or attribute is added or removed, and each of those hooks returns ``None`` (rules 1 and 2
    of the module docstring; the caller compares the two graphs). Raises :class:`CaptureError`
    otherwise.

    Usage: ``graph = installed_once(model, snapshot, lambda: export(model))``
    """
    name = type(model).__name__
    modules = dict(model.named_modules())
    after_first = ModelSnapshot.of(model)
    returned: list[str] = []
    wrapped = []
    for q, entries in before.added_hooks(model).items():
        for h, key in entries:
            if h in _FORWARD_HOOKS:
                hooks = getattr(modules[q], h)
                wrapped.append((hooks, key, hooks[key]))
                hooks[key] = _observed(hooks[key], f"a {h.strip('_').replace('_', ' ')[:-1]} on {q or 'the root'}", returned)
    try:
        result = again()
    finally:
        for hooks, key, hook in wrapped:
            if key in hooks:
                hooks[key] = hook
    if returned:
        raise CaptureError(advice(
            f"{name}'s forward installed hooks that change values: {', '.join(returned[:4])} returned a value",
            "a hook that returns a value replaces the module's inputs or output; autosplit accepts hooks a forward "
            "installs only when they observe (return None), as the output-recording hooks of transformers do",
            "apply the hook's effect in forward, or register the hook before planning and keep it for training",
        ))
    changed = after_first.changes(model, versions=False)
    if changed:
        raise CaptureError(advice(
            f"{name}'s forward changes the model on every call, not only the first: {'; '.join(changed[:4])} "
            "on its second call",
            "hooks a library installs once are accepted; a forward that keeps registering hooks or attributes "
            "computes something else on each call",
            "register the hooks once, outside forward (or behind a flag forward sets), then plan again",
        ))
    return result


def _observed(hook: Callable[..., Any], name: str, returned: list[str]) -> Callable[..., Any]:
    """``hook``, noting ``name`` in ``returned`` when it returns a value."""

    @functools.wraps(hook)
    def observed(*args: Any, **kwargs: Any) -> Any:
        result = hook(*args, **kwargs)
        if result is not None and name not in returned:
            returned.append(name)
        return result

    return observed
