"""The figures of one device as the analytic cost model uses them (:class:`DeviceSpec`); presets live
in :mod:`autosplit.devices` and :mod:`autosplit.gpu_presets`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DeviceSpec"]


@dataclass(frozen=True)
class DeviceSpec:
    """The hardware figures of one device, as the analytic cost model uses them."""

    name: str
    """Human name, e.g. ``"A100-80GB"`` or ``"cpu"``."""
    memory: int
    """Memory available for training state and activations, in bytes."""
    peak_flops: float
    """Peak dense FP32 throughput, FLOP/s."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    link_bandwidth: float
    """Bandwidth of this device's link to its peers, bytes/s (one direction)."""
    link_latency: float = 10e-6
    """Latency of one transfer over the link, seconds."""
    peak_flops_half: float | None = None
    """Peak FP16/BF16 throughput (tensor cores), FLOP/s; ``None`` means same as FP32."""
    peak_flops_fp8: float | None = None
    """Peak FP8 tensor-core throughput, FLOP/s; ``None``: the device has no FP8 tensor cores."""
    peak_flops_fp4: float | None = None
    """Peak FP4 (NVFP4, MXFP4) tensor-core throughput, FLOP/s; ``None``: the device has none."""
    efficiency: float = 0.6
    """Fraction of peak FLOP/s that real kernels reach (``calibrate`` fits it from a profile)."""
    memory_efficiency: float | None = None
    """Fraction of peak memory bandwidth reached by memory-bound ops; ``None``: ``efficiency``."""
    engine: str | None = None
    """The engine profile whose kernels the figures are (:mod:`autosplit.engine_profiles`): its fitted
    efficiencies above, and the fusions the memory model counts (:mod:`autosplit.passes.fusion`); ``None``: none."""
    tp_overlap: float = 0.0
    """Under ``async_tp``, the share of each tensor-parallel collective the engine hides behind the GEMM beside
    it (at most that GEMM's time): 0 for none; an engine profile's fitted figure (:mod:`autosplit.engine_profiles`)."""
    ep_overlap: float = 0.0
    """Under ``ep_overlap``, the share of a layer's expert all-to-alls the engine hides behind another micro-batch's
    compute of that layer (at most that compute): 0 for none; an engine profile's fitted figure."""
    attention_share: float = 1.0
    """The share of ``efficiency`` the attention kernels (scaled-dot-product, flash) reach beside the GEMMs: an engine
    profile's fitted figure, its flash kernel's (:mod:`autosplit.engine_profiles`); 1: the GEMMs' own."""
    launch_overhead: float = 5e-6
    """Fixed cost of launching one operator, seconds."""
    torch_device: str | None = None
    """Where generated code runs (``"cuda:0"``); ``None`` for hardware planned but not present."""
    island: str | None = None
    """Devices with the same island (e.g. one NVLink domain, ``"node0"``) talk over ``link_*``;
    devices on different islands over ``network_*``."""
    island_size: int | None = None
    """Devices per island (a node's GPUs), where known: a data-parallel group of the mesh (consecutive
    ranks) larger than this leaves the island (:func:`autosplit.passes.sharding.group_time`)."""
    island_stride: int = 1
    """On a stage rank of a mesh (:func:`~autosplit.compiler.mesh.stage_ranks`), the ranks between two of its
    data-parallel group's (cp · tp, the innermost dimensions): 1 elsewhere (:attr:`group_island`)."""
    network_bandwidth: float = 25e9
    """Bandwidth between islands, bytes/s (25e9 = one 200 Gb/s InfiniBand port)."""
    network_latency: float = 5e-6
    microbatch_overhead: float = 0.0
    """The pipeline runtime's fixed seconds per micro-batch on a stage, forward and backward
    (scheduling, send/recv set-up); 0 until measured (``autosplit.calibration.measure_runtime``)."""
    allreduce_bandwidth: float | None = None
    """Per-hop bandwidth of a ring all-reduce between devices of one island as the backend runs it,
    bytes/s; ``None``: ``link_bandwidth``. Measured where it differs: gloo's CPU all-reduce also
    sums on the cores and hands data between its threads (``measure_runtime`` fits it)."""
    allreduce_latency: float | None = None
    """Per-hop latency of that all-reduce, seconds; ``None``: ``link_latency``."""

    @property
    def device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``: whose autocast policy and kernels the cost model assumes (presets of
        GPUs, and any spec not named or placed on the CPU, are GPUs)."""
        return "cpu" if (self.torch_device or self.name).startswith("cpu") else "cuda"

    @property
    def group_island(self) -> int | None:
        """Members of this device's data-parallel group on one island: ``island_size`` over ``island_stride``, at
        least one (``None``: no islands known)."""
        return max(1, self.island_size // self.island_stride) if self.island_size else None

    def link_to(self, other: DeviceSpec) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) from this device to ``other``: the slower end decides."""
        if self.island == other.island:
            return min(self.link_bandwidth, other.link_bandwidth), max(self.link_latency, other.link_latency)
        return min(self.network_bandwidth, other.network_bandwidth), max(self.network_latency, other.network_latency)

    def allreduce_link(self, other: DeviceSpec) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of one hop of a ring all-reduce between this device and
        ``other`` (:func:`~autosplit.solver.hybrid.ring_allreduce`): the measured all-reduce figures
        within an island, where both have them; else the link's."""
        if self.island != other.island:
            return self.link_to(other)
        bandwidths, latencies = (self.allreduce_bandwidth, other.allreduce_bandwidth), (self.allreduce_latency, other.allreduce_latency)
        if None in bandwidths or None in latencies:
            return self.link_to(other)
        return min(b for b in bandwidths if b is not None), max(t for t in latencies if t is not None)

    def on_island(self, island: str) -> DeviceSpec:
        return dataclasses.replace(self, island=island)

    def with_memory(self, memory: int) -> DeviceSpec:
        return dataclasses.replace(self, memory=int(memory))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> DeviceSpec:
        return cls(**data)
