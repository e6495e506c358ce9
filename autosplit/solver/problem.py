"""The solver's input: a plain-data :class:`Problem` (no torch, no fx), and its evaluator.

Units, fixed here and nowhere else: time in integer **nanoseconds**, memory in integer
**KiB** (rounded up, so a plan that fits in KiB fits in bytes).

The pipeline cost model (DESIGN §4.3). Stage ``s`` runs on device ``s``. With ``M``
micro-batches, each stage spends ``t_s / M`` per micro-batch, where ``t_s`` is the
stage's forward + backward compute for the whole batch plus the transfers at its two
boundaries (each boundary is charged to the sender and the receiver: both are busy). A
tensor crossing several boundaries is relayed stage to stage, as pipeline runtimes do.
The step takes

    step = (Σ_s t_s + (M − 1) · max_s t_s) / M

and :attr:`Problem` objectives are the numerator, an integer. Memory of stage ``s``:
model state + saved activations × in-flight(s) / M + tensors received × in-flight(s) / M
+ outputs it sends × in-flight(s) / M (a sender keeps them until their gradient returns)
+ a transient reserve (the most any one op needs above what is live on one micro-batch —
its output, analytically — or an optimizer step's temporaries), with in-flight
micro-batches from the schedule (DESIGN §4.2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autosplit.errors import ConstraintError, advice

__all__ = ["Problem", "Evaluation", "UserConstraint", "SCHEDULES", "in_flight", "evaluate", "build_problem", "tied_costs"]

NS = 1e9  # time unit: nanoseconds per second
KIB = 1024  # memory unit: bytes per KiB

SCHEDULES = ("sequential", "gpipe", "1f1b")


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at its peak (GPipe: all; 1F1B: S − s)."""
    if schedule == "sequential":
        return 1
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, stages - stage)
    raise ConstraintError(advice(
        f"unknown schedule {schedule!r}", "the pipeline model knows only these schedules", f"choose one of {SCHEDULES}"
    ))


@dataclass(frozen=True)
class UserConstraint:
    """One constraint the user asked for, in stage terms, with the words to explain it."""

    text: str
    """How the user said it, e.g. ``pin 'blocks.0' to device 2 (cuda:2)``."""
    forbid: tuple[tuple[int, int], ...] = ()
    """(node, stage) pairs the plan may not use."""
    together: tuple[int, ...] = ()
    """Nodes that must share one stage."""


