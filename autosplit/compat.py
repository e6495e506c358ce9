r"""Every private torch API autosplit uses, reached in one place.

No module of the library names a private torch module or function itself (``torch._…``,
``torch.….\_…``, an underscore name imported from torch): it takes it from here, so a torch
release that moves one breaks one line, and ``scripts/check_torch.sh VERSION`` says which.
Each entry says what it is for and the torch versions it was checked on — **2.13.0** (the CPU
build the project develops on, ``scripts/setup.sh``) and **2.14.1** (the newest the registry
serves, its CUDA build on CPU, ``scripts/check_torch.sh 2.14.1``) unless it says otherwise;
``pyproject.toml`` declares that range.

- ``torch.compile`` has public entry points (``torch.compile``, ``nn.Module.compile``,
  ``torch.compiler.list_backends``) but none that says *before* compiling whether compilation
  can run, and none that swaps a module's compiled call: those live in ``torch._dynamo``,
  ``torch._inductor``, ``torch._functorch`` and ``nn.Module._compiled_call_impl``.
- Capture and annotation run on fx's and fake tensors' internals: :data:`pytree`
  (``torch.utils._pytree``), :class:`FakeTensor` / :class:`FakeTensorMode` /
  :func:`unset_fake_temporarily` (``torch._subclasses.fake_tensor``), :class:`TorchDispatchMode`
  (``torch.utils._python_dispatch``), :class:`OpOverload` (``torch._ops``), :class:`PyTreeCodeGen`
  and :func:`graph_codegen` (``torch.fx.graph._PyTreeCodeGen``, ``Graph._codegen``),
  :func:`make_graph_module` (``torch.fx._lazy_graph_module``), :func:`copy_attr`
  (``torch.fx.graph_module._copy_attr``), :data:`TENSOR_DATA` (``torch._C.TensorBase.data``).
- Normalisation layers: :data:`NormBase` and :data:`BatchNorm` (``torch.nn.modules.batchnorm``'s
  ``_NormBase``, ``_BatchNorm``: every layer with running statistics).
- Training: :func:`amp_unscale_` and :func:`amp_update_scale_` (``torch._amp_…``, GradScaler's
  kernels), :func:`fsdp_replicate` (``torch.distributed._composable.replicate_with_fsdp``),
  :func:`stage_backward` (``torch.distributed.pipelining._backward``), and the pipelining
  schedules' private members below; :func:`all_to_all_autograd` (``torch.distributed._functional_collectives``,
  expert parallelism's token exchange; checked on 2.13.0 only).
- Tensor parallelism: :data:`ASSERT_TENSOR_METADATA` (``aten._assert_tensor_metadata``, an op
  DTensor cannot run; checked on 2.13.0 only); :data:`REDUCTION_OPS` (the functional collectives'
  reductions, which selective recomputation keeps; checked on 2.13.0 only).

Attributes of public classes that every torch release since 1.x has kept are read in place and
not wrapped: ``nn.Module._modules`` / ``_parameters`` / ``_buffers`` /
``_non_persistent_buffers_set``, ``Tensor._version`` / ``_base`` / ``_is_view()``, and an
:class:`OpOverload`'s ``_schema`` (its arguments' and returns' alias information, as torch's own
passes read it) — checked on the same two versions.

Usage::

    from autosplit import compat
    if compat.cpp_compiler() is None:        # inductor's CPU code cannot be built here
        ...
    leaves = compat.pytree.tree_leaves(batch)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._ops import OpOverload  # the class of an aten op's overload (``aten.mm.default``)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx.graph import _PyTreeCodeGen as PyTreeCodeGen  # an exported graph's codegen: pytree in and out
from torch.utils import _pytree as pytree  # torch's own flatten/unflatten, with its registered containers
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "TORCH_CHECKED",
    "pytree",
    "FakeTensor",
    "FakeTensorMode",
    "unset_fake_temporarily",
    "TorchDispatchMode",
    "OpOverload",
    "PyTreeCodeGen",
    "graph_codegen",
    "set_graph_codegen",
    "make_graph_module",
    "copy_attr",
    "rank_local_compile",
    "TENSOR_DATA",
    "C_LINEAR",
    "ASSERT_TENSOR_METADATA",
    "REDUCTION_OPS",
    "NormBase",
    "BatchNorm",
    "amp_unscale_",
    "amp_update_scale_",
    "flatten_mesh",
    "fsdp_replicate",
    "stage_backward",
    "set_kwargs_chunk_spec",
    "dynamo_error",
    "forward_only_order",
    "forward_only_step",
    "replicate_chunk_spec",
    "compiled_call",
    "cpp_compiler",
    "cpp_compiler_search",
    "cpu_context_parallel_gaps",
    "dynamo_unsupported",
    "eager_backward_compile",
    "has_triton",
    "set_compiled_call",
]

TORCH_CHECKED = ("2.13.0", "2.14.1")
"""The torch versions every entry of this module was checked on (``pyproject.toml``'s range)."""

# -- fx, fake tensors, dispatch ---------------------------------------------------------------------

TENSOR_DATA = torch._C.TensorBase.__dict__["data"]
"""The ``Tensor.data`` descriptor itself (its setter is what ``p.data = ...`` calls)."""

C_LINEAR: Any = torch._C._nn.linear
"""The ATen binding ``F.linear`` is (``torch._C._nn.linear``): the target a symbolic trace records for
``F.linear`` calls, which the tensor-parallel rules recognise as a linear layer."""

ASSERT_TENSOR_METADATA: OpOverload = torch.ops.aten._assert_tensor_metadata.default
"""The check ``torch.export`` leaves where ``.to(dtype)`` ran (``aten._assert_tensor_metadata``, no output),
which DTensor has no sharding strategy for: :mod:`autosplit.runtime.tensor_parallel` drops it from tp
stages. Checked on 2.13.0 only (the tp runtime's first version)."""

REDUCTION_OPS: frozenset[OpOverload] = frozenset({
    torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.reduce_scatter_tensor.default,
})
"""The reductions DTensor's redistributions dispatch (``torch.distributed._functional_collectives``: an
all-reduce of a partial sum, a reduce-scatter under sequence parallelism), whose outputs a selective
checkpoint keeps (:mod:`autosplit.passes.selective`). Checked on 2.13.0 only."""

NormBase: type[torch.nn.Module] = torch.nn.modules.batchnorm._NormBase
"""Every batch or instance norm with running statistics (``torch.nn.modules.batchnorm._NormBase``)."""
BatchNorm: type[torch.nn.Module] = torch.nn.modules.batchnorm._BatchNorm
"""``BatchNorm1d/2d/3d`` and ``SyncBatchNorm``'s base (``torch.nn.modules.batchnorm._BatchNorm``)."""


def graph_codegen(graph: torch.fx.Graph) -> Any:
    """The graph's code generator (``Graph._codegen``): ``fx.graph.CodeGen``, or a
    :class:`PyTreeCodeGen` for an exported graph; set it with :func:`set_graph_codegen`."""
    return graph._codegen


def set_graph_codegen(graph: torch.fx.Graph, codegen: Any) -> None:
    """Give ``graph`` the code generator ``codegen`` (fx's public ``Graph.set_codegen``)."""
    graph.set_codegen(codegen)


def make_graph_module(root: Any, graph: torch.fx.Graph, name: str) -> torch.fx.GraphModule:
    """A ``GraphModule`` whose code is generated now, not at its first call (fx's lazy graph
    modules off: ``torch.fx._lazy_graph_module``), as ``symbolic_trace`` builds it."""
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        return _make_graph_module(root, graph, name)


def copy_attr(source: torch.nn.Module, target: torch.nn.Module, qualname: str) -> None:
    """Copy the attribute ``qualname`` of ``source`` into ``target``, its parent modules and
    containers too (fx's own ``torch.fx.graph_module._copy_attr``)."""
    from torch.fx.graph_module import _copy_attr

    _copy_attr(source, target, qualname)


# -- training --------------------------------------------------------------------------------------


def amp_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place, setting ``found_inf`` where one is not finite
    (GradScaler's kernel ``torch._amp_foreach_non_finite_check_and_unscale_``)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def amp_update_scale_(
    scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor, growth: float, backoff: float, interval: int
) -> None:
    """Grow or back off the loss scale in place (GradScaler's kernel ``torch._amp_update_scale_``)."""
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, interval)


