"""``compile=True``: every stage module compiled with ``torch.compile``, in place, or told why not.

torchtitan compiles each repeated block (``TransformerBlock``) on its own (``fullgraph=True``) and
leaves the rest eager: one compiled code object is reused by every layer, and the graph breaks
outside the blocks never reach the compiler. autosplit's stages are not module trees: codegen
emits one flat ``torch.fx.GraphModule`` per stage, whose layers are inlined calls of the leaf
modules, so there is no block boundary left to compile at. The stage as a whole is the compiled
region instead — its forward is one generated function, which dynamo traces into one graph, unless an op breaks it (with
every layer in it, so inductor can fuse across layer boundaries; the price is a compile time that
grows with the stage's layers, where torchtitan's stays one block's).

Compilation happens in place, with ``nn.Module.compile()``: the stage's parameters, their names,
``state_dict`` and the module's identity stay as they were (``torch.compile(module)`` would wrap it in
an ``OptimizedModule`` and prefix every name with ``_orig_mod.``), so a pipeline stage, FSDP or an
optimizer built on the module afterwards sees the same objects. The user's model is not touched:
the stages share its leaf modules, and only the stage ``GraphModule`` is compiled.

Where compilation cannot run, :func:`compile_stages` says so before anything is compiled:
``torch.compile`` unsupported in this Python, an unknown backend, or (``"inductor"``) no working C++
compiler for CPU stages (inductor's own search of ``$CXX`` / ``g++``) or no triton for GPU stages.
Errors that only show when a stage first runs (an op the backend refuses, a compiler that fails on
the generated code) are caught around each stage's call: with the backward compiled together with
the forward (:func:`autosplit.compat.eager_backward_compile`), they surface in the forward, before
the stage has run. The stage then runs once eagerly — an error there too is the model's own and is
raised as itself — and, by ``fallback``, either a :class:`~autosplit.errors.CompileError` names the
stage and the cause, or a logged warning names both and the stage runs eagerly from then on (its
status in the dict :func:`compile_stages` returned turns to ``"eager: <cause>"``). Nothing here waits
on anything: a failure is an exception in the calling thread (in a pipeline, its peers then learn of
it from the distributed runtime; ``fallback=True`` keeps every rank going). One caveat: a stage whose
graph breaks runs some pieces before a later piece fails to compile; its eager rerun repeats them.
A stage holding DTensors (tensor parallelism) compiles apart from inductor's on-disk caches, which the
ranks share under keys that do not hold the rank (:func:`autosplit.compat.rank_local_compile`).

Usage::

    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(x,), compile=True)
    split.compiled                                   # {0: "compiled", 1: "compiled"}
    status = compile_stages(stage_modules, fallback=True)   # one rank's {stage index: module}, in place
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from autosplit import compat
from autosplit.errors import CompileError, ConstraintError, advice

__all__ = ["CompileOptions", "compile_options", "compile_stages", "compile_blocker"]

log = logging.getLogger(__name__)

COMPILED = "compiled"

# One reusable, re-entrant context (torch's config patch keeps its priors in a stack), made once:
# entering it costs 3 µs a stage call where making a fresh one costs 15.
_eager_backward_compile = functools.cache(compat.eager_backward_compile)
_rank_local_compile = functools.cache(compat.rank_local_compile)


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How :func:`compile_stages` compiles (``compile=CompileOptions(...)``; ``compile=True`` is the default)."""

    backend: str | Callable[..., Any] = "inductor"
    """``torch.compile``'s backend: ``"inductor"`` (generated C++ on CPU, triton on GPU), ``"aot_eager"``, … or a callable."""
    mode: str | None = None
    """``torch.compile``'s mode (``"max-autotune"``, ``"reduce-overhead"``, …); ``None`` is its default."""
    fullgraph: bool = False
    """Refuse graph breaks (an error, or with ``fallback`` an eager stage) instead of running the pieces eagerly."""
    dynamic: bool | None = None
    """``torch.compile``'s ``dynamic``: ``None`` recompiles for a second shape with dynamic sizes."""
    fallback: bool = False
    """Where a stage cannot be compiled: ``False`` raises :class:`~autosplit.errors.CompileError`; ``True`` logs
    a warning naming the stage and the cause and runs that stage eagerly."""


def compile_options(value: bool | CompileOptions) -> CompileOptions | None:
    """``compile=`` as given to ``autosplit``/``Planner.build``: ``None`` (eager), or the options to compile with."""
    if isinstance(value, CompileOptions):
        return value
    if isinstance(value, bool):
        return CompileOptions() if value else None
    raise ConstraintError(advice(
        f"compile={value!r} ({type(value).__name__})",
        "compile takes True, False or autosplit.runtime.compiled.CompileOptions(...)",
        "pass compile=True, or compile=CompileOptions(backend='aot_eager', fallback=True)",
    ))


def compile_blocker(backend: str | Callable[..., Any], device_types: set[str]) -> str | None:
    """Why ``backend`` cannot compile modules on ``device_types`` here, or ``None`` where nothing is known to stop it.

    Cheap checks, made before anything is compiled: dynamo's support of this Python, the backend's
    name, and for inductor the code generator each device type needs (a C++ compiler that answers
    ``--version`` for CPU; triton for CUDA/XPU)."""
    unsupported = compat.dynamo_unsupported()
    if unsupported:
        return f"torch.compile cannot run in this Python ({unsupported})"
    if callable(backend):
        return None
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        return f"torch.compile has no backend {backend!r} (known: {', '.join(sorted(known))})"
    if backend != "inductor":
        return None
    if "cpu" in device_types and compat.cpp_compiler() is None:
        tried = ", ".join(str(c) for c in compat.cpp_compiler_search() if c is not None)
        return f"inductor needs a C++ compiler for CPU stages and none works here (tried {tried}; $CXX sets the last)"
    if device_types - {"cpu", "meta"} and not compat.has_triton():
        return f"inductor needs triton for {'/'.join(sorted(device_types - {'cpu', 'meta'}))} stages and it is not installed"
    return None


