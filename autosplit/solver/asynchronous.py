"""Asynchronous pipelines across mini-batches: each stage's order of work, simulated in time, and
how stale each forward's weights are (XPipe, Guan et al. 2019; PipeDream, Narayanan et al. 2019).

No flush between mini-batches (DESIGN §4.7). Micro-batches stream through the stages as one
sequence ``j = b·M + m`` (mini-batch ``b``, micro-batch ``m`` of ``M``). Stage ``s`` of ``S``
keeps ``S − s`` micro-batches in flight: it runs that many forwards first, then alternates one
backward and one forward (asynchronous 1F1B). Its weights are updated once per mini-batch,
right after its backward of the mini-batch's last micro-batch, with the gradient accumulated
over the mini-batch's micro-batches; there is one weight copy.

A forward of mini-batch ``b`` that a stage runs after ``u`` of its updates sees the weights
``W_u``; synchronous training runs it on ``W_b``, the weights its gradient is applied to. The
*version difference* ``s = b − u`` is what XPipe predicts across — ``Ŵ = W − lr · s · Δ``, with
Δ the optimizer's own direction — and it is read off the simulated order, not a formula: a
schedule with another warm-up or update rule gets its own. A backward of mini-batch ``b`` runs
after exactly ``b`` updates of its stage (backwards run in order), so it sees ``W_b``: XPipe
and the plain asynchronous schedule take the current weights there, PipeDream the stashed
ones its forward used, which costs the weight versions alive at once (:func:`stashed_versions`).

Usage::

    sim = simulate(stages=4, micro_batches=2, mini_batches=6, forward=[1, 1, 1, 1], backward=[2, 2, 2, 2])
    sim.version_difference(stage=0, mini=3, micro=0)     # 2
    sim.throughput                                      # micro-batches per unit time, steady state
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from autosplit.errors import ConstraintError, SolverError, advice

__all__ = ["Work", "Simulation", "async_order", "simulate", "stashed_versions"]


@dataclass(frozen=True)
class Work:
    """One piece of a stage's work: the forward or backward of a micro-batch, or the update
    after a mini-batch (``micro`` is then ``-1``)."""

    kind: str
    """``"forward"``, ``"backward"`` or ``"update"``."""
    mini: int
    micro: int


def async_order(stage: int, stages: int, micro_batches: int, mini_batches: int) -> tuple[Work, ...]:
    """Stage ``stage``'s work in order: ``stages − stage`` forwards, then one backward and one
    forward in turn; an update right after each mini-batch's last backward."""
    M, total = micro_batches, micro_batches * mini_batches
    warmup = min(stages - stage, total)
    order = [Work("forward", j // M, j % M) for j in range(warmup)]
    for j in range(total):
        order.append(Work("backward", j // M, j % M))
        if j % M == M - 1:
            order.append(Work("update", j // M, -1))
        if j + warmup < total:
            order.append(Work("forward", (j + warmup) // M, (j + warmup) % M))
    return tuple(order)


@dataclass(frozen=True)
class Simulation:
    """Every stage's work in order, with start and end times."""

    stages: int
    micro_batches: int
    mini_batches: int
    order: tuple[tuple[Work, ...], ...]
    start: dict[tuple[int, Work], float]
    end: dict[tuple[int, Work], float]
    _differences: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)

    def version_difference(self, stage: int, mini: int, micro: int) -> int:
        """Updates of ``stage``'s weights between its forward of (``mini``, ``micro``) and the
        update that applies this mini-batch's gradient: ``b − u``."""
        if not (0 <= stage < self.stages and 0 <= mini < self.mini_batches and 0 <= micro < self.micro_batches):
            raise ConstraintError(advice(
                f"stage {stage} runs no forward of mini-batch {mini}, micro-batch {micro}",
                f"the simulation has {self.stages} stages, {self.mini_batches} mini-batches of {self.micro_batches} micro-batches",
                "ask for a stage, mini-batch and micro-batch inside those counts",
            ))
        return self.differences(stage)[mini * self.micro_batches + micro]

    def differences(self, stage: int) -> list[int]:
        """The version difference of each of ``stage``'s forwards, in micro-batch order (one pass over its order)."""
        if stage not in self._differences:
            out = [0] * (self.micro_batches * self.mini_batches)
            seen = 0
            for work in self.order[stage]:
                if work.kind == "forward":
                    out[work.mini * self.micro_batches + work.micro] = work.mini - seen
                seen += work.kind == "update"
            self._differences[stage] = out
        return self._differences[stage]

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)

    @property
    def throughput(self) -> float:
        """Micro-batches finished (stage 0's backward) per unit time over the second half of the
        run, the steady state; over the whole run when it is too short to have one."""
        done = sorted(t for (s, w), t in self.end.items() if s == 0 and w.kind == "backward")
        half = len(done) // 2
        if len(done) - half < 2 or done[-1] == done[half]:
            return len(done) / self.makespan if self.makespan else 0.0
        return (len(done) - 1 - half) / (done[-1] - done[half])


def simulate(
    *, stages: int, micro_batches: int, mini_batches: int,
    forward: Sequence[float], backward: Sequence[float], update: Sequence[float] | None = None,
    transfer: float = 0.0,
) -> Simulation:
    """Run :func:`async_order` on every stage in time: a forward waits for the previous stage's
    forward of the same micro-batch, a backward for its own forward and the next stage's backward
    (plus ``transfer`` when it crosses a boundary); each stage does one thing at a time, in order.
    ``forward``/``backward``/``update``: time per stage (per micro-batch; per update)."""
    if stages < 1 or micro_batches < 1 or mini_batches < 1:
        raise ConstraintError(advice(
            f"an asynchronous pipeline of {stages} stages, {micro_batches} micro-batches and {mini_batches} mini-batches",
            "each must be at least 1", "pass positive counts",
        ))
    upd = [0.0] * stages if update is None else list(update)
    order = tuple(async_order(s, stages, micro_batches, mini_batches) for s in range(stages))
    start: dict[tuple[int, Work], float] = {}
    end: dict[tuple[int, Work], float] = {}
    cursor = [0] * stages
    free = [0.0] * stages
    remaining = sum(len(o) for o in order)
    while remaining:
        progressed = False
        for s in range(stages):
            while cursor[s] < len(order[s]):
                w = order[s][cursor[s]]
                ready = _ready(s, w, stages, end, transfer)
                if ready is None:
                    break
                duration = {"forward": forward[s], "backward": backward[s], "update": upd[s]}[w.kind]
                start[s, w] = max(free[s], ready)
                end[s, w] = free[s] = start[s, w] + duration
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for async_order; guards a schedule that waits on itself
            raise SolverError(advice(
                f"the asynchronous schedule deadlocks at {[order[s][cursor[s]] for s in range(stages)]}",
                "each stage waits for work another stage runs later", "report this schedule: it is a bug",
            ))
    return Simulation(stages, micro_batches, mini_batches, order, start, end)


def _ready(s: int, w: Work, stages: int, end: dict[tuple[int, Work], float], transfer: float) -> float | None:
    """When ``w`` on stage ``s`` may start as far as other stages go, or None if not yet known."""
    if w.kind == "update":
        return 0.0
    if w.kind == "forward":
        if s == 0:
            return 0.0
        t = end.get((s - 1, w))
        return None if t is None else t + transfer
    own = end.get((s, Work("forward", w.mini, w.micro)))
    if own is None:
        return None
    if s == stages - 1:
        return own
    t = end.get((s + 1, w))
    return None if t is None else max(own, t + transfer)


def stashed_versions(sim: Simulation, stage: int) -> int:
    """The most weight versions ``stage`` holds at once under PipeDream's weight stashing: the
    current weights and every older version a forward used whose backward has not run yet."""
    used: dict[tuple[int, int], int] = {}
    seen, most = 0, 1
    for w in sim.order[stage]:
        if w.kind == "update":
            seen += 1
        elif w.kind == "forward":
            used[w.mini, w.micro] = seen
        else:
            used.pop((w.mini, w.micro))
        most = max(most, len(set(used.values()) | {seen}))
    return most
