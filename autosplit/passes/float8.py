"""FP8 linears (``PlanOptions.float8``): which linears compute in FP8, and what that costs.

A linear runs its three GEMMs (forward; the gradients to its input and to its weight) at the device's FP8
peak (:attr:`~autosplit.device_spec.DeviceSpec.peak_flops_fp8`), and pays for the casts that feed them as
memory-bound work of their own: each operand read in bf16 and written in FP8, with, for one scale per
tensor (``tensorwise``, ``rowwise``), a read before to find its absolute maximum; the backward casts the
output's gradient the same way and transposes the FP8 copies of the input and the weight for the
gradient GEMMs (``mxfp8`` casts them again along the other axis: its scales run along a row of 32).
:data:`CAST_TRAFFIC` is that traffic per bf16 byte of each operand.

Which linears convert is decided per linear (:func:`choose_float8`). Every candidate is a linear whose
weight is a parameter with both dimensions a multiple of 16 (what FP8 tensor cores take), not kept by the
user's filters (``float8_exclude``: torchtitan's ``filter_fqns`` rule; by default the model's last
linear, the LM head, as torchtitan's ``["output"]`` and Transformer Engine leave it). An explicit recipe
converts every candidate, as the engines do (torchtitan's ``module_filter_fn``, Transformer Engine's
layers), so a plan read back from an engine's configuration is the model that engine trains. ``"auto"``
decides by cost, as torchao advises: tensorwise where it is faster than bf16 on every device — the GEMM
time saved exceeds the casts — and bf16 where not, the plan saying why; on a device without FP8 tensor
cores (a CPU, an A100) nothing. An explicit recipe on a CPU is torchao's emulation, for its numerics,
costed as the bf16 GEMM and its casts.

Usage::

    choice = choose_float8(gm, nodes, infos, kinds, "auto", None, bf16_times)
    fwd, bwd = float8_times(info, spec, "tensorwise")
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from autosplit.device_spec import DeviceSpec
from autosplit.engine_profiles import FITTED
from autosplit.errors import ConstraintError, advice
from autosplit.passes.annotations import NodeInfo
from autosplit.passes.tensor_parallel import LINEAR_FUNCTIONS
from autosplit.plan_records import FP8_SHAPES

__all__ = [
    "CAST_TRAFFIC", "Float8Choice", "cast_seconds", "cast_times", "choose_float8", "float8_linears", "float8_times", "refuse_without_fp8",
]

CAST_TRAFFIC: dict[str, tuple[float, float, float]] = {
    # (forward: per byte of input + weight; backward: per byte of the output's gradient, per byte of input + weight)
    # tensorwise / rowwise: amax read (1) + read (1) + FP8 write (½) = 2.5; the backward's transposes of the FP8
    # copies read and write ½ each = 1
    "tensorwise": (2.5, 2.5, 1.0),
    "rowwise": (2.5, 2.5, 1.0),
    # mxfp8: one pass per cast, the block's amax found in registers: read (1) + write (½) = 1.5, scales 1/32
    # of that; the backward casts input and weight again along the other axis: 1.5
    "mxfp8": (1.5, 1.5, 1.5),
}
CAST_KERNELS = 2
"""Kernels per operand cast (absolute maximum, then the cast), each paying the launch overhead."""


def _weight(gm: fx.GraphModule, node: fx.Node, params: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The parameter weight of a linear node (a call of ``nn.Linear``, or a linear function reading a parameter), else ``None``."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return mod.weight if isinstance(mod, nn.Linear) else None
    if node.op == "call_function" and node.target in LINEAR_FUNCTIONS:
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        if isinstance(weight, fx.Node) and weight.op == "get_attr":
            return params.get(str(weight.target))
    return None


def _linear_path(node: fx.Node) -> str:
    """The module path a linear node's weight belongs to (``blocks.0.fc``): what torchao's filters and the plan name it by."""
    if node.op == "call_module":
        return str(node.target)
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    return str(weight.target).rpartition(".")[0] if isinstance(weight, fx.Node) else node.name


def float8_linears(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> dict[int, tuple[str, torch.Tensor]]:
    """Index into ``nodes`` → (module path, weight) of every linear whose weight is a parameter, in graph order."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    return {i: (_linear_path(n), w) for i, n in enumerate(nodes) if (w := _weight(gm, n, params)) is not None}


