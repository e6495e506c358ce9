"""A step predicted by replaying the schedule's own action lists (DESIGN §4.1, §4.3).

Each rank runs its actions (:class:`~autosplit.schedules.Action`: ``F``, ``B``, ``I``, ``W`` of one
stage on one micro-batch) in the order its schedule gives, as a list schedule: an action starts
when its rank is free and its inputs have arrived —

- ``F(s, m)`` after ``F(s − 1, m)`` has ended and its output crossed boundary ``s``;
- ``B(s, m)`` / ``I(s, m)`` after ``F(s, m)`` and, below the last stage, after ``B`` or ``I`` of
  ``(s + 1, m)`` has ended and its input gradient crossed boundary ``s + 1`` back;
- ``W(s, m)`` after ``I(s, m)``.

A crossing between stages on one rank (a V's turn, consecutive looped stages) is free; between
ranks it takes ``delay[k]`` seconds for boundary ``k`` (stage ``k − 1`` → ``k``), during which
neither rank is busy. Whatever a rank spends on a transfer itself is part of the durations the
caller gives. Nothing here knows a schedule by name: GPipe, 1F1B, interleaved, zero-bubble and
DualPipeV differ only in their action lists.

Memory follows the same lists, rank by rank (it depends on the order, not on the times): a
forward adds its stage's saved bytes; a whole backward frees them; an input-gradient pass frees
all but what the weight-gradient pass still needs, which frees the rest.

Usage::

    from autosplit import schedules
    actions = schedules.lookup("1f1b").actions(ranks=4, micro_batches=8)
    run = replay(actions, rank_of=[0, 1, 2, 3], durations=[StageWork(1, 1, 1)] * 4)
    run.step, run.ends                       # 33.0, (33.0, 31.0, 29.0, 27.0)
    peaks(actions, saved=[4] * 4)            # bytes held at each rank's peak: [16, 12, 8, 4]
    # a measured step's own durations (every rank's DistributedModel.tracing() spans):
    seconds = measured_durations(spans)
    replay(actions, rank_of=[0, 1, 2, 3], durations=seconds)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from autosplit.errors import SolverError, advice
from autosplit.schedules import Action

__all__ = ["StageWork", "Replay", "replay", "peaks", "measured_durations"]


@dataclass(frozen=True)
class StageWork:
    """Seconds one micro-batch takes on a stage: forward, backward to the inputs (I), backward to
    the weights (W); a whole backward (``B``) takes ``I + W``."""

    forward: float
    backward_input: float
    backward_weight: float

    def of(self, kind: str) -> float:
        return {"F": self.forward, "I": self.backward_input, "W": self.backward_weight,
                "B": self.backward_input + self.backward_weight}[kind]


@dataclass(frozen=True)
class Replay:
    """When every action ran: ``start[r][i]``, ``end[r][i]`` for action ``i`` of rank ``r``."""

    actions: tuple[tuple[Action, ...], ...]
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]

    @property
    def ends(self) -> tuple[float, ...]:
        """When each rank finishes its last action."""
        return tuple(e[-1] if e else 0.0 for e in self.end)

    @property
    def step(self) -> float:
        """When the last rank finishes."""
        return max(self.ends, default=0.0)

    def busy(self, rank: int) -> float:
        return sum(e - s for s, e in zip(self.start[rank], self.end[rank]))


def replay(
    actions: Sequence[Sequence[Action]], *, rank_of: Sequence[int],
    durations: Sequence[StageWork] | Mapping[tuple[str, int, int], float], delay: Sequence[float] = (),
) -> Replay:
    """Replay ``actions`` (per rank, in order) with ``durations[s]`` per micro-batch of stage ``s``
    (stage ``s`` on rank ``rank_of[s]``), or ``durations[kind, stage, micro]`` seconds for each
    action (a measured step's own: :func:`measured_durations`), and ``delay[k − 1]`` seconds to
    cross boundary ``k`` between ranks (default none). A :class:`SolverError` if the lists wait on
    each other forever."""
    S = len(rank_of)
    if isinstance(durations, Mapping):
        measured = durations

        def seconds(a: Action) -> float:
            return measured[a.kind, a.stage, a.micro]
    else:
        per_stage = durations

        def seconds(a: Action) -> float:
            return per_stage[a.stage].of(a.kind)

    delays = list(delay) or [0.0] * max(0, S - 1)
    done: dict[tuple[str, int, int], float] = {}
    start: list[list[float]] = [[] for _ in actions]
    end: list[list[float]] = [[] for _ in actions]
    free = [0.0] * len(actions)
    nxt = [0] * len(actions)

    def arrival(kind: str, stage: int, micro: int, to_stage: int) -> float | None:
        t = done.get((kind, stage, micro))
        if t is None:
            return None
        crossing = min(stage, to_stage) + 1  # boundary k between stages k − 1 and k
        return t + (0.0 if rank_of[stage] == rank_of[to_stage] else delays[crossing - 1])

    def ready(a: Action) -> float | None:
        s, m = a.stage, a.micro
        if a.kind == "F":
            return 0.0 if s == 0 else arrival("F", s - 1, m, s)
        if a.kind == "W":
            return done.get(("I", s, m))
        own = done.get(("F", s, m))
        if own is None or s == S - 1:
            return own
        grad = arrival("G", s + 1, m, s)
        return None if grad is None else max(own, grad)

    remaining = sum(map(len, actions))
    while remaining:
        progressed = False
        for r, work in enumerate(actions):
            while nxt[r] < len(work):
                a = work[nxt[r]]
                at = ready(a)
                if at is None:
                    break
                t0 = max(free[r], at)
                t1 = t0 + seconds(a)
                start[r].append(t0)
                end[r].append(t1)
                free[r] = t1
                done[(a.kind, a.stage, a.micro)] = t1
                if a.kind in ("B", "I"):
                    done[("G", a.stage, a.micro)] = t1  # its input gradient, for the stage before
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {r: str(work[nxt[r]]) for r, work in enumerate(actions) if nxt[r] < len(work)}
            raise SolverError(advice(
                f"the schedule's action lists wait on each other forever (next actions per rank: {waiting})",
                "an action's input comes from an action that, on its own rank, runs after something waiting on it",
                "report the schedule, pipeline degree and micro-batch count: torch's lists should never do this",
            ))
    return Replay(tuple(map(tuple, actions)), tuple(map(tuple, start)), tuple(map(tuple, end)))


def peaks(
    actions: Sequence[Sequence[Action]], *, saved: Sequence[float], weight_held: Sequence[float] = (),
) -> tuple[float, ...]:
    """Bytes each rank holds at its peak over the step: ``saved[s]`` per micro-batch from a forward
    of stage ``s`` to its backward, of which ``weight_held[s]`` (default none) from the input-gradient
    pass until the weight-gradient pass."""
    held_for_w = list(weight_held) or [0.0] * len(saved)
    out = []
    for work in actions:
        live = peak = 0.0
        for a in work:
            s = a.stage
            live += {"F": saved[s], "B": -saved[s], "I": held_for_w[s] - saved[s], "W": -held_for_w[s]}[a.kind]
            peak = max(peak, live)
        out.append(peak)
    return tuple(out)


def measured_durations(spans: Iterable[tuple[str, int, int, float, float]]) -> dict[tuple[str, int, int], float]:
    """``(kind, stage, micro) → seconds`` from measured ``(kind, stage, micro, start, end)`` spans
    (:class:`~autosplit.runtime.stage.Span`): a loss span (``"L"``) counts in its micro-batch's
    forward, as the cost model charges it."""
    out: dict[tuple[str, int, int], float] = {}
    for kind, stage, micro, start, end in spans:
        key = ("F" if kind == "L" else kind, stage, micro)
        out[key] = out.get(key, 0.0) + end - start
    return out
