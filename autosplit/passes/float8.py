"""FP8 linears, costed (``PlanOptions.float8``): which linears compute in FP8, and what that costs.

A linear runs its three GEMMs (forward; the gradients to its input and to its weight) at the device's FP8
peak (:attr:`~autosplit.device_spec.DeviceSpec.peak_flops_fp8`), and pays for the casts that feed them as
memory-bound work of their own: each operand read in bf16 and written in FP8, with, for one scale per
tensor (``tensorwise``, ``rowwise``), a read before to find its absolute maximum; the backward casts the
output's gradient the same way and transposes the FP8 copies of the input and the weight for the
gradient GEMMs (``mxfp8`` casts them again along the other axis: its scales run along a row of 32).
:data:`CAST_TRAFFIC` is that traffic per bf16 byte of each operand. The linears converted are the
engines' own choice: every linear whose weight is a parameter with both dimensions a multiple of 16
(what FP8 tensor cores take), but the graph's last, the LM head — torchtitan's ``filter_fqns=["output"]``,
and Megatron's output layer, which Transformer Engine does not hold.

Usage::

    chosen = float8_linears(gm, nodes)
    fwd, bwd = float8_times(info, spec, "tensorwise")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from autosplit.device_spec import DeviceSpec
from autosplit.engine_profiles import FITTED
from autosplit.errors import CodegenError, ConstraintError, advice
from autosplit.passes.annotations import NodeInfo
from autosplit.passes.tensor_parallel import LINEAR_FUNCTIONS

__all__ = ["CAST_TRAFFIC", "float8_linears", "float8_times", "refuse_float8_run", "refuse_without_fp8"]

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


def float8_linears(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> frozenset[int]:
    """Indices into ``nodes`` of the linears that run in FP8 (see the module docstring)."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    linears = [(i, w) for i, n in enumerate(nodes) if (w := _weight(gm, n, params)) is not None]
    return frozenset(i for i, w in linears[:-1] if w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0)


def float8_times(info: NodeInfo, spec: DeviceSpec, recipe: str) -> tuple[float, float]:
    """(forward, backward) seconds of one FP8 linear: its GEMMs at the FP8 peak (or its bytes at the
    memory bandwidth, the slower), then its casts at the memory bandwidth. A rowwise-scaled GEMM reaches
    :data:`~autosplit.engine_profiles.FITTED` ``float8.rowwise`` of what a tensorwise one does (its scales
    applied per row in the epilogue: torchao's kernel, the only engine that runs it in the record)."""
    assert spec.peak_flops_fp8 is not None, "refuse_without_fp8 runs first"
    peak = spec.peak_flops_fp8 * (FITTED["float8.rowwise"].value if recipe == "rowwise" else 1.0)
    bandwidth = spec.memory_bandwidth * (spec.memory_efficiency or spec.efficiency)
    nbytes = info.input_bytes + info.output_bytes
    fwd_in, bwd_out, bwd_in = CAST_TRAFFIC[recipe]

    def gemm(flops: float, moved: float) -> float:
        return max(flops / (peak * spec.efficiency), moved / bandwidth) + spec.launch_overhead

    casts = 2 * CAST_KERNELS * spec.launch_overhead
    fwd = gemm(info.fwd_flops, nbytes) + fwd_in * info.input_bytes / bandwidth + casts
    bwd = gemm(info.bwd_flops, 2 * nbytes) + (bwd_out * info.output_bytes + bwd_in * info.input_bytes) / bandwidth + casts
    return fwd, bwd


def refuse_without_fp8(devices: Sequence[DeviceSpec], recipe: str) -> None:
    """A :class:`ConstraintError` where a device has no FP8 tensor cores to cost ``float8=recipe`` on."""
    lacking = sorted({d.name for d in devices if d.peak_flops_fp8 is None})
    if lacking:
        raise ConstraintError(advice(
            f"option float8={recipe!r}, and {', '.join(lacking)} has no FP8 tensor cores (no peak_flops_fp8)",
            "FP8 linears compute at the device's FP8 peak: Hopper and Blackwell GPUs have one, CPUs, V100 and A100 do not",
            "plan with float8=None, or for a GPU preset with FP8 (H100-80GB, B200-180GB, GB200-186GB, …)",
        ))


def refuse_float8_run(float8: str | None) -> None:
    """A :class:`CodegenError` for stages of a plan costed in FP8: autosplit does not run FP8 stages yet, and
    running its linears in bf16 would train slower than the plan says, unlike what it was planned for."""
    if float8 is not None:
        raise CodegenError(advice(
            f"the plan's linears were costed in FP8 (float8={float8!r}), and autosplit does not yet run FP8 stages",
            "its stages would run the linears in bf16: slower than the plan says, and unlike the FP8 training it was planned for",
            "plan with float8=None to run it; FP8 costing compares recipes, running them is issue 64",
        ))
