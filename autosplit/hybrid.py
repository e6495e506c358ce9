"""The hybrid planner: how many devices form each data-parallel worker, for time to accuracy.

Pal et al. 2019 (each data-parallel worker is a group of devices; hybrid beats the best
DP-only setup end to end because a large global batch costs statistical efficiency) and
Joo & Youn's GHP (choose the grouping from a model of both). For every replica size k that
divides the cluster's N devices (k = 1 is data parallelism alone) and every worker batch
tried, one worker's split over k devices is planned by the pipeline planner; each stage's
gradient all-reduce over the N/k copies of that stage is added (ring inside a node,
hierarchical across nodes; the part that overlaps the backward of the stage's last
micro-batch is hidden — DDP's bucketed overlap, for k = 1 the whole backward); and the time
to the target follows from the statistical efficiency of the global batch
(:mod:`autosplit.solver.hybrid`).

Usage::

    cluster = autosplit.Cluster.dgx1(nodes=16)                       # 128 V100s
    hp = autosplit.plan_hybrid(model, cluster, example_inputs=(x,), per_device_batch=64, noise_scale=4000)
    print(hp)                # a row per replica size: step, exposed all-reduce, samples/s, E(B)/E_min, time to target
    hp.choice.plan           # the chosen worker's split
    b = autosplit.measure_noise_scale(model, batches, loss_fn, small_batch=8).noise_scale
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autosplit.devices import PRESETS, DeviceSpec
from autosplit.errors import AutosplitError, ConstraintError, InfeasiblePlanError, advice
from autosplit.plan import Plan
from autosplit.solver.hybrid import examples_factor, hierarchical_allreduce, ring_allreduce, time_to_target
from autosplit.units import format_bytes

__all__ = ["Cluster", "HybridPlan", "HybridRow", "NoiseScale", "ScalingPoint", "measure_noise_scale", "plan_hybrid"]

log = logging.getLogger(__name__)


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

    def __post_init__(self) -> None:
        def refuse(field: str, value: object, rule: str, fix: str) -> ConstraintError:
            return ConstraintError(advice(
                f"Cluster {self.name!r}: {field}={value!r} {rule}",
                "a cluster is nodes × per_node identical devices, linked by intra = (bandwidth, latency) inside a node "
                "and by the network between nodes", fix,
            ))

        if not isinstance(self.device, DeviceSpec):
            raise refuse("device", self.device, "is not a DeviceSpec", "pass autosplit.PRESETS['V100-16GB'] or a DeviceSpec")
        for field in ("nodes", "per_node"):
            if not _count(getattr(self, field)):
                raise refuse(field, getattr(self, field), "is not an integer ≥ 1", f"pass {field}=1 or more")
        if not (isinstance(self.intra, (tuple, list)) and len(self.intra) == 2):
            raise refuse("intra", self.intra, "is not a (bandwidth, latency) pair", "pass intra=(150e9, 5e-6) (bytes/s, seconds)")
        object.__setattr__(self, "intra", tuple(self.intra))
        for field, value in (("intra[0] (bandwidth)", self.intra[0]), ("inter_bandwidth", self.inter_bandwidth)):
            if not (_real(value) and value > 0):
                raise refuse(field, value, "is not a positive number of bytes/s", "pass the link's bandwidth, e.g. 25e9")
        for field, value in (("intra[1] (latency)", self.intra[1]), ("inter_latency", self.inter_latency)):
            if not (_real(value) and 0 <= value < math.inf):
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
                                island=f"node{d // self.per_node}", network_bandwidth=share, network_latency=self.inter_latency)
            for d in range(k)
        ]

    def allreduce(self, nbytes: float, k: int, replicas: int) -> float:
        """Seconds to all-reduce one stage's gradients (``nbytes``) over its ``replicas`` copies,
        worker r's copy on device ``r·k + s``. Every device of a node all-reduces at once (each
        stage its own gradients), so a device gets 1/per_node of the node's network."""
        share = (self.inter_bandwidth / self.per_node, self.inter_latency)
        if replicas <= 1:
            return 0.0
        if k <= self.per_node and self.per_node % k == 0:
            local = min(replicas, self.per_node // k)
            return hierarchical_allreduce(nbytes, local=local, nodes=math.ceil(replicas / local), intra=self.intra, inter=share)
        return ring_allreduce(nbytes, replicas, *share)  # each copy on its own node

    # Presets. Figures: NVIDIA's system architecture white papers; one direction per device.
    @classmethod
    def dgx1(cls, nodes: int = 1, gpu_memory_gb: int = 16) -> Cluster:
        """DGX-1 with V100: 8 × V100-SXM2 (16 GB; 32 GB from 2018), NVLink 2.0 hybrid cube-mesh
        (6 links × 25 GB/s = 150 GB/s per GPU), 4 × 100 Gb/s EDR InfiniBand per node (50 GB/s);
        NVIDIA WP-08437-002 (2017)."""
        if gpu_memory_gb not in (16, 32):
            raise ConstraintError(advice(f"gpu_memory_gb={gpu_memory_gb}", "a DGX-1's V100s have 16 or 32 GB", "pass 16 or 32"))
        return cls(f"DGX-1 (V100-{gpu_memory_gb}GB)", PRESETS[f"V100-{gpu_memory_gb}GB"], nodes, 8, (150e9, 5e-6),
                   4 * 12.5e9, 5e-6, "NVIDIA DGX-1 with Tesla V100 System Architecture, WP-08437-002 (2017)")

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
        return _assemble(self.cluster, plans, noise_scale, efficiency_table, min_examples)

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
                              "", f"no: {_first_sentence(r.error or '')}")
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


