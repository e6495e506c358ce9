"""Devices: what autosplit plans for.

A device is either a real ``torch.device`` (``"cpu"``, ``"cuda:1"``) or a :class:`DeviceSpec`
describing hardware you may not have (``"A100-80GB"``). Both resolve to a ``DeviceSpec``;
the spec carries the numbers the cost model needs, and ``torch_device`` says where the
generated stage runs (``None`` for plan-only hardware).

Usage::

    specs = resolve_devices(["cpu"] * 4, memory={"cpu": "2GiB"})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

from autosplit.device_spec import DeviceSpec
from autosplit.errors import DeviceError, advice
from autosplit.gpu_presets import GPU_PRESETS
from autosplit.units import GiB, format_bytes, parse_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceSpec", "PRESETS", "resolve_devices", "parse_bytes", "format_bytes"]

# Public spec-sheet figures (dense, no sparsity). Link bandwidth is one direction of the
# device's NVLink aggregate; the CPU entry stands for one socket of a commodity server.
# V100: NVIDIA Tesla V100 datasheet; A100: NVIDIA A100 datasheet (SXM4 80 GB).
PRESETS: dict[str, DeviceSpec] = {
    "V100-16GB": DeviceSpec(
        "V100-16GB", 16 * GiB, 15.7e12, 900e9, 150e9, 5e-6, peak_flops_half=125e12
    ),
    "V100-32GB": DeviceSpec(
        "V100-32GB", 32 * GiB, 15.7e12, 900e9, 150e9, 5e-6, peak_flops_half=125e12
    ),
    "A100-80GB": DeviceSpec(
        "A100-80GB", 80 * GiB, 19.5e12, 2039e9, 300e9, 5e-6, peak_flops_half=312e12
    ),
    **GPU_PRESETS,  # the record's GPUs, Hopper and Blackwell, with their sources
    "cpu": DeviceSpec(
        "cpu", 16 * GiB, 100e9, 20e9, 10e9, 10e-6, efficiency=0.5, launch_overhead=5e-6
    ),
}

DeviceLike: TypeAlias = "str | torch.device | DeviceSpec"


def _cuda_spec(dev: torch.device) -> DeviceSpec:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = dev.index or 0
    if index >= count:
        raise DeviceError(advice(
            f"device {dev} is not available here (torch.cuda.device_count() = {count})",
            "the plan names a GPU this machine does not have",
            f"to plan for hardware you do not have, pass a preset such as 'A100-80GB' (presets: {', '.join(PRESETS)}) "
            "or a DeviceSpec",
        ))
    props = torch.cuda.get_device_properties(index)
    # the longest GPU kind the driver's name holds: "NVIDIA GB200" is a GB200, not a B200
    matches = [(len(key.split("-")[0]), p) for key, p in PRESETS.items() if key.split("-")[0] in props.name]
    base = max(matches, key=lambda m: m[0])[1] if matches else None
    if base is None:  # an unknown GPU: take A100 figures, the memory from the driver
        base = PRESETS["A100-80GB"]
    return dataclasses.replace(base, name=props.name, memory=int(props.total_memory), torch_device=str(dev))


def _resolve_one(entry: DeviceLike) -> DeviceSpec:
    import torch

    if isinstance(entry, DeviceSpec):
        return entry
    if isinstance(entry, str):
        preset = next((p for key, p in PRESETS.items() if key.lower() == entry.lower()), None)
        if preset is not None and preset.name != "cpu":
            return preset
        try:
            entry = torch.device(entry)
        except (RuntimeError, ValueError) as e:
            raise DeviceError(advice(
                f"unknown device {entry!r}", f"it is neither a torch device string nor a preset ({', '.join(PRESETS)})",
                "pass 'cpu', 'cuda:N', a preset name, or a DeviceSpec to describe other hardware",
            )) from e
    if isinstance(entry, torch.device):
        if entry.type == "cpu":
            return dataclasses.replace(PRESETS["cpu"], torch_device="cpu")
        if entry.type == "cuda":
            return _cuda_spec(entry)
        raise DeviceError(advice(
            f"device type {entry.type!r} is not supported", "autosplit plans for CPU and CUDA devices",
            "use cpu, cuda or a DeviceSpec that describes the hardware",
        ))
    raise DeviceError(advice(
        f"cannot use {entry!r} (type {type(entry).__name__}) as a device",
        "a device is a string, a torch.device or a DeviceSpec", "pass e.g. 'cpu', 'cuda:0' or 'A100-80GB'",
    ))


def uncalibrated(spec: DeviceSpec) -> bool:
    """Whether ``spec`` is a device present here (``torch_device``) still described by its preset's
    roofline factors: its analytic costs are an estimate nobody fitted to this machine."""
    if spec.torch_device is None:
        return False
    try:
        preset = _resolve_one(spec.torch_device)
    except DeviceError:
        return False
    fitted = ("efficiency", "memory_efficiency", "launch_overhead", "microbatch_overhead", "link_bandwidth", "link_latency")
    return all(getattr(spec, f) == getattr(preset, f) for f in fitted)


def resolve_devices(
    devices: Sequence[DeviceLike],
    memory: Mapping[int | str, int | str] | None = None,
) -> tuple[DeviceSpec, ...]:
    """Turn user device entries into specs, applying per-device memory caps.

    Repeated entries (``["cpu"] * 4``) are distinct logical devices. ``memory`` keys are a
    device index, or a device string / spec name that applies to every matching entry.
    """
    import torch

    if isinstance(devices, (str, torch.device, DeviceSpec)):
        devices = [devices]
    if not devices:
        raise DeviceError(advice(
            "no devices given", "the device list is empty", "pass a list such as ['cpu'] * 2 or ['A100-80GB'] * 8"
        ))
    specs = [_resolve_one(d) for d in devices]
    for key, cap in (memory or {}).items():
        if isinstance(key, int):
            if not 0 <= key < len(specs):
                raise DeviceError(advice(
                    f"option memory names device index {key}, but only {len(specs)} devices are given",
                    "memory keys are indices into the device list", f"use an index in 0..{len(specs) - 1} or a device name",
                ))
            hits = [key]
        else:
            key_str = str(key)
            hits = [i for i, s in enumerate(specs) if key_str in (s.torch_device, s.name)]
            if not hits:
                names = sorted({s.torch_device or s.name for s in specs})
                raise DeviceError(advice(
                    f"option memory names {key_str!r}, which matches no device",
                    f"the devices are {names}", "key the cap by one of those names or by a device index",
                ))
        for i in hits:
            specs[i] = specs[i].with_memory(parse_bytes(cap))
    return tuple(specs)
