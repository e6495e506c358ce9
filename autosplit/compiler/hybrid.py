"""The hybrid planner's rows: for each replica size, one worker's plan and its data-parallel
all-reduce, the step, and the time to the target from the statistical efficiency of the global
batch (:mod:`autosplit.solver.hybrid`). :func:`autosplit.plan_hybrid` plans the workers.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autosplit import schedules
from autosplit.devices import PRESETS, DeviceSpec
from autosplit.engine_profiles import profiled
from autosplit.errors import ConstraintError, InfeasiblePlanError, advice
from autosplit.gpu_presets import GPU_PRESETS, domain_size
from autosplit.plans import Plan, StageReport
from autosplit.solver.hybrid import (
    examples_factor,
    hierarchical_phases,
    ring_allgather,
    ring_allreduce,
    time_to_target,
)
from autosplit.units import format_bytes

__all__ = [
    "assemble", "Cluster", "default_micro_batches", "divisors", "first_sentence", "HybridPlan", "HybridRow",
    "is_count", "is_real", "ScalingPoint", "sync_windows",
]


@dataclass(frozen=True)
class Cluster:
    """N = ``nodes × per_node`` identical devices: NVLink-class links inside a node, a network between nodes."""

    name: str
    device: DeviceSpec
    nodes: int
    per_node: int
    intra: tuple[float, float]
    """(bandwidth bytes/s one direction per device, latency s) inside a node."""
    inter_bandwidth: float
    """Network bytes/s one direction per node (all its ports together)."""
    inter_latency: float
    source: str = ""
    """Where the figures come from."""
    nic_bandwidth: float | None = None
    """The most one device moves to the network, bytes/s one direction (its NIC's, shared with the
    devices on the same NIC); ``None``: its even share of the node's, ``inter_bandwidth / per_node``."""

    def __post_init__(self) -> None:
        def refuse(field: str, value: object, rule: str, fix: str) -> ConstraintError:
            return ConstraintError(advice(
                f"Cluster {self.name!r}: {field}={value!r} {rule}",
                "a cluster is nodes × per_node identical devices, linked by intra = (bandwidth, latency) inside a node "
                "and by the network between nodes", fix,
            ))

        if not isinstance(self.device, DeviceSpec):
            raise refuse("device", self.device, "is not a DeviceSpec", "pass autosplit.devices.PRESETS['V100-16GB'] or a DeviceSpec")
        for field in ("nodes", "per_node"):
            if not is_count(getattr(self, field)):
                raise refuse(field, getattr(self, field), "is not an integer ≥ 1", f"pass {field}=1 or more")
        if not (isinstance(self.intra, (tuple, list)) and len(self.intra) == 2):
            raise refuse("intra", self.intra, "is not a (bandwidth, latency) pair", "pass intra=(150e9, 5e-6) (bytes/s, seconds)")
        object.__setattr__(self, "intra", tuple(self.intra))
        for field, value in (("intra[0] (bandwidth)", self.intra[0]), ("inter_bandwidth", self.inter_bandwidth)):
            if not (is_real(value) and value > 0):
                raise refuse(field, value, "is not a positive number of bytes/s", "pass the link's bandwidth, e.g. 25e9")
        share = self.inter_bandwidth / self.per_node
        if self.nic_bandwidth is not None and not (is_real(self.nic_bandwidth) and share <= self.nic_bandwidth <= self.inter_bandwidth):
            raise refuse("nic_bandwidth", self.nic_bandwidth, f"is not between the even share ({share:.3g}) and the node's "
                         f"network ({self.inter_bandwidth:.3g} bytes/s)", "pass one NIC's bandwidth, or None for the even share")
        for field, value in (("intra[1] (latency)", self.intra[1]), ("inter_latency", self.inter_latency)):
            if not (is_real(value) and 0 <= value < math.inf):
                raise refuse(field, value, "is not a finite number of seconds ≥ 0", "pass the link's latency, e.g. 5e-6")

    @property
    def size(self) -> int:
        return self.nodes * self.per_node

    def replica_devices(self, k: int) -> list[DeviceSpec]:
        """The k devices of one worker: node by node, each node an island of NVLink peers, a
        device's share of its node's network between islands."""
        share = self.inter_bandwidth / self.per_node
        return [
            dataclasses.replace(self.device, link_bandwidth=self.intra[0], link_latency=self.intra[1],
                                island=f"node{d // self.per_node}", island_size=self.per_node, network_bandwidth=share,
                                network_latency=self.inter_latency)
            for d in range(k)
        ]

    def allreduce(self, nbytes: float, k: int, replicas: int, *, gather: bool = False) -> float:
        """Seconds to all-reduce one stage's gradients (``nbytes``) over its ``replicas`` copies,
        worker r's copy on device ``r·k + s`` — or, ``gather``, to all-gather ``nbytes`` from each
        copy (a row-sparse gradient) — each device on its even share of its node's network."""
        return sum(self._phases(nbytes, k, replicas, gather=gather))

    def _phases(self, nbytes: float, k: int, replicas: int, *, gather: bool = False) -> tuple[float, float]:
        """(inside the nodes, across them) seconds of :meth:`allreduce`."""
        share = (self.inter_bandwidth / self.per_node, self.inter_latency)
        if replicas <= 1:
            return 0.0, 0.0
        if k <= self.per_node and self.per_node % k == 0:
            local = min(replicas, self.per_node // k)
            return hierarchical_phases(nbytes, local=local, nodes=math.ceil(replicas / local), intra=self.intra, inter=share, gather=gather)
        return 0.0, (ring_allgather if gather else ring_allreduce)(nbytes, replicas, *share)  # each copy on its own node

    def _sync_phases(self, stage: StageReport, k: int, replicas: int) -> tuple[float, float]:
        """(inside, across) seconds to sum one stage's gradients over its ``replicas`` copies: the
        dense ones all-reduced; its embedding tables' all-gathered as the rows each copy looked up
        (:attr:`StageReport.row_grad_bytes`) where that moves less time than all-reducing them whole."""
        dense = self._phases(stage.param_bytes - stage.sparse_param_bytes, k, replicas)
        if not stage.sparse_param_bytes:
            return dense
        tables = min(self._phases(stage.sparse_param_bytes, k, replicas),
                     self._phases(stage.row_grad_bytes, k, replicas, gather=True), key=sum)
        return dense[0] + tables[0], dense[1] + tables[1]

    def gradient_sync(self, stage: StageReport, k: int, replicas: int) -> float:
        """Seconds to sum one stage's gradients over its ``replicas`` copies (:meth:`_sync_phases`),
        every device of a node exchanging as much at once, on its even share of the node's network."""
        return sum(self._sync_phases(stage, k, replicas))

    def gradient_syncs(self, stages: Sequence[StageReport], k: int, replicas: int) -> list[float]:
        """Seconds each of a worker's ``stages`` takes to sum its gradients, all of them at once.

        A node's devices share its network: where each worker's k stages lie side by side on a
        node (k divides ``per_node``), the node's part across the nodes ends when it has moved all
        its devices' bytes at its full bandwidth — no device faster than its NIC
        (:attr:`nic_bandwidth`), none slower than on its even share (:meth:`gradient_sync`). A
        worker whose stages move unequal bytes (a large table on one device) then leaves the
        lighter devices' shares to the heavier ones. Otherwise each device keeps its even share."""
        phases = [self._sync_phases(st, k, replicas) for st in stages]
        if not (k <= self.per_node and self.per_node % k == 0 and self.nic_bandwidth):
            return [sum(p) for p in phases]
        node = sum(across for _, across in phases) / k  # per_node / k copies of each stage, at the node's full bandwidth
        faster = self.nic_bandwidth / (self.inter_bandwidth / self.per_node)
        return [inside + min(across, max(node, across / faster)) for inside, across in phases]

    # Presets. Figures: NVIDIA's system architecture white papers; one direction per device.
    @classmethod
    def dgx1(cls, nodes: int = 1, gpu_memory_gb: int = 16) -> Cluster:
        """DGX-1 with V100: 8 × V100-SXM2 (16 GB; 32 GB from 2018), NVLink 2.0 hybrid cube-mesh
        (6 links × 25 GB/s = 150 GB/s per GPU), 4 × 100 Gb/s EDR InfiniBand per node (50 GB/s), one
        NIC per pair of GPUs on a PCIe switch (12.5 GB/s); NVIDIA WP-08437-002 (2017)."""
        if gpu_memory_gb not in (16, 32):
            raise ConstraintError(advice(f"gpu_memory_gb={gpu_memory_gb}", "a DGX-1's V100s have 16 or 32 GB", "pass 16 or 32"))
        return cls(f"DGX-1 (V100-{gpu_memory_gb}GB)", PRESETS[f"V100-{gpu_memory_gb}GB"], nodes, 8, (150e9, 5e-6),
                   4 * 12.5e9, 5e-6, "NVIDIA DGX-1 with Tesla V100 System Architecture, WP-08437-002 (2017)", 12.5e9)

    @classmethod
    def dgx_a100(cls, nodes: int = 1) -> Cluster:
        """DGX A100: 8 × A100-80GB, NVSwitch (600 GB/s bidirectional = 300 GB/s per GPU),
        8 × 200 Gb/s HDR InfiniBand (25 GB/s per GPU); NVIDIA WP-10083-001 (2020)."""
        return cls("DGX A100", PRESETS["A100-80GB"], nodes, 8, (300e9, 5e-6), 8 * 25e9, 5e-6,
                   "NVIDIA DGX A100 System Architecture, WP-10083-001 (2020)")

    @classmethod
    def dgx_h100(cls, nodes: int = 1) -> Cluster:
        """DGX H100: 8 × H100-80GB, NVLink 4 via NVSwitch (900 GB/s bidirectional = 450 GB/s per GPU),
        8 × 400 Gb/s NDR InfiniBand (50 GB/s per GPU); NVIDIA DGX H100 datasheet (2022)."""
        return cls("DGX H100", PRESETS["H100-80GB"], nodes, 8, (450e9, 5e-6), 8 * 50e9, 5e-6,
                   "NVIDIA DGX H100 datasheet (2022)")

    @classmethod
    def of(cls, gpu: str, gpus: int, engine: str | None = None) -> Cluster:
        """``gpus`` GPUs of a kind :data:`~autosplit.gpu_presets.SYSTEMS` names (``"H100"``, ``"H100-500W"``,
        ``"H200"``, ``"H800"``, ``"B200"``, ``"B300"``, ``"GB200"``, ``"GB300"``) as their system came: NVLink
        inside a domain (:func:`~autosplit.gpu_presets.domain_size`), each GPU's own NIC between domains;
        ``engine``: its kernels those of a fitted engine profile (:mod:`autosplit.engine_profiles`)."""
        system, per_node = domain_size(gpu, gpus)
        device = GPU_PRESETS[system.preset] if engine is None else profiled(GPU_PRESETS[system.preset], engine)
        return cls(f"{system.name} × {gpus}", device, gpus // per_node, per_node, (device.link_bandwidth, device.link_latency),
                   per_node * system.nic, 5e-6, system.source)


@dataclass(frozen=True)
class HybridRow:
    """One configuration: replica size k, worker batch, and what they give."""

    k: int
    replicas: int
    worker_batch: int
    global_batch: int
    micro_batches: int
    step: float
    """Seconds per step: the worker's plan + the exposed all-reduce."""
    allreduce: float
    """The exposed (not hidden behind backward) all-reduce, seconds."""
    samples_per_s: float
    examples_factor: float
    """E(B) / E_min: examples to the target relative to a tiny batch."""
    time_to_target: float
    """Seconds to the target (× E_min when ``min_examples`` is not given)."""
    memory: int
    """The fullest device's predicted bytes."""
    capacity: int
    plan: Plan | None = None
    error: str | None = None

    @property
    def feasible(self) -> bool:
        return self.plan is not None


@dataclass(frozen=True)
class ScalingPoint:
    """The best data-parallel-only and the best hybrid configuration on ``devices`` devices."""

    devices: int
    data_parallel: HybridRow | None
    hybrid: HybridRow | None

    @property
    def gain(self) -> float | None:
        """Time to target of the best DP-only configuration over the best hybrid's, minus 1."""
        if self.data_parallel is None or self.hybrid is None:
            return None
        return self.data_parallel.time_to_target / self.hybrid.time_to_target - 1


@dataclass(frozen=True)
class HybridPlan:
    """Every configuration tried, the choice, and its gain over the best DP-only one."""

    cluster: Cluster
    rows: tuple[HybridRow, ...]
    noise_scale: float | None
    efficiency_table: Mapping[float, float] | None
    min_examples: float | None
    scaling: tuple[ScalingPoint, ...]
    """From one node's devices up to the cluster's, doubling: the best DP-only and hybrid
    configuration from the same worker plans (what changes is the all-reduce and the global batch)."""

    @property
    def crossover(self) -> int | None:
        """The fewest devices (of this cluster type) at which a hybrid beats data parallelism alone."""
        for point in self.scaling:
            if point.hybrid and (point.data_parallel is None or point.hybrid.time_to_target < point.data_parallel.time_to_target):
                return point.devices
        return None

    def with_statistics(
        self, *, noise_scale: float | None = None, efficiency_table: Mapping[float, float] | None = None,
        min_examples: float | None = None,
    ) -> HybridPlan:
        """The same worker plans under another statistical efficiency (nothing is re-planned)."""
        plans = {(r.k, r.worker_batch): (r.plan, r.error) for r in self.rows}
        return assemble(self.cluster, plans, noise_scale, efficiency_table, min_examples)

    @property
    def choice(self) -> HybridRow:
        return min((r for r in self.rows if r.feasible), key=lambda r: r.time_to_target)

    @property
    def best_data_parallel(self) -> HybridRow | None:
        rows = [r for r in self.rows if r.feasible and r.k == 1]
        return min(rows, key=lambda r: r.time_to_target) if rows else None

    @property
    def gain(self) -> float | None:
        """Time to target of the best DP-only configuration over the choice's, minus 1."""
        dp = self.best_data_parallel
        return None if dp is None else dp.time_to_target / self.choice.time_to_target - 1

    def report(self, width: int = 220) -> str:
        from rich.console import Console
        from rich.table import Table

        unit = "s" if self.min_examples else "s × E_min"
        table = Table(title=f"hybrid plans on {self.cluster.size} × {self.cluster.device.name} ({self.cluster.name}, "
                            f"{self.cluster.nodes} node{'s' * (self.cluster.nodes > 1)})")
        for col in ("k", "replicas", "worker batch", "global batch", "M", "step", "exposed all-reduce", "samples/s",
                    "E(B)/E_min", f"time to target ({unit})", "memory / cap", ""):
            table.add_column(col, justify="right", no_wrap=True)
        choice = self.choice
        for r in self.rows:
            if not r.feasible:
                table.add_row(str(r.k), str(r.replicas), str(r.worker_batch), str(r.global_batch), "", "", "", "", "", "",
                              "", f"no: {first_sentence(r.error or '')}")
                continue
            table.add_row(
                str(r.k), str(r.replicas), str(r.worker_batch), str(r.global_batch), str(r.micro_batches),
                f"{r.step * 1e3:.2f} ms", f"{r.allreduce * 1e3:.2f} ms", f"{r.samples_per_s:,.0f}", f"{r.examples_factor:.3f}",
                f"{r.time_to_target:.4g}", f"{format_bytes(r.memory)} / {format_bytes(r.capacity)}",
                "◀ choice" if r is choice else "",
            )
        out = io.StringIO()
        console = Console(file=out, width=width, force_terminal=False, color_system=None)
        console.print(table)
        gain = self.gain
        console.print(
            f"choice: k = {choice.k} ({choice.replicas} workers × {choice.k} devices, global batch {choice.global_batch}); "
            + (f"{gain:+.1%} time to target against the best DP-only configuration" if gain is not None
               else "data parallelism alone does not fit")
            + (f"; hybrid first wins at {self.crossover} devices" if self.crossover else "; DP-only wins at every size tried")
            + (f"; noise scale {self.noise_scale:g}" if self.noise_scale else "")
        )
        if len(self.scaling) > 1:
            console.print(self.scaling_report())
        return out.getvalue().rstrip()

    def scaling_report(self) -> str:
        """One line per cluster size: the best DP-only and the best hybrid, and the gain."""
        unit = "s" if self.min_examples else "s × E_min"
        lines = [f"{'devices':>8s} {'best DP-only (' + unit + ')':>26s} {'best hybrid (' + unit + ')':>26s} "
                 f"{'k':>3s} {'global batch':>12s} {'gain':>8s}"]
        for p in self.scaling:
            dp = f"{p.data_parallel.time_to_target:.4g}" if p.data_parallel else "does not fit"
            hy = f"{p.hybrid.time_to_target:.4g}" if p.hybrid else "-"
            lines.append(f"{p.devices:>8d} {dp:>26s} {hy:>26s} {p.hybrid.k if p.hybrid else '-':>3} "
                         f"{p.hybrid.global_batch if p.hybrid else '-':>12} {'' if p.gain is None else f'{p.gain:+.1%}':>8s}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()

    def to_dict(self) -> dict:
        def summary(r: HybridRow | None) -> dict:
            return {} if r is None else {key: getattr(r, key) for key in (
                "k", "replicas", "worker_batch", "global_batch", "step", "allreduce", "examples_factor", "time_to_target")}

        return {
            "cluster": {**dataclasses.asdict(self.cluster), "device": self.cluster.device.to_dict()},
            "noise_scale": self.noise_scale, "min_examples": self.min_examples, "crossover": self.crossover,
            "gain": self.gain, "choice": self.choice.k,
            "rows": [{**summary(r), "micro_batches": r.micro_batches, "samples_per_s": r.samples_per_s, "memory": r.memory,
                      "capacity": r.capacity, "error": r.error, "plan": r.plan.to_dict() if r.plan else None}
                     for r in self.rows],
            "scaling": [{"devices": p.devices, "gain": p.gain, "data_parallel": summary(p.data_parallel),
                         "hybrid": summary(p.hybrid)} for p in self.scaling],
        }


def first_sentence(text: str) -> str:
    """``text`` up to its first sentence end (a period followed by a space, so 24.23 GiB stays whole)."""
    return text.split(". ", 1)[0]


def is_count(value: object) -> bool:
    """An integer ≥ 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def default_micro_batches(batch: int, k: int) -> int:
    """The default 4·k micro-batches (1 for one device), or the largest count ≤ it that divides the batch."""
    want = 1 if k == 1 else 4 * k
    return max(m for m in range(1, min(want, batch) + 1) if batch % m == 0)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def sync_windows(plan: Plan) -> list[float]:
    """[stage] seconds of the step its gradient sync runs hidden in, from when the stage's
    reductions start (DDP's buckets, as its last backward produces them) to the end of the step: a
    stage done with its backward keeps syncing while the others compute. On one device: its backward.

    - A makespan worker's device (:attr:`Plan.tasks`): from its first backward task to the end of
      the step, less its optimizer step, which waits for the sync.
    - A pipeline with one stage per rank in a line, flushed and with whole backwards (GPipe, 1F1B):
      stage s's last micro-batch's backward, then those of the stages before it, one after the
      other down the line (the transfers between them left out).
    - Any other schedule: the stage's last micro-batch's backward alone."""
    if plan.objective != "makespan":
        own = [st.backward / plan.micro_batches for st in plan.stages]
        entry = schedules.lookup(plan.schedule)
        down_the_line = entry.flushes and entry.placement == "linear" and not entry.split_backward and entry.order != "torch"
        return list(itertools.accumulate(own)) if down_the_line and plan.stages_per_rank == 1 else own
    first: dict[int, float] = {}
    for t in plan.tasks:
        if t.kind == "backward":
            first[t.device] = min(first.get(t.device, math.inf), t.start)
    return [max(0.0, plan.step_time - first.get(d, plan.step_time) - (st.compute - st.forward - st.backward))
            for d, st in zip(plan.stage_devices, plan.stages)]


def _rows(
    cluster: Cluster, plans: Mapping[tuple[int, int], tuple[Plan | None, str | None]], n: int,
    noise_scale: float | None, efficiency_table: Mapping[float, float] | None, min_examples: float | None,
) -> list[HybridRow]:
    """Every (k, worker batch) configuration on ``n`` devices of ``cluster``'s kind, from its worker plan."""
    rows = []
    for (k, b), (plan, error) in plans.items():
        if n % k:
            continue
        R = n // k
        B = R * b
        factor = examples_factor(B, noise_scale, efficiency_table)
        if plan is None:
            rows.append(HybridRow(k, R, b, B, 0, math.inf, 0.0, 0.0, factor, math.inf, 0, cluster.device.memory, None, error))
            continue
        syncs = cluster.gradient_syncs(plan.stages, k, R)
        exposed = max((max(0.0, sync - hidden) for sync, hidden in zip(syncs, sync_windows(plan))), default=0.0)
        step = plan.step_time + exposed
        rows.append(HybridRow(
            k, R, b, B, plan.micro_batches, step, exposed, B / step, factor,
            time_to_target(step, B, factor, min_examples or 1.0), max(st.memory for st in plan.stages),
            min(st.capacity for st in plan.stages), plan,
        ))
    return sorted(rows, key=lambda r: (r.k, r.worker_batch))


def assemble(
    cluster: Cluster, plans: Mapping[tuple[int, int], tuple[Plan | None, str | None]], noise_scale: float | None,
    efficiency_table: Mapping[float, float] | None, min_examples: float | None,
) -> HybridPlan:
    """The rows on the whole cluster, the scaling from one node up, from the worker plans."""
    N = cluster.size
    rows = _rows(cluster, plans, N, noise_scale, efficiency_table, min_examples)
    if not any(r.feasible for r in rows):
        why = "; ".join(f"k = {r.k}, worker batch {r.worker_batch}: {first_sentence(r.error or '')}" for r in rows)
        if any((r.error or "").startswith(InfeasiblePlanError.__name__) for r in rows):
            what = f" that fits {cluster.device.name}"
            fix = "try larger replica sizes, a smaller batch, schedule='1f1b', or devices with more memory"
        else:
            what, fix = ", for reasons other than memory", "fix the causes named; autosplit.plan(model, devices, ...) shows each in full"
        raise InfeasiblePlanError(advice(f"no replica size in {sorted({k for k, _ in plans})} gives a worker plan{what}", why, fix))

    def best(candidates: list[HybridRow]) -> HybridRow | None:
        return min(candidates, key=lambda r: r.time_to_target) if candidates else None

    scaling = []
    for n in sorted({d for d in (1, 2, 4, 8) if d < cluster.per_node} | {cluster.per_node * 2**j for j in range(20)
                                                                           if cluster.per_node * 2**j <= N} | {N}):
        feasible = [r for r in _rows(cluster, plans, n, noise_scale, efficiency_table, min_examples) if r.feasible]
        scaling.append(ScalingPoint(n, best([r for r in feasible if r.k == 1]), best([r for r in feasible if r.k > 1])))
    return HybridPlan(cluster, tuple(rows), noise_scale, efficiency_table, min_examples, tuple(scaling))