@dataclass(frozen=True)
class Problem:
    """Assign ``nodes`` (topologically ordered) to ``len(devices)`` ordered stages."""

    nodes: tuple[str, ...]
    labels: tuple[str, ...]
    """Module path of each node, for messages."""
    devices: tuple[str, ...]
    """Device label of each stage, for messages."""
    compute: tuple[tuple[int, ...], ...]
    """[node][stage] forward + backward ns for the whole batch on that stage's device."""
    edges: tuple[tuple[int, int], ...]
    """Data edges u → v: v needs u's output; stage(u) ≤ stage(v)."""
    order_edges: tuple[tuple[int, int], ...]
    """Precedence without data: stage(u) ≤ stage(v), nothing transferred."""
    transfer: tuple[tuple[int, ...], ...]
    """[node][k − 1] ns to move the node's output over boundary k (stage k−1 → k) and its gradient back."""
    boundary_latency: tuple[int, ...]
    """[k − 1] fixed ns of boundary k (latency, both directions)."""
    state_mem: tuple[int, ...]
    """[node] KiB of parameters, gradients, optimizer state and buffers."""
    act_mem: tuple[tuple[int, ...], ...]
    """[node][stage] KiB of saved activations held at the stage's peak."""
    recv_mem: tuple[tuple[int, ...], ...]
    """[node][stage] KiB held when the node's output is received by the stage."""
    capacity: tuple[int, ...]
    """[stage] KiB available."""
    colocate: tuple[tuple[int, ...], ...]
    micro_batches: int = 1
    transient_mem: int = 0
    """KiB every stage keeps free for the largest tensor one op produces."""
    constraints: tuple[UserConstraint, ...] = ()
    send_mem: tuple[tuple[int, ...], ...] = ()
    """[node][stage] KiB the stage holds of a node output it sends on (the root of the
    backward that the returning gradient runs); empty: nothing is held."""

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    def consumers(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for u, v in self.edges:
            out[u].append(v)
        return out


@dataclass(frozen=True)
class Evaluation:
    """Predicted per-stage figures of one assignment (problem units: ns, KiB)."""

    compute: tuple[int, ...]
    transfer: tuple[int, ...]
    time: tuple[int, ...]
    state_mem: tuple[int, ...]
    act_mem: tuple[int, ...]
    recv_mem: tuple[int, ...]
    transient_mem: int
    objective: int
    send_mem: tuple[int, ...] = ()

    @property
    def memory(self) -> tuple[int, ...]:
        send = self.send_mem or (0,) * len(self.state_mem)
        return tuple(
            a + b + c + d + self.transient_mem for a, b, c, d in zip(self.state_mem, self.act_mem, self.recv_mem, send)
        )

    @property
    def bottleneck(self) -> int:
        return max(range(len(self.time)), key=lambda s: self.time[s])


def crossings(problem: Problem, stage_of: Sequence[int]) -> list[list[int]]:
    """For each boundary k (index k − 1): nodes whose output crosses it (relayed stage to stage)."""
    out: list[list[int]] = [[] for _ in range(problem.num_stages - 1)]
    for u, consumers in enumerate(problem.consumers()):
        last = max((stage_of[v] for v in consumers), default=stage_of[u])
        for k in range(stage_of[u] + 1, last + 1):
            out[k - 1].append(u)
    return out


def evaluate(problem: Problem, stage_of: Sequence[int]) -> Evaluation:
    """Stage times, memory and objective of ``stage_of`` (node index → stage), by the model above."""
    S = problem.num_stages
    compute, state, act, recv, send = [0] * S, [0] * S, [0] * S, [0] * S, [0] * S
    for n, s in enumerate(stage_of):
        compute[s] += problem.compute[n][s]
        state[s] += problem.state_mem[n]
        act[s] += problem.act_mem[n][s]
    boundary = [0] * (S - 1)
    for k, nodes in enumerate(crossings(problem, stage_of), start=1):
        boundary[k - 1] = problem.boundary_latency[k - 1] + sum(problem.transfer[u][k - 1] for u in nodes)
        recv[k] += sum(problem.recv_mem[u][k] for u in nodes)
        if problem.send_mem:
            send[k - 1] += sum(problem.send_mem[u][k - 1] for u in nodes)
    transfer = [(boundary[s - 1] if s > 0 else 0) + (boundary[s] if s < S - 1 else 0) for s in range(S)]
    time = [c + t for c, t in zip(compute, transfer)]
    objective = sum(time) + (problem.micro_batches - 1) * max(time)
    return Evaluation(
        tuple(compute), tuple(transfer), tuple(time), tuple(state), tuple(act), tuple(recv), problem.transient_mem,
        objective, tuple(send),
    )


def tied_costs(nbytes: float, bandwidth: float, latency: float, micro_batches: int) -> tuple[float, float]:
    """Seconds per step to share a parameter of ``nbytes`` between two stages across one link:
    (send it with every micro-batch and its gradient back, replicate it and all-reduce its gradient once)."""
    send = 2 * micro_batches * (latency + nbytes / bandwidth)
    replicate = nbytes / bandwidth + 2 * latency
    return send, replicate


def build_problem(
    table,
    *,
    micro_batches: int = 1,
    schedule: str = "gpipe",
    order: Sequence[int] | None = None,
    constraints: Sequence[UserConstraint] = (),
) -> Problem:
    """Scale a cost table (``passes.costs.CostTable``) into integer units for one device order.

    Stage ``s`` runs on device ``order[s]`` (identity by default). ``constraints`` name
    *devices* in their ``forbid`` pairs; they are turned into stages here.
    """
    order = tuple(range(len(table.devices))) if order is None else tuple(order)
    devices = [table.devices[d] for d in order]
    stage_of_device = {d: s for s, d in enumerate(order)}
    S = len(devices)
    M = micro_batches
    inflight = [in_flight(schedule, s, S, M) for s in range(S)]

    def kib(nbytes: float) -> int:
        return math.ceil(nbytes / KIB)

    # The optimizer steps each stage's parameters once per step, after its last backward; charged
    # with the stage's compute, the schedule formula counts it about once (for S ≪ M), and the
    # solver balances it with the rest.
    opt = table.optimizer_time or tuple((0.0,) * len(table.devices) for _ in table.nodes)
    compute = tuple(
        tuple(round((fwd[d] + bwd[d] + o[d]) * NS) for d in order) for fwd, bwd, o in zip(table.fwd_time, table.bwd_time, opt)
    )
    # Boundary k joins stages k−1 and k. Each micro-batch sends every crossing tensor forward and
    # its gradient back: 2·(M·latency + bytes/bandwidth) for a tensor of the whole batch's bytes,
    # the latency once per tensor of the value (none for a Python value: it crosses as a constant).
    # A parameter read on a later stage (a tied weight) has the same bytes in every micro-batch:
    # sent, it costs 2·M·(latency + bytes/bandwidth); replicated, one all-reduce of its gradient
    # per step (two holders, ring: bytes/bandwidth + 2·latency) — the cheaper is charged, and the
    # runtime makes the same choice (tied_policy).
    links = [devices[k - 1].link_to(devices[k]) for k in range(1, S)]
    latency = tuple(0 for _ in links)
    reads = table.param_reads or ("",) * len(table.nodes)
    tensors = table.output_tensors or (1,) * len(table.nodes)
    transfer = tuple(
        tuple(
            round(min(tied_costs(nbytes, bw, lat, M)) * NS) if read else round(2 * (M * lat * count + nbytes / bw) * NS)
            for bw, lat in links
        )
        for nbytes, read, count in zip(table.output_bytes, reads, tensors)
    )
    return Problem(
        nodes=table.nodes,
        labels=table.module_paths,
        devices=tuple(d.torch_device or d.name for d in devices),
        compute=compute,
        edges=table.edges,
        order_edges=table.order_edges,
        transfer=transfer,
        boundary_latency=latency,
        state_mem=tuple(kib(b) for b in table.state_bytes),
        act_mem=tuple(tuple(kib(b * inflight[s] / M) for s in range(S)) for b in table.saved_bytes),
        recv_mem=tuple(tuple(kib(b * inflight[s] / M) for s in range(S)) for b in table.output_bytes),
        send_mem=tuple(tuple(kib(b * inflight[s] / M) for s in range(S)) for b in table.sent_bytes) if table.sent_bytes else (),
        capacity=tuple(d.memory // KIB for d in devices),
        colocate=table.colocate,
        micro_batches=M,
        transient_mem=kib(max(table.transient_bytes, default=0)) if table.transient_bytes else kib(max(table.output_bytes, default=0) / M),
        constraints=tuple(
            UserConstraint(c.text, tuple((n, stage_of_device[d]) for n, d in c.forbid), c.together) for c in constraints
        ),
    )