def _device_types(module: torch.nn.Module) -> set[str]:
    """Where the module's state lives (a stage without any, or on meta, is taken to run on the CPU)."""
    types = {t.device.type for t in (*module.parameters(), *module.buffers())} - {"meta"}
    return types or {"cpu"}


def compile_stages(
    modules: Mapping[int, torch.nn.Module],
    *,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    fallback: bool = False,
    device_types: Collection[str] | None = None,
) -> dict[int, str]:
    """Compile each stage module in place (``module.compile(...)``); returns ``{stage: status}``.

    ``modules``: stage index → its generated module (``dict(enumerate(split.stages))``, or the
    stages one rank holds, before FSDP or a pipeline stage wraps them). Options: see
    :class:`CompileOptions`. A status is ``"compiled"``, or ``"eager: <cause>"`` for a stage left
    eager by ``fallback``; the returned dict is updated in place when a stage falls back on a later
    call (its first run, or a recompilation for a new shape). Without ``fallback``, a stage that
    cannot be compiled raises :class:`~autosplit.errors.CompileError` — up front for what
    :func:`compile_blocker` finds, at the stage's first call for the rest. ``device_types``: where
    the stages will run (``{"cuda"}``), for modules not yet there; default: where their state is.
    """
    status: dict[int, str] = {}
    types = set(device_types) if device_types is not None else set().union(*(_device_types(m) for m in modules.values()))
    blocker = compile_blocker(backend, types)
    if blocker is not None:
        if not fallback:
            raise CompileError(advice(
                f"compile=True: the {len(modules)} stage(s) {sorted(modules)} cannot be compiled: {blocker}",
                "torch.compile's backend cannot generate code on this machine",
                "install what is missing (a C++ compiler: apt-get install g++, or set CXX), pick another backend "
                "(CompileOptions(backend='aot_eager')), pass CompileOptions(fallback=True) to run eagerly, or compile=False",
            ))
        for s in modules:
            log.warning("stage %d runs eagerly: %s", s, blocker)
            status[s] = f"eager: {blocker}"
        return status
    from torch.distributed.tensor import DTensor  # here: importing DTensor takes a second, which planning never needs

    kwargs = {"backend": backend, "mode": mode, "fullgraph": fullgraph, "dynamic": dynamic}
    for s, module in modules.items():
        module.compile(**kwargs)
        compiled = compat.compiled_call(module)
        if compiled is not None:  # what nn.Module.compile() set: called through the guard instead
            rank_local = any(isinstance(p, DTensor) for p in module.parameters())  # tp: graphs with rank-dependent code
            compat.set_compiled_call(module, _guarded(module, s, compiled, backend, fallback, status, rank_local))
        status[s] = COMPILED
    return status


def _guarded(
    module: torch.nn.Module, stage: int, compiled: Callable[..., Any], backend: str | Callable[..., Any],
    fallback: bool, status: dict[int, str], rank_local: bool = False,
) -> Callable[..., Any]:
    """The compiled call of ``module``, with what dynamo raises turned into a typed error or an eager stage.
    ``rank_local``: compiled apart from the on-disk caches shared by the ranks (:func:`autosplit.compat.rank_local_compile`).

    When dynamo raises, the stage runs once eagerly: an error there too is the model's own (a wrong
    input, say, which dynamo reports wrapped) and is raised as itself; otherwise compiling is what
    failed, and by ``fallback`` the stage stays eager (its eager result returned) or a
    :class:`~autosplit.errors.CompileError` names it."""
    name = getattr(backend, "__name__", backend)

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            with _eager_backward_compile(), _rank_local_compile() if rank_local else contextlib.nullcontext():
                return compiled(*args, **kwargs)
        except compat.dynamo_error() as e:
            cause = _cause(e)
            compat.set_compiled_call(module, None)
            eager_ran = False
            try:
                out = module(*args, **kwargs)
                eager_ran = True
            finally:
                if not (eager_ran and fallback):  # compiled again next call (an eager error is the model's, not the compiler's)
                    compat.set_compiled_call(module, call)
            if not fallback:
                raise CompileError(advice(
                    f"stage {stage} could not be compiled with torch.compile (backend {name!r}): {cause}",
                    "the backend or dynamo refuses an operation of this stage, or the generated code does not build "
                    "(the stage runs eagerly without error)",
                    "pass CompileOptions(fallback=True) to run this stage eagerly, another backend, or compile=False; "
                    "AUTOSPLIT_DEBUG=3 prints the stage's code",
                )) from e
            log.warning("stage %d runs eagerly: torch.compile (backend %r) failed: %s", stage, name, cause)
            status[stage] = f"eager: {cause}"
            return out

    return call


def _cause(e: BaseException) -> str:
    """The innermost error's type and first line: what refused (dynamo wraps the backend's error)."""
    inner: BaseException = e
    for _ in range(8):  # a bounded walk down the chain
        nested = getattr(inner, "inner_exception", None) or inner.__cause__
        if not isinstance(nested, BaseException) or nested is inner:
            break
        inner = nested
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0] if text else ''}".rstrip(": ")
