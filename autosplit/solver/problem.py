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

Asynchronous schedules (XPipe, async, PipeDream: no flush between mini-batches) are solved
and predicted in their steady state (:attr:`Problem.steady`): ``max_s t_s`` per mini-batch,
objective ``M · max_s t_s``. A stage keeps ``S − s``
micro-batches in flight, and PipeDream's stashed weight versions (XPipe: the weights kept aside
during a forward on predicted ones) are charged with its activations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from networkx.utils import UnionFind

from autosplit import schedules
from autosplit.plans import PartialRecompute
from autosplit.schedules import SCHEDULES
from autosplit.solver.asynchronous import simulate, stashed_versions

__all__ = [
    "Problem", "Recompute", "Evaluation", "UserConstraint", "SCHEDULES", "in_flight", "weight_copies",
    "evaluate", "build_problem", "pipeline_buffers", "tied_costs",
]

NS = 1e9  # time unit: nanoseconds per second
KIB = 1024  # memory unit: bytes per KiB


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at its peak (GPipe: all; 1F1B:
    S − s, at most M; asynchronous: S − s, from the next mini-batch too): the schedule's own rule
    (:meth:`autosplit.schedules.Schedule.in_flight`)."""
    return schedules.lookup(schedule).in_flight(stage, stages, micro_batches)


def weight_copies(schedule: str, stages: int, micro_batches: int) -> tuple[int, ...]:
    """Copies of its weights each stage keeps beside them: PipeDream's stashed versions still in
    flight, XPipe's weights kept aside while a forward runs on predicted ones (both read off one
    simulation of the schedule, long enough to reach its steady state); none otherwise."""
    weights = schedules.lookup(schedule).weights
    if weights == "current":
        return (0,) * stages
    sim = simulate(stages=stages, micro_batches=micro_batches, mini_batches=math.ceil(stages / micro_batches) + 2,
                   forward=[1.0] * stages, backward=[2.0] * stages)
    if weights == "stashed":
        return tuple(stashed_versions(sim, s) - 1 for s in range(stages))
    return tuple(int(any(sim.differences(s))) for s in range(stages))


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
class Recompute:
    """A block the plan may recompute in the backward instead of keeping its activations."""

    label: str
    members: tuple[int, ...]
    """Its nodes (a plan that recomputes it keeps them on one stage: one checkpointed region)."""
    compute: tuple[int, ...]
    """[stage] ns its forward takes again in the backward (whole batch)."""
    saves: tuple[int, ...]
    """[stage] KiB its stage no longer holds at its peak."""
    reserve: int
    """KiB its backward holds again (one micro-batch of its activations): a stage that recomputes
    keeps room for its largest such block."""
    forced: bool | None = None
    """True: the plan must recompute it; False: must keep it; None: the solver chooses."""
    in_flight: tuple[int, ...] = ()
    """[stage] micro-batches the stage holds at its peak, where the runtime can keep some of them
    (:class:`~autosplit.plans.PartialRecompute`: flushed schedules torch runs); empty: all or none."""

    def partly(self, stage: int, keep: int, micro_batches: int) -> Recompute:
        """This block on ``stage`` keeping ``keep`` of every ``in_flight[stage]`` micro-batches: it
        saves the rest's share of its memory and recomputes the micro-batches that do not keep theirs."""
        window = self.in_flight[stage]
        again = PartialRecompute(self.label, keep, window).recomputed(micro_batches)
        compute, saves = list(self.compute), list(self.saves)
        compute[stage] = round(compute[stage] * again / micro_batches)
        saves[stage] = saves[stage] * (window - keep) // window
        return dataclasses.replace(self, compute=tuple(compute), saves=tuple(saves))


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
    forward: tuple[tuple[int, ...], ...] = ()
    """[node][stage] the forward's share of ``compute`` (the rest is backward and optimizer
    step); the makespan objective schedules them as two tasks. Empty: half each."""
    rank_of: tuple[int, ...] = ()
    """[stage] the rank that runs it, when a rank runs several stages (interleaved: s mod pp; a
    V); empty: stage s on rank s. A rank's stages share its device: its memory cap holds their sum."""

    recompute: tuple[Recompute, ...] = ()
    """Blocks the solver may recompute (activation checkpointing); costs above are those of keeping them."""
    buffer_mem: tuple[int, ...] = ()
    """[node] KiB of the buffers torch's pipeline stages keep for the node's output when it crosses a
    boundary, one per micro-batch for the whole step: the receiver's buffer and the gradient autograd
    leaves in it, the sender's buffer for the gradient coming back. Included in :attr:`recv_mem`
    (twice) and :attr:`send_mem` (once); empty: none (a runtime of its own)."""
    steady: bool = False
    """No flush between mini-batches (an asynchronous schedule): a step is M micro-batches through
    the slowest stage, and the objective ``M · max_s t_s``."""

    def fixed(self, chosen: Collection[int], partial: Mapping[int, tuple[int, int]] | None = None) -> Problem:
        """This problem with the blocks ``chosen`` (indices into :attr:`recompute`) recomputed and no
        choice left: each block's recompute time and saved memory spread over its members (in
        proportion to their activations), its members kept together, and every stage's reserve raised
        by the largest block's (a bound: a stage without one keeps the room too). ``partial``: block →
        (its stage, micro-batches it keeps there), see :meth:`Recompute.partly`."""
        chosen = sorted(set(chosen))
        partial = partial or {}
        if not self.recompute and not chosen:
            return self
        a = self.arrays
        compute, act = a.compute.copy(), a.act.copy()
        groups = UnionFind(range(len(self.nodes)))
        for group in self.colocate:
            groups.union(*group)
        for u in chosen:
            block = self.recompute[u] if u not in partial else self.recompute[u].partly(*partial[u], self.micro_batches)
            members = np.asarray(block.members, dtype=np.int64)
            act[members] -= _apportion(act[members], np.asarray(block.saves, dtype=np.int64))
            compute[members[0]] += np.asarray(block.compute, dtype=np.int64)
            groups.union(*block.members)
        colocate = tuple(sorted(tuple(sorted(g)) for g in groups.to_sets() if len(g) > 1))
        reserve = max((self.recompute[u].reserve for u in chosen), default=0)
        fixed = dataclasses.replace(
            self, compute=_rows(compute), act_mem=_rows(act), colocate=colocate, transient_mem=self.transient_mem + reserve,
            recompute=(),
        )
        fixed.__dict__["arrays"] = dataclasses.replace(a, compute=compute, act=act)
        return fixed

    @property
    def forced(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(blocks the plan must recompute, blocks it may): the least and the most it can recompute."""
        must = tuple(u for u, b in enumerate(self.recompute) if b.forced)
        may = tuple(u for u, b in enumerate(self.recompute) if b.forced is not False)
        return must, may

    @property
    def ranks(self) -> int:
        return max(self.rank_of) + 1 if self.rank_of else self.num_stages

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // max(1, self.ranks)

    def rank(self, stage: int) -> int:
        return self.rank_of[stage] if self.rank_of else stage

    def objective_of(self, stage_time: Sequence[int]) -> int:
        """``M`` times the step for these whole-batch stage times (ns). One stage per rank:
        ``Σ_s t_s + (M − 1)·max_s t_s`` (GPipe; 1F1B on equal stages). Several: ``M·max_r Σ_{s on r} t_s
        + (pp − 1)·max_s t_s`` — each rank's work, plus a fill and drain of pp − 1 stage times (on
        equal stages, Narayanan et al.'s interleaved ``(M + (pp − 1)/v)·v·t``; one rank's stages left
        unbalanced pay the larger stage). The replayed schedule then judges the plan."""
        if self.steady:
            return self.micro_batches * int(max(stage_time))
        if self.stages_per_rank == 1:
            return int(sum(stage_time)) + (self.micro_batches - 1) * int(max(stage_time))
        rank_time = [0] * self.ranks
        for s, t in enumerate(stage_time):
            rank_time[self.rank(s)] += int(t)
        return self.micro_batches * max(rank_time) + (self.ranks - 1) * int(max(stage_time))

    def forward_time(self, node: int, stage: int) -> int:
        return self.forward[node][stage] if self.forward else self.compute[node][stage] // 2

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    def consumers(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for u, v in self.edges:
            out[u].append(v)
        return out

    @cached_property
    def fastest(self) -> list[int]:
        """[node] its compute on its fastest stage."""
        return self.arrays.compute.min(axis=1).tolist() if self.num_stages else [0] * len(self.nodes)

    @cached_property
    def cheapest_transfer(self) -> list[int]:
        """[node] moving its output over its cheapest boundary (0 with one stage)."""
        transfer = self.arrays.transfer
        return transfer.min(axis=1).tolist() if transfer.shape[1] else [0] * len(self.nodes)

    @cached_property
    def arrays(self) -> Arrays:
        """The tables as int64 arrays, made once (the DP and :func:`evaluate` read them many times)."""
        N, S = len(self.nodes), self.num_stages

        def table(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
            return np.asarray(rows, dtype=np.int64).reshape(N, width) if rows else np.zeros((N, width), dtype=np.int64)

        edges = np.asarray(self.edges, dtype=np.int64).reshape(-1, 2)
        return Arrays(
            compute=table(self.compute, S), transfer=table(self.transfer, S - 1), state=np.asarray(self.state_mem, dtype=np.int64),
            act=table(self.act_mem, S), recv=table(self.recv_mem, S), send=table(self.send_mem, S),
            producer=edges[:, 0], consumer=edges[:, 1],
        )


def _apportion(held: np.ndarray, total: np.ndarray) -> np.ndarray:
    """[member, stage] integer parts of ``total[stage]`` in proportion to ``held`` (largest
    remainders), each at most what it holds: they sum to ``total`` exactly (when it is held)."""
    whole = held.sum(axis=0)
    exact = held * (np.minimum(total, whole) / np.where(whole > 0, whole, 1))[None, :]
    part = np.floor(exact).astype(np.int64)
    short = np.minimum(total, whole) - part.sum(axis=0)
    rank = np.argsort(np.argsort(-(exact - part), axis=0, kind="stable"), axis=0)
    return part + (rank < short[None, :])


@dataclass(frozen=True)
class Arrays:
    """:class:`Problem`'s tables as arrays ([node] or [node, stage]; transfer: [node, boundary])."""

    compute: np.ndarray
    transfer: np.ndarray
    state: np.ndarray
    act: np.ndarray
    recv: np.ndarray
    send: np.ndarray
    producer: np.ndarray
    """Data edges, as two aligned arrays."""
    consumer: np.ndarray


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
    rank_of: tuple[int, ...] = ()
    """As :attr:`Problem.rank_of`."""
    buffer_mem: tuple[int, ...] = ()
    """[stage] of ``recv_mem`` and ``send_mem``, the pipeline's per-micro-batch buffers (:attr:`Problem.buffer_mem`)."""

    @property
    def memory(self) -> tuple[int, ...]:
        send = self.send_mem or (0,) * len(self.state_mem)
        return tuple(
            a + b + c + d + self.transient_mem for a, b, c, d in zip(self.state_mem, self.act_mem, self.recv_mem, send)
        )

    @property
    def rank_memory(self) -> tuple[int, ...]:
        """[rank] KiB: its stages' memory, with one transient reserve."""
        if not self.rank_of:
            return self.memory
        out = [self.transient_mem] * (max(self.rank_of) + 1)
        for s, m in enumerate(self.memory):
            out[self.rank_of[s]] += m - self.transient_mem
        return tuple(out)

    @property
    def rank_time(self) -> tuple[int, ...]:
        """[rank] ns of its stages' work (one stage per rank: the stage times)."""
        if not self.rank_of:
            return self.time
        out = [0] * (max(self.rank_of) + 1)
        for s, t in enumerate(self.time):
            out[self.rank_of[s]] += t
        return tuple(out)

    @property
    def bottleneck(self) -> int:
        return max(range(len(self.time)), key=lambda s: self.time[s])


