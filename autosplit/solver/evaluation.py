"""Evaluation: the stage times, memory and objective of one assignment, by the problem's model.

The model is :mod:`autosplit.solver.problem`'s: stage ``s``'s time is its compute plus the
transfers at its two boundaries (a value crossing several boundaries is relayed stage to
stage), its memory its state, saved activations, received and sent tensors at its in-flight
count, pipeline buffers and a transient reserve; the objective is the schedule's closed form
(:meth:`~autosplit.solver.problem.Problem.objective_of`). Integer units (ns, KiB), so exact.

Usage::

    ev = evaluate(problem, stage_of)
    ev.time, ev.memory, ev.objective
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autosplit.solver.problem import Problem

__all__ = ["Evaluation", "evaluate"]


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
    """As :attr:`~autosplit.solver.problem.Problem.rank_of`."""
    buffer_mem: tuple[int, ...] = ()
    """[stage] of ``recv_mem`` and ``send_mem``, the pipeline's per-micro-batch buffers
    (:attr:`~autosplit.solver.problem.Problem.buffer_mem`)."""

    peak_weights: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...] = ()
    """As :attr:`~autosplit.solver.problem.Problem.peak_weights`: how much of its stages' activations a rank
    holds at each moment it may peak; empty: all of them (one stage per rank)."""

    @property
    def memory(self) -> tuple[int, ...]:
        send = self.send_mem or (0,) * len(self.state_mem)
        return tuple(
            a + b + c + d + self.transient_mem for a, b, c, d in zip(self.state_mem, self.act_mem, self.recv_mem, send)
        )

    @property
    def rank_memory(self) -> tuple[int, ...]:
        """[rank] KiB: its stages' memory with one transient reserve, their activations at the rank's worst
        moment (:attr:`peak_weights`)."""
        if not self.rank_of:
            return self.memory
        out = [self.transient_mem] * (max(self.rank_of) + 1)
        for s, m in enumerate(self.memory):
            out[self.rank_of[s]] += m - self.transient_mem - (self.act_mem[s] if self.peak_weights else 0)
        for r, (L, moments) in enumerate(self.peak_weights):
            act = [self.act_mem[s] for s in range(len(self.rank_of)) if self.rank_of[s] == r]
            out[r] += -(-max(sum(w * a for w, a in zip(weights, act)) for weights in moments) // L)
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
        problem.objective_of(time.tolist()), ints(send), problem.rank_of, ints(buffers), problem.peak_weights,
    )
