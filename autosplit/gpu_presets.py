"""The GPUs the published record ran on, and the systems they came in: spec-sheet figures, with their sources.

Every figure is the vendor's dense (no 2:4 sparsity) peak or nominal bandwidth; what real kernels reach of
them is the calibrated model's business (:mod:`autosplit.engine_profiles`), not a preset's. Link
bandwidth is one direction of the GPU's NVLink aggregate (NVLink 4: 900 GB/s both ways = 450 GB/s;
NVLink 5: 1.8 TB/s = 900 GB/s); the network is what one GPU's NIC moves one way.

=================  =======  ========  =========  ========  =========  ===========  ====================================
preset             memory   BF16 TF   FP8 TF     FP4 TF    HBM TB/s   NVLink GB/s  source
=================  =======  ========  =========  ========  =========  ===========  ====================================
H100-80GB          80 GiB   989       1,979      —         3.35       450          NVIDIA H100 Tensor Core GPU datasheet
                                                                                   (SXM5, 700 W); DGX H100 datasheet
H100-96GB-500W     96 GiB   989       1,979      —         2.4        450          torchtitan benchmarks/asyncTP_llama3_
                                                                                   h100_2025-06 (Grand Teton: 96 GB
                                                                                   HBM2e, 2.4 TB/s, 500 W power limit)
H200-141GB         141 GB   989       1,979      —         4.8        450          NVIDIA H200 Tensor Core GPU datasheet
H800-80GB          80 GiB   989       1,979      —         3.35       200          H100 compute with NVLink cut to
                                                                                   400 GB/s; DeepSeek-V3 report §3.1
                                                                                   (160 GB/s achieved, IB 50 GB/s)
B200-180GB         180 GB   2,250     4,500      9,000     8          900          NVIDIA DGX B200 datasheet (8 GPUs:
                                                                                   1,440 GB, 64 TB/s, 72 PF FP8 sparse)
B300-288GB         288 GB   2,250     4,500      13,500    8          900          NVIDIA DGX/HGX B300 datasheet (8
                                                                                   GPUs: 2.3 TB, 108 PF FP4 dense)
GB200-186GB        186 GB   2,500     5,000      10,000    8          900          NVIDIA GB200 NVL72 datasheet (72
                                                                                   GPUs: 13.4 TB, 576 TB/s, 360 PF
                                                                                   BF16 / 720 PF FP8 sparse)
GB300-288GB        288 GB   2,500     5,000      15,000    8          900          NVIDIA GB300 NVL72 datasheet (72
                                                                                   GPUs: 20.7 TB, 576 TB/s, 1,080 PF
                                                                                   FP4 dense)
=================  =======  ========  =========  ========  =========  ===========  ====================================

FP32 (CUDA cores, not tensor cores) is 67 TF on Hopper, 75–90 TF on Blackwell; the GB200 and GB300 parts
run at 1,200 and 1,400 W, the B200 and B300 at 1,000 and 1,100 W.

:data:`SYSTEMS` says how each came: GPUs per NVLink domain (8 per HGX/DGX board, 72 per NVL72 rack), and
the NIC per GPU (400 Gb/s ConnectX-7 unless the source says otherwise: ConnectX-8 800 Gb/s on B300 and
GB300). :meth:`autosplit.Cluster.of` builds a cluster of any of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from autosplit.device_spec import DeviceSpec
from autosplit.errors import ConstraintError, advice
from autosplit.units import GiB

__all__ = ["GPU_PRESETS", "SYSTEMS", "System", "domain_size"]

GB = 10**9
_NVLINK4, _NVLINK5 = 450e9, 900e9

GPU_PRESETS: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("H100-80GB", 80 * GiB, 67e12, 3.35e12, _NVLINK4, 5e-6, peak_flops_half=989e12, peak_flops_fp8=1979e12),
        DeviceSpec("H100-96GB-500W", 96 * GiB, 67e12, 2.4e12, _NVLINK4, 5e-6, peak_flops_half=989e12, peak_flops_fp8=1979e12),
        DeviceSpec("H200-141GB", 141 * GB, 67e12, 4.8e12, _NVLINK4, 5e-6, peak_flops_half=989e12, peak_flops_fp8=1979e12),
        DeviceSpec("H800-80GB", 80 * GiB, 67e12, 3.35e12, 200e9, 5e-6, peak_flops_half=989e12, peak_flops_fp8=1979e12),
        DeviceSpec("B200-180GB", 180 * GB, 80e12, 8e12, _NVLINK5, 5e-6, peak_flops_half=2.25e15, peak_flops_fp8=4.5e15,
                   peak_flops_fp4=9e15),
        DeviceSpec("B300-288GB", 288 * GB, 75e12, 8e12, _NVLINK5, 5e-6, peak_flops_half=2.25e15, peak_flops_fp8=4.5e15,
                   peak_flops_fp4=13.5e15),
        DeviceSpec("GB200-186GB", 186 * GB, 90e12, 8e12, _NVLINK5, 5e-6, peak_flops_half=2.5e15, peak_flops_fp8=5e15,
                   peak_flops_fp4=10e15),
        DeviceSpec("GB300-288GB", 288 * GB, 80e12, 8e12, _NVLINK5, 5e-6, peak_flops_half=2.5e15, peak_flops_fp8=5e15,
                   peak_flops_fp4=15e15),
    )
}


@dataclass(frozen=True)
class System:
    """How a GPU came: ``domain`` GPUs share an NVLink switch fabric, each with its own NIC of ``nic`` bytes/s one way."""

    name: str
    preset: str
    domain: int
    nic: float
    source: str
    tray: int = 8
    """GPUs that come together (a board or a compute tray): a job fills a domain in whole trays."""


SYSTEMS: dict[str, System] = {
    "H100": System("DGX H100", "H100-80GB", 8, 50e9, "NVIDIA DGX H100 datasheet: 8 × 400 Gb/s ConnectX-7"),
    "H100-500W": System("Grand Teton H100", "H100-96GB-500W", 8, 50e9,
                        "torchtitan benchmarks/asyncTP_llama3_h100_2025-06: 400 Gb/s RDMA per GPU"),
    "H200": System("HGX H200", "H200-141GB", 8, 50e9, "NVIDIA HGX H200: 400 Gb/s ConnectX-7 per GPU"),
    "H800": System("HGX H800", "H800-80GB", 8, 50e9, "DeepSeek-V3 technical report §3.1: 400 Gb/s InfiniBand per GPU"),
    "B200": System("DGX B200", "B200-180GB", 8, 50e9, "NVIDIA DGX B200 datasheet: 8 × 400 Gb/s ConnectX-7"),
    "B300": System("DGX B300", "B300-288GB", 8, 100e9, "NVIDIA DGX B300 datasheet: 8 × 800 Gb/s ConnectX-8"),
    "GB200": System("GB200 NVL72", "GB200-186GB", 72, 50e9, "NVIDIA GB200 NVL72 datasheet: 72-GPU NVLink domain, "
                    "400 Gb/s ConnectX-7 per GPU", tray=4),
    "GB300": System("GB300 NVL72", "GB300-288GB", 72, 100e9, "NVIDIA GB300 NVL72 datasheet: 72-GPU NVLink domain, "
                    "800 Gb/s ConnectX-8 per GPU", tray=4),
}


def domain_size(kind: str, gpus: int) -> tuple[System, int]:
    """(the system, GPUs per NVLink domain) of a job of ``gpus`` GPUs of ``kind``: the largest whole number
    of trays that divides the job and fits a domain (256 GB200s: 4 racks of 64), or the whole job where it
    fits one domain in fewer; a job that fills no domains evenly is a :class:`ConstraintError`."""
    system = SYSTEMS.get(str(kind).upper())
    if system is None or isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConstraintError(advice(
            f"a cluster of {gpus!r} × {kind!r}", "a cluster is a whole number ≥ 1 of GPUs of a known kind",
            f"pass one of {', '.join(SYSTEMS)} and a count ≥ 1",
        ))
    trays = [d for d in range(system.tray, min(gpus, system.domain) + 1, system.tray) if gpus % d == 0]
    if trays:
        return system, max(trays)
    if gpus <= system.domain:
        return system, gpus
    raise ConstraintError(advice(
        f"{gpus} × {system.name} GPUs do not fill NVLink domains evenly",
        f"a domain holds up to {system.domain} GPUs in trays of {system.tray}", f"pass a multiple of {system.tray}",
    ))
