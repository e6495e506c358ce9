"""The private torch APIs autosplit needs (:mod:`autosplit.runtime.compiled`, the pipelining
runtime), reached in one place, written against torch 2.13.

``torch.compile`` has public entry points (``torch.compile``, ``nn.Module.compile``,
``torch.compiler.list_backends``) but none that says *before* compiling whether compilation can
run, and none that swaps a module's compiled call. Those live in ``torch._dynamo``,
``torch._inductor``, ``torch._functorch`` and ``nn.Module._compiled_call_impl``; they move between
torch releases, so each is wrapped here once, tolerating its absence where it can (older modules
of the library still import ``torch._subclasses.fake_tensor`` and ``torch._ops`` directly).

Usage::

    from autosplit import compat
    if compat.cpp_compiler() is None:        # inductor's CPU code cannot be built here
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "DynamoError",
    "forward_only_order",
    "forward_only_step",
    "replicate_chunk_spec",
    "compiled_call",
    "cpp_compiler",
    "cpp_compiler_search",
    "dynamo_unsupported",
    "eager_backward_compile",
    "has_triton",
    "set_compiled_call",
]

try:  # the root of what dynamo raises when it cannot trace or its backend cannot compile
    from torch._dynamo.exc import TorchDynamoException as DynamoError
except ImportError:  # pragma: no cover - every torch with torch.compile has it
    DynamoError = RuntimeError  # type: ignore[misc,assignment]


def dynamo_unsupported() -> str | None:
    """Why ``torch.compile`` cannot run in this Python (dynamo's own check), or ``None`` if it can."""
    try:
        from torch._dynamo.eval_frame import check_if_dynamo_supported

        check_if_dynamo_supported()
    except (ImportError, RuntimeError) as e:
        return str(e) or type(e).__name__
    return None


def cpp_compiler_search() -> tuple[Any, ...]:
    """The C++ compilers inductor tries, in order (``torch._inductor.config.cpp.cxx``; ``$CXX`` sets the last)."""
    from torch._inductor import config

    cxx = config.cpp.cxx
    return tuple(cxx) if isinstance(cxx, (list, tuple)) else (cxx,)


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with (its own search: runs ``<cxx> --version``),
    or ``None`` where none of :func:`cpp_compiler_search` works."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except (ImportError, RuntimeError, OSError):  # torch._inductor.exc.InvalidCxxCompiler is a RuntimeError
        return None


def has_triton() -> bool:
    """Whether inductor's GPU code generator (triton) is importable for this torch."""
    try:
        from torch.utils._triton import has_triton as _has_triton
    except ImportError:
        return False
    return bool(_has_triton())


def eager_backward_compile() -> contextlib.AbstractContextManager[Any]:
    """While open, AOTAutograd compiles a graph's backward with its forward, on the first call, instead of
    on the first ``backward()`` (``torch._functorch.config.force_non_lazy_backward_lowering``): a backend
    that cannot compile the backward then fails where the caller can still run the stage eagerly."""
    try:
        from torch._functorch import config
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    if not hasattr(config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return config.patch(force_non_lazy_backward_lowering=True)


def compiled_call(module: torch.nn.Module) -> Callable[..., Any] | None:
    """What ``module(...)`` calls instead of its eager ``_call_impl`` since ``module.compile()``; ``None`` if uncompiled."""
    return getattr(module, "_compiled_call_impl", None)


def set_compiled_call(module: torch.nn.Module, call: Callable[..., Any] | None) -> None:
    """Make ``module(...)`` call ``call`` (``None``: run eagerly again), as ``nn.Module.compile`` sets it."""
    module._compiled_call_impl = call


# -- torch.distributed.pipelining ------------------------------------------------------------------


def replicate_chunk_spec() -> Any:
    """The chunk spec of an input every micro-batch receives whole (pipelining names it only privately)."""
    from torch.distributed.pipelining.microbatch import _Replicate

    return _Replicate()


def forward_only_step(schedule: Any, *, return_outputs: bool, **kwargs: Any) -> Any:
    """``schedule.step(...)`` with its backward switched off, as torch's ``schedule.eval`` does (its
    ``_has_backward`` flag cleared around the step), with ``return_outputs`` chosen: ``eval`` always
    merges the last stage's outputs, which holds them and fails on outputs not cut by the batch.
    Call it under ``torch.no_grad()``."""
    original = schedule._has_backward
    try:
        schedule._has_backward = False
        return schedule.step(return_outputs=return_outputs, **kwargs)
    finally:
        schedule._has_backward = original


def forward_only_order(schedule: Any, stage_ranks: Mapping[int, int], micro_batches: int) -> None:
    """Give a multi-stage schedule (a ``_PipelineScheduleRuntime``) an order of forwards only: each
    rank runs its stages in index order, every micro-batch of one before the next (breadth first).

    torch 2.13's multi-stage classes keep their backward actions under ``eval()`` and fail on the
    first one; this order needs no backward and cannot deadlock (a rank waits only on a lower
    stage, which its rank runs before any higher one). ``stage_ranks``: stage index → pipeline rank."""
    from torch.distributed.pipelining.schedules import _Action, _add_send_recv, _add_unshard_reshard, _ComputationType

    order: dict[int, list[Any]] = {rank: [] for rank in sorted(set(stage_ranks.values()))}
    for stage in sorted(stage_ranks):
        order[stage_ranks[stage]] += [_Action(stage, _ComputationType.FORWARD, m) for m in range(micro_batches)]
    # _prepare_schedule_with_comms would validate the order as a training one (every micro-batch's
    # backward present), so its lowering is applied here: FSDP's unshard/reshard, then the sends and
    # receives, over the stage → rank mapping the constructor validated.
    schedule.pipeline_order = order
    schedule.pipeline_order_with_comms = _add_send_recv(
        {rank: _add_unshard_reshard(actions) for rank, actions in order.items()},
        stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s], num_stages=schedule._num_stages,
    )
