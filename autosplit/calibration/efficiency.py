"""Calibration: fit the analytic model's efficiency factors to a short profile.

The roofline (``passes/costs.py``) predicts a node's time on a :class:`DeviceSpec` as

    t = max(flops / (peak · e), bytes / (bandwidth · e_mem)) + overhead

A spec sheet gives ``peak`` and ``bandwidth``; what kernels reach of them (``e``, ``e_mem``)
and the fixed cost per op (``overhead``: dispatch, launch, Python) depend on the machine,
the library build and the thread count. :func:`fit` chooses them to minimise the summed
absolute error over the profiled nodes' forward and backward times — the error that
matters, since stage times are sums of node times. For fixed ``e`` and ``e_mem`` the best
``overhead`` under absolute error is the median residual (clipped at 0), so only the two
efficiencies are searched, on a log grid (the ``max`` makes the loss non-smooth, which a
grid handles and a gradient method does not; 81 × 81 points cost milliseconds in numpy).

A calibrated spec plans hardware you have without profiling every model, and hardware you
do not have on the same footing: the same model, fitted where it can be measured.

Usage::

    spec = autosplit.calibrate(model, "cpu", example_inputs=(x,), options=ProfileOptions(threads=1))
    plan = autosplit.plan(other_model, [spec] * 4, example_inputs=(y,))
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from autosplit.devices import DeviceLike, DeviceSpec, resolve_devices
from autosplit.errors import CostModelError, advice
from autosplit.options import ProfileOptions
from autosplit.passes.annotate import annotate
from autosplit.passes.annotations import node_info
from autosplit.passes.capture import capture, fingerprint, flat_inputs
from autosplit.passes.profile import Profile, profile

__all__ = ["Calibration", "fit", "calibrate"]


@dataclass(frozen=True)
class Calibration:
    """Fitted factors of one device, and how well they explain the profile."""

    efficiency: float
    memory_efficiency: float
    launch_overhead: float
    samples: int
    """Forward and backward times the fit used."""
    median_error: float
    """Median |relative error| of the fitted node times (fwd and bwd)."""
    total_error: float
    """Relative error of the summed time over all samples."""

    def apply(self, spec: DeviceSpec) -> DeviceSpec:
        return dataclasses.replace(
            spec, efficiency=self.efficiency, memory_efficiency=self.memory_efficiency, launch_overhead=self.launch_overhead
        )


def fit(samples: Sequence[tuple[float, float, float]], spec: DeviceSpec) -> Calibration:
    """Fit ``spec``'s factors to ``(flops, bytes, seconds)`` samples (see the module docstring)."""
    if len(samples) < 3:
        raise CostModelError(advice(
            f"calibration needs at least 3 timed ops, got {len(samples)}", "the profiled model has too few compute nodes",
            "calibrate on a larger model",
        ))
    flops, nbytes, seconds = (np.asarray(col, dtype=np.float64) for col in zip(*samples))
    grid = np.logspace(-3, 1, 81)  # above 1: the spec sheet undersells this machine
    compute = flops[None, :] / (spec.peak_flops * grid[:, None])  # (E, N)
    memory = nbytes[None, :] / (spec.memory_bandwidth * grid[:, None])
    roof = np.maximum(compute[:, None, :], memory[None, :, :])  # (E, E_mem, N)
    overhead = np.maximum(np.median(seconds - roof, axis=2), 0.0)
    loss = np.abs(roof + overhead[..., None] - seconds).sum(axis=2)
    i, j = np.unravel_index(np.argmin(loss), loss.shape)
    predicted = roof[i, j] + overhead[i, j]
    rel = np.abs(predicted - seconds) / np.maximum(seconds, 1e-12)
    return Calibration(
        efficiency=float(grid[i]), memory_efficiency=float(grid[j]), launch_overhead=float(overhead[i, j]),
        samples=len(seconds), median_error=float(np.median(rel)),
        total_error=float(predicted.sum() / seconds.sum() - 1),
    )


def samples_of(gm: torch.fx.GraphModule, prof: Profile, scale: float = 1.0) -> list[tuple[float, float, float]]:
    """(flops, bytes, seconds) of every profiled node's forward and backward, the way the
    roofline counts them (backward moves twice the bytes). ``scale``: annotated batch / profiled batch."""
    out = []
    for n in gm.graph.nodes:
        if n.name not in prof.nodes or n.target is operator.getitem:
            continue
        info, got = node_info(n), prof.nodes[n.name]
        nbytes = 0.0 if info.moves_nothing else (info.input_bytes + info.output_bytes) / scale  # a view reads nothing
        out.append((info.fwd_flops / scale, nbytes, got.fwd))
        if got.bwd > 0:
            out.append((info.bwd_flops / scale, 2 * nbytes, got.bwd))
    return out


def calibrate(
    model: torch.nn.Module,
    device: DeviceLike = "cpu",
    *,
    example_inputs: tuple,
    example_kwargs: Mapping[str, Any] | None = None,
    options: ProfileOptions | None = None,
) -> DeviceSpec:
    """Profile ``model`` once on ``device`` and return its spec with fitted factors.

    The returned spec carries the :class:`Calibration` figures in its efficiency fields;
    use it as a device in :func:`autosplit.plan` (analytic costs, no profiling).
    """
    (spec,) = resolve_devices([device])
    if spec.torch_device is None:
        raise CostModelError(advice(
            f"cannot calibrate {spec.name}", "it is a preset, not a device present on this machine",
            "calibrate a device you have ('cpu', 'cuda:0')",
        ))
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    captured = capture(model, example_inputs, dict(example_kwargs or {}))
    inputs = flat_inputs(captured, example_inputs, example_kwargs)
    annotate(captured, inputs)
    prof = profile(captured, inputs, spec.torch_device, fingerprint=fingerprint(captured.gm), options=options or ProfileOptions())
    return fit(samples_of(captured.gm, prof), spec).apply(spec)