def fsdp_replicate() -> Callable[..., Any]:
    """FSDP2's ``replicate`` (whole parameters, gradients all-reduced), which pipelining drives:
    ``torch.distributed._composable.replicate_with_fsdp.replicate`` (``fully_shard`` is public)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh`` (a sub-mesh of several dimensions) as one dimension called ``name`` of its root mesh
    (``DeviceMesh._flatten``, as torchtitan makes its ``dp`` of ``dp_replicate × dp_shard``);
    collective on its first call, then the root mesh's own: ``root[name]``."""
    return mesh._flatten(name)


def all_to_all_autograd(tensor: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group: Any) -> torch.Tensor:
    """``all_to_all_single`` with a backward (the reverse exchange of the gradients), waited for: the functional
    collectives' ``all_to_all_single_autograd`` (``torch.distributed._functional_collectives``), which torchtitan's
    token dispatcher runs; ``torch.distributed.nn.functional``'s public one is deprecated in its favour."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(tensor, output_split_sizes, input_split_sizes, group))


def stage_backward() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Pipelining's split backward, ``(stage_backward_input, stage_backward_weight)``
    (``torch.distributed.pipelining._backward``), as the zero-bubble schedules run it."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    return stage_backward_input, stage_backward_weight


def set_kwargs_chunk_spec(schedule: Any, specs: Any) -> None:
    """How a single-stage schedule cuts each keyword input into micro-batches: the base class keeps
    it in ``_kwargs_chunk_spec``, which its constructor does not take."""
    schedule._kwargs_chunk_spec = specs


# -- torch.compile ---------------------------------------------------------------------------------

def dynamo_error() -> type[Exception]:
    """The root of what dynamo raises when it cannot trace or its backend cannot compile
    (``torch._dynamo.exc.TorchDynamoException``), imported when a compile first needs it: ``torch._dynamo``
    takes seconds to import."""
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:  # pragma: no cover - every torch with torch.compile has it
        return RuntimeError
    return TorchDynamoException


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


def rank_local_compile() -> contextlib.AbstractContextManager[Any]:
    """While open, inductor and AOTAutograd neither read nor write their on-disk caches of compiled graphs
    (``torch._inductor.config.fx_graph_cache``, ``torch._functorch.config.enable_autograd_cache``).

    Their keys do not hold the process's rank, while a graph of DTensor ops bakes rank-dependent
    offsets into its code (a sequence-parallel shard's slice of the tokens): ranks on one host share
    the cache directory, so one rank loads another's graph and computes on the wrong slice, silently
    (torch 2.13; the class of pytorch/pytorch#188332, which torch fixed for other passes by keeping
    such graphs out of the cache). Each rank then compiles its own graph; opened around a stage's call
    with :func:`eager_backward_compile`, it covers the backward too, which is compiled in that call."""
    try:
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return _Together(inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False))


class _Together(contextlib.AbstractContextManager):
    """Re-entrant contexts entered and left together (torch's config patches keep their priors in a stack)."""

    def __init__(self, *contexts: contextlib.AbstractContextManager[Any]) -> None:
        self._contexts = contexts

    def __enter__(self) -> None:
        for c in self._contexts:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self._contexts):
            c.__exit__(*exc)


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


# -- context parallelism --------------------------------------------------------------------------


def cpu_context_parallel_gaps() -> list[str]:
    """What the installed torch lacks to run context parallelism on CPU ranks, each found by asking torch: its
    ring (``context_parallel``, ``_ContextParallel`` for SDPA) dispatches the attention op through DTensor, which
    holds no sharding strategy for the CPU flash kernel; its FlexAttention form (torchtitan's, K/V all-gathered)
    refuses a backward on a CPU. Checked on 2.13.0 (both gaps there); empty once torch runs either."""
    from torch.distributed.tensor import DTensor
    from torch.nn.attention.flex_attention import flex_attention

    gaps = []
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    if cpu_flash not in DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs:
        gaps.append(f"DTensor has no sharding strategy for {cpu_flash} (the ring's SDPA form)")
    q = torch.zeros(1, 1, 128, 8, requires_grad=True)
    try:
        flex_attention(q, q, q)
    except NotImplementedError as e:  # torch checks the device before any work
        gaps.append(f"FlexAttention (the all-gather form) says: {str(e).split('.')[0]}")
    return gaps