def evaluate(problem: Problem, stage_of: Sequence[int]) -> Evaluation:
    """Stage times, memory and objective of ``stage_of`` (node index → stage), by the model above.

    Vectorised over nodes (integer arrays, so exact): a node's output crosses boundary k when
    its stage < k ≤ its last consumer's stage (relayed stage to stage).
    """
    S, a = problem.num_stages, problem.arrays
    st = np.asarray(stage_of, dtype=np.int64)
    rows = np.arange(len(st))
    compute, state, act = np.zeros(S, dtype=np.int64), np.zeros(S, dtype=np.int64), np.zeros(S, dtype=np.int64)
    np.add.at(compute, st, a.compute[rows, st])
    np.add.at(state, st, a.state)
    np.add.at(act, st, a.act[rows, st])
    last = st.copy()
    np.maximum.at(last, a.producer, st[a.consumer])
    k = np.arange(1, S)
    crosses = (st[:, None] < k) & (k <= last[:, None])  # [node, boundary k − 1]
    boundary = np.asarray(problem.boundary_latency, dtype=np.int64) + (a.transfer * crosses).sum(axis=0)
    recv, send = np.zeros(S, dtype=np.int64), np.zeros(S, dtype=np.int64)
    recv[1:] = (a.recv[:, 1:] * crosses).sum(axis=0)
    send[:-1] = (a.send[:, :-1] * crosses).sum(axis=0)
    transfer = np.zeros(S, dtype=np.int64)
    transfer[1:] += boundary
    transfer[:-1] += boundary
    time = compute + transfer
    buffers = np.zeros(S, dtype=np.int64)
    if problem.buffer_mem:
        crossing = (np.asarray(problem.buffer_mem, dtype=np.int64)[:, None] * crosses).sum(axis=0)  # [boundary k − 1]
        buffers[1:] += 2 * crossing
        buffers[:-1] += crossing
    ints = lambda x: tuple(int(v) for v in x)  # noqa: E731
    return Evaluation(
        ints(compute), ints(transfer), ints(time), ints(state), ints(act), ints(recv), problem.transient_mem,
        problem.objective_of(time.tolist()), ints(send), problem.rank_of, ints(buffers),
    )