@dataclass(frozen=True)
class Float8Choice:
    """The linears a plan runs in FP8 and why the others stay bf16."""

    recipe: str | None
    """The recipe they run (``"auto"`` resolved); ``None``: none converts."""
    chosen: frozenset[int]
    """Indices into the graph's nodes of the FP8 linears."""
    linears: tuple[str, ...]
    """Their module paths, in graph order."""
    kept: tuple[tuple[str, str], ...]
    """(module path, why it stays bf16) of every other linear, in graph order."""
    experts: frozenset[int] = frozenset()
    """Indices of the experts' grouped matmuls costed in FP8: where the engine runs them so (Transformer Engine's
    grouped GEMMs under its FP8 recipe); autosplit's runtime converts linears only."""

    @property
    def costed(self) -> frozenset[int]:
        """Every node costed in FP8: the linears and the experts' grouped matmuls."""
        return self.chosen | self.experts


Times = Callable[[fx.Node, NodeInfo, DeviceSpec], tuple[float, float]]


def choose_float8(
    gm: fx.GraphModule, nodes: Sequence[fx.Node], infos: Sequence[NodeInfo], kinds: Sequence[DeviceSpec], recipe: str,
    exclude: Sequence[str] | None, bf16_times: Times, grouped: Collection[int] = (),
) -> Float8Choice:
    """Which linears of ``nodes`` run in FP8 under ``recipe`` (or ``"auto"``: by cost) on devices ``kinds``,
    the others with their reason (the module docstring); refuses an explicit recipe on a GPU without FP8.
    ``grouped``: the experts' grouped matmuls the engine runs in FP8 too, decided as a linear is (by their path:
    ``model.layers.3.mlp.experts``)."""
    linears = float8_linears(gm, nodes)
    last = max(linears, default=-1)
    if recipe == "auto" and any(d.peak_flops_fp8 is None for d in kinds):
        lacking = ", ".join(sorted({d.name for d in kinds if d.peak_flops_fp8 is None}))
        return Float8Choice(None, frozenset(), (), tuple((path, f"{lacking} has no FP8 tensor cores") for path, _ in linears.values()))
    refuse_without_fp8([d for d in kinds if d.device_type != "cpu"], recipe)
    chosen, kept = [], []
    by_cost = recipe == "auto"
    for i, (path, w) in linears.items():
        why = _excluded(path, exclude, i == last) or _odd_shape(w) or (
            _slower(nodes[i], infos[i], kinds, "tensorwise", bf16_times) if by_cost else None)
        (kept.append((path, why)) if why else chosen.append(i))
    experts = frozenset(i for i in grouped if not (
        _excluded(infos[i].module_path, exclude, False) or _odd_shape(_stacked(nodes[i]))
        or (_slower(nodes[i], infos[i], kinds, "tensorwise", bf16_times) if by_cost else None)))
    resolved = "tensorwise" if by_cost else recipe
    return Float8Choice(resolved if chosen or experts else None, frozenset(chosen), tuple(linears[i][0] for i in chosen), tuple(kept),
                        experts)


def _excluded(path: str, exclude: Sequence[str] | None, last: bool) -> str | None:
    if exclude is None:
        return "the model's output layer (its last linear), kept in bf16 by default as torchtitan's filter_fqns=['output']" \
            if last else None
    hit = next((f for f in exclude if f in path), None)
    return None if hit is None else f"float8_exclude names {hit!r}"


def _stacked(node: fx.Node) -> torch.Tensor:
    """The experts' stacked weight a grouped matmul reads (:func:`~autosplit.passes.experts.grouped_gemms` found it)."""
    weight = node.args[1]
    assert isinstance(weight, fx.Node), "a grouped matmul's weight is a node of the graph"
    return weight.meta["val"]


