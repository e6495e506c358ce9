"""The solver's input: a plain-data :class:`Problem` (no torch, no fx), and its records.

The problem is built from a cost table by :func:`autosplit.solver.build.build_problem` and an
assignment is judged by :func:`autosplit.solver.evaluation.evaluate`, both by the model below.

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

import numpy as np

from autosplit.plans import PartialRecompute

__all__ = ["KIB", "NS", "Arrays", "Problem", "Recompute", "UserConstraint", "int_rows"]

NS = 1e9  # time unit: nanoseconds per second
KIB = 1024  # memory unit: bytes per KiB


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
    shared: int = 0
    """KiB of inputs it shares with other blocks (a mask, the rotary tables) beyond the 1/k share its
    :attr:`saves` charge: held more when the others keep theirs. A plan keeps room for it, as for
    :attr:`reserve`; memory floors and bounds, which recompute every block they may, do not."""

    @property
    def room(self) -> int:
        """KiB a plan that recomputes it keeps free on every stage: :attr:`reserve` and :attr:`shared`."""
        return self.reserve + self.shared

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
    V); empty: stage s on rank s. A rank's stages share its device: its memory cap holds their state, buffers
    and one reserve, and their activations as :attr:`peaks` count them."""
    peaks: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """[rank][moment] micro-batches each of the rank's stages (in stage order) holds at the moments its
    memory may peak (:meth:`autosplit.schedules.Schedule.peak_counts`); a stage's :attr:`act_mem` is
    held at its own most (its in-flight count), so at a moment holding ``c`` of its ``w`` micro-batches
    the rank holds ``c / w`` of it. Empty: each stage at its peak (one stage per rank)."""

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
        from networkx.utils import UnionFind  # deferred: networkx loads when a plan first recomputes

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
        reserve = max((self.recompute[u].room for u in chosen), default=0)
        fixed = dataclasses.replace(
            self, compute=int_rows(compute), act_mem=int_rows(act), colocate=colocate, transient_mem=self.transient_mem + reserve,
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

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank(s) == rank]

    @cached_property
    def peak_weights(self) -> tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]:
        """[rank] (L, [moment] integer weights over the rank's stages): a rank holds ``Σ_i w_i · act_i / L``
        of its stages' activations (each at its own peak, :attr:`act_mem`) at one of its moments
        (:attr:`peaks`), with ``w_i = c_i · L / (stage i's most)``; empty without :attr:`peaks`."""
        out = []
        for moments in self.peaks:
            most = [max(m[i] for m in moments) for i in range(len(moments[0]))]
            L = math.lcm(*most)
            out.append((L, tuple(tuple(c * L // w for c, w in zip(m, most)) for m in moments)))
        return tuple(out)

    @cached_property
    def least_held(self) -> tuple[float, ...]:
        """[stage] the share of its activations (:attr:`act_mem`) counted for it in a lower bound of its
        rank's peak: the mean over the rank's moments (the peak, their most, is no less than their mean);
        1 without :attr:`peaks`."""
        out = [1.0] * self.num_stages
        for r, (L, moments) in enumerate(self.peak_weights):
            for i, s in enumerate(self.stages_of(r)):
                out[s] = sum(w[i] for w in moments) / len(moments) / L
        return tuple(out)

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
        """The tables as int64 arrays, made once (the DP and :func:`~autosplit.solver.evaluation.evaluate` read them many times)."""
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



def int_rows(values: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """Integer rows as tuples; equal rows share one tuple (a deep model repeats its layers' rows,
    and 64 identical devices make 64 equal columns: converting each once keeps this cheap)."""
    table = np.ascontiguousarray(values, dtype=np.int64)
    rows: dict[bytes, tuple[int, ...]] = {}
    for i, row in enumerate(table):
        key = row.tobytes()
        if key not in rows:
            rows[key] = tuple(table[i].tolist())
    return tuple(rows[row.tobytes()] for row in table)
