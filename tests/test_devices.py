"""Device entries, presets and memory caps."""

from __future__ import annotations

import pytest
import torch

from autosplit import DeviceSpec
from autosplit.devices import PRESETS, resolve_devices
from autosplit.errors import DeviceError
from autosplit.units import parse_bytes


def test_repeated_cpu_entries_are_distinct_logical_devices():
    specs = resolve_devices(["cpu"] * 4)
    assert len(specs) == 4 and all(s.torch_device == "cpu" for s in specs)


@pytest.mark.parametrize("name", ["V100-16GB", "A100-80GB", "H100-80GB", "H100-96GB-500W", "H200-141GB", "H800-80GB",
                                  "B200-180GB", "B300-288GB", "GB200-186GB", "GB300-288GB", "cpu"])
def test_presets_resolve(name):
    (spec,) = resolve_devices([name])
    assert spec.peak_flops > 0 and spec.memory > 0 and spec.memory_bandwidth > 0


def test_the_record_gpus_carry_their_datasheet_figures():
    """Spot checks against the datasheets the module names: dense peaks, HBM, NVLink one way."""
    h100, titan, b200, gb300 = (PRESETS[n] for n in ("H100-80GB", "H100-96GB-500W", "B200-180GB", "GB300-288GB"))
    assert (h100.peak_flops_half, h100.peak_flops_fp8, h100.peak_flops_fp4) == (989e12, 1979e12, None)
    assert titan.memory == 96 * 2**30 and titan.memory_bandwidth == 2.4e12 and titan.peak_flops_half == h100.peak_flops_half
    assert b200.peak_flops_fp8 == 2 * b200.peak_flops_half == 4.5e15 and b200.link_bandwidth == 900e9
    assert gb300.peak_flops_fp4 == 3 * gb300.peak_flops_fp8 == 15e15 and PRESETS["H800-80GB"].link_bandwidth == 200e9
    assert all(p.peak_flops_fp8 is None for n, p in PRESETS.items() if n.startswith(("V100", "A100", "cpu")))


def test_preset_names_are_case_insensitive_and_plan_only():
    (spec,) = resolve_devices(["a100-80gb"])
    assert spec == PRESETS["A100-80GB"] and spec.torch_device is None


def test_mixed_entries_and_memory_caps_by_name_and_index():
    custom = DeviceSpec("tpu-ish", 8 * 2**30, 1e14, 1e12, 1e11)
    specs = resolve_devices([torch.device("cpu"), "cpu", custom], memory={"cpu": "1GiB", 2: "512MiB"})
    assert [s.memory for s in specs] == [2**30, 2**30, 512 * 2**20]
    assert specs[2].name == "tpu-ish"


@pytest.mark.parametrize(
    "text, expected",
    [("20GiB", 20 * 2**30), ("16GB", 16 * 10**9), ("1.5 MiB", int(1.5 * 2**20)), (4096, 4096), ("512", 512)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "devices, memory, message",
    [
        (["nonsense-device"], None, "unknown device 'nonsense-device'"),
        (["cpu"], {"cuda:3": "1GiB"}, "matches no device"),
        (["cpu"], {5: "1GiB"}, "only 1 devices are given"),
        (["cpu"], {"cpu": "lots"}, "cannot read memory size 'lots'"),
        ([], None, "no devices given"),
    ],
)
def test_bad_device_input_is_a_clear_error(devices, memory, message):
    with pytest.raises(DeviceError, match=message):
        resolve_devices(devices, memory)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_missing_cuda_device_points_to_presets():
    with pytest.raises(DeviceError, match="pass a preset such as 'A100-80GB'"):
        resolve_devices(["cuda:1"])