def _odd_shape(w: torch.Tensor) -> str | None:
    """Why a linear's weight (or the experts' stacked ``(E, K, N)``) cannot feed FP8 tensor cores; None where it can."""
    if w.dim() in (2, 3) and w.shape[-2] % 16 == 0 and w.shape[-1] % 16 == 0:
        return None
    return f"its weight is {' × '.join(map(str, w.shape))}: {FP8_SHAPES}"


def _slower(node: fx.Node, info: NodeInfo, kinds: Sequence[DeviceSpec], recipe: str, bf16_times: Times) -> str | None:
    """Why FP8 does not pay on some device of ``kinds`` (every one has FP8 tensor cores): its GEMMs saved
    less than its casts cost; else None."""
    for d in kinds:
        fp8, bf16 = sum(float8_times(info, d, recipe)), sum(bf16_times(node, info, d))
        if fp8 >= bf16:
            return (f"FP8 would take {fp8 * 1e6:.3g} µs forward and backward with its casts on {d.name}, "
                    f"bf16 {bf16 * 1e6:.3g} µs: the GEMM time saved is less than the casts cost")
    return None


def float8_times(info: NodeInfo, spec: DeviceSpec, recipe: str) -> tuple[float, float]:
    """(forward, backward) seconds of one FP8 linear: its GEMMs at the FP8 peak (or its bytes at the
    memory bandwidth, the slower), then its casts (:func:`cast_times`). A rowwise-scaled GEMM reaches
    :data:`~autosplit.engine_profiles.FITTED` ``float8.rowwise`` of what a tensorwise one does (its scales
    applied per row in the epilogue: torchao's kernel, the only engine that runs it in the record)."""
    assert spec.peak_flops_fp8 is not None, "a device without FP8 costs the bf16 GEMM and cast_times"
    peak = spec.peak_flops_fp8 * (FITTED["float8.rowwise"].value if recipe == "rowwise" else 1.0)
    bandwidth = spec.memory_bandwidth * (spec.memory_efficiency or spec.efficiency)
    nbytes = info.input_bytes + info.output_bytes

    def gemm(flops: float, moved: float) -> float:
        return max(flops / (peak * spec.efficiency), moved / bandwidth) + spec.launch_overhead

    casts = cast_times(info, spec, recipe)
    return gemm(info.fwd_flops, nbytes) + casts[0], gemm(info.bwd_flops, 2 * nbytes) + casts[1]


def cast_times(info: NodeInfo, spec: DeviceSpec, recipe: str) -> tuple[float, float]:
    """(forward, backward) seconds of one FP8 linear's casts, memory-bound (:data:`CAST_TRAFFIC`), each
    operand's :data:`CAST_KERNELS` launches paid."""
    fwd_in, bwd_out, bwd_in = CAST_TRAFFIC[recipe]
    launches = 2 * CAST_KERNELS * spec.launch_overhead
    return (cast_seconds(fwd_in * info.input_bytes, spec) + launches,
            cast_seconds(bwd_out * info.output_bytes + bwd_in * info.input_bytes, spec) + launches)


def cast_seconds(traffic: float, spec: DeviceSpec) -> float:
    """Seconds of ``traffic`` bytes of cast work, memory-bound on ``spec``."""
    return traffic / (spec.memory_bandwidth * (spec.memory_efficiency or spec.efficiency))


def refuse_without_fp8(devices: Sequence[DeviceSpec], recipe: str) -> None:
    """A :class:`ConstraintError` where a GPU has no FP8 tensor cores to run ``float8=recipe`` on."""
    lacking = sorted({d.name for d in devices if d.peak_flops_fp8 is None})
    if lacking:
        raise ConstraintError(advice(
            f"option float8={recipe!r}, and {', '.join(lacking)} has no FP8 tensor cores (no peak_flops_fp8)",
            "FP8 linears compute at the device's FP8 peak: Hopper and Blackwell GPUs have one, V100 and A100 do not",
            "plan with float8=None or 'auto' (which converts nothing there), or for a GPU preset with FP8 (H100-80GB, B200-180GB, …)",
        ))