def tied_costs(nbytes: float, bandwidth: float, latency: float, micro_batches: int) -> tuple[float, float]:
    """Seconds per step to share a parameter of ``nbytes`` between two stages across one link:
    (send it with every micro-batch and its gradient back, replicate it and all-reduce its gradient once)."""
    send = 2 * micro_batches * (latency + nbytes / bandwidth)
    replicate = nbytes / bandwidth + 2 * latency
    return send, replicate


def _array(rows: Sequence[Sequence[float]], n: int) -> np.ndarray:
    """``rows`` as an (n, width) array; a row object that repeats (the cost table shares equal
    rows) is converted once."""
    unique: dict[int, Sequence[float]] = {}  # id → row (``rows`` keeps every row alive)
    for r in rows:
        unique.setdefault(id(r), r)
    place = {key: i for i, key in enumerate(unique)}
    table = np.asarray(list(unique.values()), dtype=np.float64).reshape(len(unique), -1)
    return table[[place[id(r)] for r in rows]].reshape(n, -1)


def _rows(values: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """Integer rows as tuples; equal rows share one tuple (a deep model repeats its layers' rows,
    and 64 identical devices make 64 equal columns: converting each once keeps this cheap)."""
    table = np.ascontiguousarray(values, dtype=np.int64)
    rows: dict[bytes, tuple[int, ...]] = {}
    for i, row in enumerate(table):
        key = row.tobytes()
        if key not in rows:
            rows[key] = tuple(table[i].tolist())
    return tuple(rows[row.tobytes()] for row in table)


def _kib(nbytes: float) -> int:
    """Bytes in KiB, rounded up (a plan that fits in KiB fits in bytes)."""
    return math.ceil(nbytes / KIB)


def _compute_ns(table: Any, columns: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """[node, stage] the forward's seconds and the whole compute's ns on each stage's device (``columns``:
    the device of each stage).

    The optimizer steps each stage's parameters once per step, after its last backward; charged
    with the stage's compute, the schedule formula counts it about once (for S ≪ M), and the
    solver balances it with the rest.
    """
    # Vectorised (numpy), with the scalar formulas' order of operations, so values match them exactly.
    N = len(table.nodes)
    opt = table.optimizer_time or ((0.0,) * len(table.devices),) * N
    fwd = _array(table.fwd_time, N)[:, columns]
    seconds = np.add(np.add(fwd, _array(table.bwd_time, N)[:, columns]), _array(opt, N)[:, columns])
    return fwd, np.rint(seconds * NS).astype(np.int64)


def _transfer_ns(table: Any, devices: Sequence[Any], micro_batches: int, schedule: str) -> np.ndarray:
    """[node, k − 1] ns to move each node's output over boundary k (stages k−1 and k) and its gradient back.

    Each micro-batch sends every crossing tensor forward and its gradient back:
    2·(M·latency + bytes/bandwidth) for a tensor of the whole batch's bytes, the latency once per
    tensor of the value (none for a Python value: it crosses as a constant). A parameter read on a
    later stage (a tied weight) has the same bytes in every micro-batch: sent, it costs
    2·M·(latency + bytes/bandwidth); replicated, one all-reduce of its gradient per step (two
    holders, ring: bytes/bandwidth + 2·latency) — the cheaper is charged, and the runtime makes the
    same choice (tied_policy). Asynchronous stages cannot replicate: they send.
    """
    M, N = micro_batches, len(table.nodes)
    links = [devices[k - 1].link_to(devices[k]) for k in range(1, len(devices))]
    reads = table.param_reads or ("",) * len(table.nodes)
    tensors = table.output_tensors or (1,) * len(table.nodes)
    nbytes, counts = np.asarray(table.output_bytes, dtype=np.float64), np.asarray(tensors, dtype=np.float64)
    sent = np.empty((N, len(links)))
    for k, (bw, lat) in enumerate(links):
        sent[:, k] = np.rint(2 * (M * lat * counts + nbytes / bw) * NS)
    asynchronous = schedules.lookup(schedule).asynchronous
    shared = (lambda costs: costs[0]) if asynchronous else min
    for n in (n for n, read in enumerate(reads) if read):
        sent[n] = [round(shared(tied_costs(table.output_bytes[n], bw, lat, M)) * NS) for bw, lat in links]
    return sent


def _held_kib(
    table: Any, schedule: str, stages: int, micro_batches: int, ranks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """[node, stage] KiB each stage holds at its peak: (saved activations at the schedule's in-flight
    count, with the weight copies the schedule keeps; received outputs; outputs it sends on, None
    when the table records none; [node] the pipeline buffers among the last two, see
    :func:`pipeline_buffers`)."""
    S, M = stages, micro_batches
    entry = schedules.lookup(schedule)
    in_flight_share = np.asarray([entry.in_flight(s, S, M, ranks) for s in range(S)], dtype=np.float64)

    def per_stage(values: Sequence[int]) -> np.ndarray:  # kib(b · inflight[s] / M)
        return np.ceil(np.asarray(values, dtype=np.float64)[:, None] * in_flight_share[None, :] / M / KIB).astype(np.int64)

    saved = table.saved_bytes
    if entry.split_backward and table.wgrad_bytes:  # gradients kept from the input pass (I) to the weight pass (W)
        saved = [a + b for a, b in zip(saved, table.wgrad_bytes)]
    act = per_stage(saved)
    copies = np.asarray(weight_copies(schedule, S, M), dtype=np.int64)
    if copies.any() and table.param_bytes:  # weight copies a schedule keeps: held with the activations
        act += np.ceil(np.asarray(table.param_bytes, dtype=np.float64) / KIB).astype(np.int64)[:, None] * copies[None, :]
    send = per_stage(table.sent_bytes) if table.sent_bytes else None
    buffers = pipeline_buffers(table, schedule, M)
    if buffers is None:  # a runtime of its own: what it receives is held while in flight
        return act, per_stage(table.output_bytes), send, None
    recv = np.repeat(2 * buffers[:, None], S, axis=1)
    send = np.repeat(buffers[:, None], S, axis=1) + (send if send is not None else 0)
    for n, read in enumerate(table.param_reads or ()):
        if read:  # a tied weight read on a later stage is replicated there (see _transfer_ns): its copy's state
            recv[n], send[n] = _kib(table.state_bytes[n]), 0
    return act, recv, send, buffers


def pipeline_buffers(table: Any, schedule: str, micro_batches: int) -> np.ndarray | None:
    """[node] KiB torch's pipeline stages hold for the node's output if it crosses a boundary: one
    buffer per micro-batch (``PipelineStage`` makes them once, for every micro-batch of the step),
    so the whole batch's bytes; none for a parameter read on a later stage (a tied weight: a replica
    there holds its state instead). None for schedules torch does not run (their runtime holds what
    is in flight only)."""
    entry = schedules.lookup(schedule)
    if not entry.flushes or entry.torch_class is None:
        return None
    reads = table.param_reads or ("",) * len(table.output_bytes)
    whole = [0 if read else b for b, read in zip(table.output_bytes, reads)]
    return np.ceil(np.asarray(whole, dtype=np.float64) / KIB).astype(np.int64)


def _first_stage_only(table: Any, schedule: str, stages: int) -> tuple[UserConstraint, ...]:
    """A split backward (zero bubble) computes a stage's weight gradients from what its input pass
    reached; torch's stages past the first reach no parameter whose inputs need no gradient (an
    embedding of token ids), and would leave its gradient None. Such nodes stay on stage 0, which
    torch runs as one whole backward."""
    if not schedules.lookup(schedule).split_backward or not table.wgrad_share or stages < 2:
        return ()
    only = [n for n, share in enumerate(table.wgrad_share) if share >= 1.0 and table.param_counts[n] + _read_param(table, n)]
    return tuple(
        UserConstraint(f"'{table.module_paths[n] or table.nodes[n]}' (node {table.nodes[n]}) has only a weight gradient "
                       f"(its inputs need none), which {schedule}'s split backward computes on stage 0 only",
                       tuple((n, s) for s in range(1, stages)))
        for n in only
    )


def _read_param(table: Any, n: int) -> int:
    """Whether node ``n`` reads a parameter through an attribute node (its weight is not its own)."""
    reads = table.param_reads or ()
    return int(any(reads[u] for u, v in table.edges if v == n))


def _recompute(
    table: Any, offered: Mapping[str, bool | None], fwd: np.ndarray, schedule: str, stages: int, micro_batches: int, ranks: int
) -> tuple[Recompute, ...]:
    """The table's blocks that ``offered`` names, as the solver's :class:`Recompute` choices."""
    entry = schedules.lookup(schedule)
    in_flight = [entry.in_flight(s, stages, micro_batches, ranks) for s in range(stages)]
    share = np.asarray(in_flight, dtype=np.float64) / micro_batches
    # torch's stages tell the generated code each forward's micro-batch (runtime.stage), in order per stage
    windows = tuple(in_flight) if entry.flushes and entry.torch_class is not None else ()
    out = []
    for label, forced in offered.items():
        b = table.blocks.index(label)
        members = table.block_members[b]
        out.append(Recompute(
            label, members, tuple(np.rint(fwd[list(members)].sum(axis=0) * NS).astype(np.int64).tolist()),
            tuple(int(x) for x in np.floor(table.block_saves[b] * share / KIB)),
            _kib(table.block_activations[b] / micro_batches), forced, windows,
        ))
    return tuple(out)


def build_problem(
    table,
    *,
    micro_batches: int = 1,
    schedule: str = "gpipe",
    order: Sequence[int] | None = None,
    constraints: Sequence[UserConstraint] = (),
    rank_of: Sequence[int] = (),
    recompute: Mapping[str, bool | None] | None = None,
) -> Problem:
    """Scale a cost table (``passes.costs.CostTable``) into integer units for one device order.

    Stage ``s`` runs on device ``order[s]`` (identity by default); with several stages per rank,
    on rank ``rank_of[s]`` (a rank's stages name its device in ``order``). ``constraints`` name
    *devices* in their ``forbid`` pairs; they are turned into stages here. ``recompute``: the table's
    blocks the solver may recompute, by label, each with the user's decision (True, False) or None.
    """
    order = tuple(range(len(table.devices))) if order is None else tuple(order)
    devices = [table.devices[d] for d in order]
    stages_of_device: dict[int, list[int]] = {}
    for s, d in enumerate(order):
        stages_of_device.setdefault(d, []).append(s)
    N, S, M = len(table.nodes), len(devices), micro_batches
    fwd, compute = _compute_ns(table, list(order))
    sent = _transfer_ns(table, devices, M, schedule)
    act, recv, send, buffers = _held_kib(table, schedule, S, M, max(rank_of) + 1 if rank_of else S)
    for k in range(1, S if rank_of else 0):  # two stages of one rank pass their tensors in memory
        if rank_of[k - 1] == rank_of[k]:
            sent[:, k - 1] = 0
    state = tuple(_kib(b) for b in table.state_bytes)
    transient = _kib(max(table.transient_bytes, default=0)) if table.transient_bytes else _kib(max(table.output_bytes, default=0) / M)
    problem = Problem(
        nodes=table.nodes,
        labels=table.module_paths,
        devices=tuple(d.torch_device or d.name for d in devices),
        compute=_rows(compute),
        edges=table.edges,
        order_edges=table.order_edges,
        transfer=_rows(sent),
        boundary_latency=(0,) * sent.shape[1],  # latency is paid per tensor, in ``sent``
        state_mem=state,
        act_mem=_rows(act),
        recv_mem=_rows(recv),
        send_mem=_rows(send) if send is not None else (),
        forward=_rows(np.minimum(np.rint(fwd * NS).astype(np.int64), compute)),
        capacity=tuple(d.memory // KIB for d in devices),
        colocate=table.colocate,
        micro_batches=M,
        transient_mem=transient,
        constraints=tuple(
            UserConstraint(c.text, tuple((n, s) for n, d in c.forbid for s in stages_of_device.get(d, ())), c.together)
            for c in constraints
        ) + _first_stage_only(table, schedule, S),
        rank_of=tuple(rank_of),
        recompute=_recompute(table, recompute or {}, fwd, schedule, S, M, max(rank_of) + 1 if rank_of else S),
        buffer_mem=tuple(buffers.tolist()) if buffers is not None else (),
        steady=schedules.lookup(schedule).asynchronous,
    )
    # The arrays the solver reads are at hand: cache them rather than convert the tuples back.
    edges = np.asarray(table.edges, dtype=np.int64).reshape(-1, 2)
    problem.__dict__["arrays"] = Arrays(
        compute=compute, transfer=sent.astype(np.int64), state=np.asarray(state, dtype=np.int64), act=act, recv=recv,
        send=send if send is not None else np.zeros((N, S), dtype=np.int64), producer=edges[:, 0], consumer=edges[:, 1],
    )
    return problem