def _first_sentence(text: str) -> str:
    """``text`` up to its first sentence end (a period followed by a space, so 24.23 GiB stays whole)."""
    return text.split(". ", 1)[0]


def _count(value: object) -> bool:
    """An integer ≥ 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (through tuples, lists and mappings)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, Mapping):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _at_batch(value: Any, batch: int, dim: int) -> Any:
    """``value`` with its tensors' batch dimension set to ``batch`` (rows repeated or cut: planning reads shapes)."""
    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() <= dim:
            return t
        return torch.cat([t] * math.ceil(batch / t.shape[dim]), dim=dim).narrow(dim, 0, batch).contiguous()

    return _map_tensors(value, resize)


def _micro_batches(batch: int, k: int) -> int:
    """The default 4·k micro-batches (1 for one device), or the largest count ≤ it that divides the batch."""
    want = 1 if k == 1 else 4 * k
    return max(m for m in range(1, min(want, batch) + 1) if batch % m == 0)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


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
        exposed = max(
            (max(0.0, cluster.allreduce(st.param_bytes, k, R) - st.backward / plan.micro_batches) for st in plan.stages),
            default=0.0,
        )
        step = plan.step_time + exposed
        rows.append(HybridRow(
            k, R, b, B, plan.micro_batches, step, exposed, B / step, factor,
            time_to_target(step, B, factor, min_examples or 1.0), max(st.memory for st in plan.stages),
            min(st.capacity for st in plan.stages), plan,
        ))
    return sorted(rows, key=lambda r: (r.k, r.worker_batch))


def _assemble(
    cluster: Cluster, plans: Mapping[tuple[int, int], tuple[Plan | None, str | None]], noise_scale: float | None,
    efficiency_table: Mapping[float, float] | None, min_examples: float | None,
) -> HybridPlan:
    """The rows on the whole cluster, the scaling from one node up, from the worker plans."""
    N = cluster.size
    rows = _rows(cluster, plans, N, noise_scale, efficiency_table, min_examples)
    if not any(r.feasible for r in rows):
        why = "; ".join(f"k = {r.k}, worker batch {r.worker_batch}: {_first_sentence(r.error or '')}" for r in rows)
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


def plan_hybrid(
    model: torch.nn.Module,
    cluster: Cluster,
    *,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None = None,
    per_device_batch: int | Sequence[int] | None = None,
    global_batch: int | None = None,
    noise_scale: float | None = None,
    efficiency_table: Mapping[float, float] | None = None,
    min_examples: float | None = None,
    objective: str = "pipeline",
    replica_sizes: Sequence[int] | None = None,
    batch_dim: int = 0,
    **options: Any,
) -> HybridPlan:
    """Choose the replica size k (and worker batch) that reaches the target soonest on ``cluster``.

    ``per_device_batch=b``: a worker processes b examples per step — the per-GPU batch of the
    data-parallel setup, kept per worker, so a hybrid's global batch is ``N/k · b`` — or ``k·b``
    (the same global batch as data parallelism); both are tried. A sequence of per-device
    batches tries each (data parallelism alone may then shrink its batch as well). ``global_batch=B`` fixes
    ``B`` for every k instead (worker batch ``B·k/N``). ``noise_scale`` (``B_noise``; see
    :func:`measure_noise_scale`) or ``efficiency_table`` (``{global batch: examples or epochs
    to target}``) gives the statistical efficiency; neither: none is lost. ``min_examples``
    (E_min) turns time to target into seconds. ``replica_sizes``: the k to try (default every
    divisor of N up to 64). ``objective``: the worker planner's (``"pipeline"``, or ``"makespan"``:
    each worker one micro-batch, its parallel branches on different devices). ``options``:
    any :class:`~autosplit.PlanOptions` field for the worker plans.
    """
    from autosplit.options import PlanOptions
    from autosplit.planner import Planner

    PlanOptions().replace(objective=objective, **options)  # a bad option fails here, not once per worker plan
    if (per_device_batch is None) == (global_batch is None):
        raise ConstraintError(advice(
            "plan_hybrid needs exactly one of per_device_batch and global_batch",
            "the batch decides the statistical efficiency and the worker's work", "pass per_device_batch=64 (for example)",
        ))
    name, given = ("per_device_batch", per_device_batch) if global_batch is None else ("global_batch", global_batch)
    per_device: list[int] = []
    if isinstance(per_device_batch, Sequence):
        per_device = list(per_device_batch)
    elif per_device_batch is not None:
        per_device = [per_device_batch]
    values: list[object] = [global_batch] if per_device_batch is None else [*per_device]
    if not values or not all(_count(b) for b in values):
        raise ConstraintError(advice(
            f"{name}={given!r} is not a whole number of examples ≥ 1" + (" (or a list of them)" if global_batch is None else ""),
            "a worker plans for a batch of that many examples", f"pass {name}=64 (for example)",
        ))
    examples_factor(1.0, noise_scale, efficiency_table)  # a bad noise scale or table fails here, not after every plan
    if min_examples is not None and not (_real(min_examples) and 0 < min_examples < math.inf):
        raise ConstraintError(advice(
            f"min_examples={min_examples!r} is not a positive number of examples", "E_min turns time to target into seconds",
            "pass the examples to the target at a tiny batch, or leave it out for seconds × E_min",
        ))
    N = cluster.size
    sizes = sorted(set(replica_sizes or [k for k in _divisors(N) if k <= 64]))
    bad = [k for k in sizes if not _count(k) or N % k]
    if bad:
        raise ConstraintError(advice(
            f"replica sizes {bad} do not divide the cluster's {N} devices", "every worker has the same k devices",
            f"choose from {_divisors(N)}",
        ))
    if global_batch is not None and all(global_batch % (N // k) for k in sizes):
        raise ConstraintError(advice(
            f"global_batch={global_batch} splits evenly over none of the worker counts {[N // k for k in sizes]} "
            f"(replica sizes {sizes} on {N} devices)", "every worker gets the same share of the global batch",
            f"pass a multiple of {N}, e.g. global_batch={N * max(1, round(global_batch / N))}",
        ))
    kwargs = dict(example_kwargs or {})
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    state = [*model.parameters(), *model.buffers()]
    if state and all(t.is_meta for t in state):  # a model made under torch.device("meta"): plan it on meta inputs too
        inputs, kwargs = _map_tensors(inputs, lambda t: t.to("meta")), _map_tensors(kwargs, lambda t: t.to("meta"))
    planners: dict[int, Planner] = {}

    def worker_plan(k: int, batch: int) -> Plan:
        if batch not in planners:  # one capture per worker batch, reused for every k
            planners[batch] = Planner(model, cluster.replica_devices(1), example_inputs=_at_batch(inputs, batch, batch_dim),
                                      example_kwargs=_at_batch(kwargs, batch, batch_dim), objective=objective, **options)
        planner = planners[batch]
        return planner.what_if(devices=cluster.replica_devices(k), micro_batches=_micro_batches(batch, k))

    plans: dict[tuple[int, int], tuple[Plan | None, str | None]] = {}
    failures: list[AutosplitError] = []
    for k in sizes:
        R = N // k
        if per_device:
            batches = sorted({b for p in per_device for b in (p, k * p)})
        elif global_batch is not None and global_batch % R == 0:
            batches = [global_batch // R]
        else:
            continue
        for b in batches:
            try:
                plans[(k, b)] = (worker_plan(k, b), None)
            except AutosplitError as e:
                log.info("k = %d, worker batch %d: %s", k, b, e)
                plans[(k, b)] = (None, f"{type(e).__name__}: {e}")
                failures.append(e)

    causes = {f"{type(e).__name__}: {_first_sentence(str(e))}" for e in failures}
    if len(failures) == len(plans) and len(causes) == 1 and not isinstance(failures[0], InfeasiblePlanError):
        first = failures[0]  # not a matter of memory or replica size: the cause itself leads
        first.add_note(f"(every one of the {len(plans)} worker plans tried, replica sizes {sizes}, failed this way)")
        raise first
    return _assemble(cluster, plans, noise_scale, efficiency_table, min_examples)


@dataclass(frozen=True)
class NoiseScale:
    """The simple noise scale ``B_simple = tr Σ / |G|²`` and what it was estimated from."""

    noise_scale: float
    trace: float
    """tr Σ: the per-example gradient covariance's trace."""
    grad_sq: float
    """|G|²: the true gradient's squared norm."""
    small_batch: int
    big_batch: int
    batches: int


def measure_noise_scale(
    model: torch.nn.Module,
    batches: Iterable[tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    small_batch: int,
    batch_dim: int = 0,
) -> NoiseScale:
    """McCandlish et al.'s two-batch estimator of the simple noise scale (their appendix A.1).

    Each ``(inputs, target)`` in ``batches`` is a big batch of ``B_big`` examples; its gradient
    gives ``|G_big|²``, and its chunks of ``small_batch`` examples give ``|G_small|²`` (their mean).
    Then ``|G|² ≈ (B_big|G_big|² − B_small|G_small|²)/(B_big − B_small)`` and ``tr Σ ≈
    (|G_small|² − |G_big|²)/(1/B_small − 1/B_big)``; the numerator and the denominator are
    averaged over the batches separately before dividing (unbiased each; their ratio is not).
    ``loss_fn(output, target)`` must average over the examples. The estimator assumes the
    examples' gradients independent; BatchNorm in training mode couples a batch's examples
    (a chunk of 8 normalises by its own statistics), so batch-norm layers are measured with
    their running statistics (eval mode) and put back as they were. The model's gradients
    are left zeroed; its weights and buffers are not changed.
    """
    if not _count(small_batch):
        raise ConstraintError(advice(
            f"small_batch={small_batch!r} is not an integer ≥ 1",
            "the estimator splits each big batch into chunks of small_batch examples",
            "pass small_batch=8 (for example), with big batches a multiple (≥ 2×) of it",
        ))
    params = [p for p in model.parameters() if p.requires_grad]
    coupled = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    for m in coupled:
        m.eval()
    try:
        return _two_batch_estimate(model, params, batches, loss_fn, small_batch, batch_dim)
    finally:
        for m in coupled:
            m.train()


def _two_batch_estimate(
    model: torch.nn.Module, params: list[torch.nn.Parameter], batches: Iterable[tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor], small_batch: int, batch_dim: int,
) -> NoiseScale:
    def grad_sq(inputs: Any, target: Any) -> float:
        for p in params:
            p.grad = None
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        loss_fn(model(*args), target).backward()
        return float(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))

    traces, grads, big, count = [], [], 0, 0
    for inputs, target in batches:
        big = int(target.shape[batch_dim])
        if big % small_batch or big <= small_batch:
            raise ConstraintError(advice(
                f"a batch of {big} examples does not split into more than one chunk of small_batch={small_batch}",
                "the estimator compares the gradient of the whole batch with those of its chunks",
                "pass big batches that are a multiple (≥ 2×) of small_batch",
            ))
        g_big = grad_sq(inputs, target)
        chunks = [
            grad_sq(_slice(inputs, i, small_batch, batch_dim), target.narrow(batch_dim, i, small_batch))
            for i in range(0, big, small_batch)
        ]
        g_small = sum(chunks) / len(chunks)
        grads.append((big * g_big - small_batch * g_small) / (big - small_batch))
        traces.append((g_small - g_big) / (1 / small_batch - 1 / big))
        count += 1
    for p in params:
        p.grad = None
    if not count:
        raise ConstraintError(advice("measure_noise_scale got no batches", "batches was empty", "pass at least one (inputs, target)"))
    trace, g2 = sum(traces) / count, sum(grads) / count
    if g2 <= 0:
        log.warning("the true gradient's squared norm estimates %.3g ≤ 0 over %d batches of %d: its signal is below the "
                    "estimator's noise, so the noise scale is reported as infinite; pass more or bigger batches", g2, count, big)
    return NoiseScale(trace / g2 if g2 > 0 else math.inf, trace, g2, small_batch, big, count)


def _slice(value: Any, start: int, length: int, dim: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value.narrow(dim, start, length)
    if isinstance(value, tuple):
        return tuple(_slice(v, start, length, dim) for v in value)
    return value
