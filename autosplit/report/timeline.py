"""A plan's schedule as a timeline: when each stage runs each micro-batch's forward and backward.

The pipeline term of the predicted step is a closed form, ``Σ_s τ_s + (M − 1)·max_s τ_s``
(DESIGN §4.1). The timeline is what that formula summarises: every stage runs its operations in
the schedule's order, each one as soon as the stage is free and its input has arrived —

- forward ``F(s, m)`` after ``F(s − 1, m)``; backward ``B(s, m)`` after ``B(s + 1, m)`` (the last
  stage's after its own ``F(S − 1, m)``);
- the order on one stage: GPipe runs every forward, then every backward (micro-batch 0 first,
  as ``ScheduleGPipe``); 1F1B runs ``min(S − s − 1, M)`` forwards, then alternates one forward
  and one backward, then the remaining backwards (``Schedule1F1B``); ``sequential`` runs one
  micro-batch through every stage and back before the next;
- a task lasts the stage's predicted seconds per micro-batch: forward (backward) compute plus
  half the stage's boundary transfers; after its last backward each stage runs its optimizer
  step.

The idle time between a stage's tasks is the pipeline bubble. The runtime's fixed cost per
micro-batch is not drawn (it is a separate term of the prediction).

Usage::

    tasks = timeline(plan)
    makespan = max(t.end for t in tasks)
"""

from __future__ import annotations

from dataclasses import dataclass

from autosplit import schedules
from autosplit.errors import ConstraintError, advice
from autosplit.plans import Plan, StageReport
from autosplit.solver.asynchronous import simulate
from autosplit.solver.replay import StageWork, replay

__all__ = ["StageTask", "stage_order", "timeline", "bubbles"]


@dataclass(frozen=True)
class StageTask:
    stage: int
    micro: int
    """Micro-batch index; -1 for the optimizer step."""
    kind: str
    """``"forward"``, ``"backward"``, ``"input"`` / ``"weight"`` (a split backward) or ``"optimizer"``."""
    start: float
    end: float
    node: str = ""
    """The graph node (makespan plans, whose tasks are per node)."""
    rank: int = -1
    """The device (pipeline rank) that runs it; -1: the stage's own (one stage per rank)."""

    @property
    def row(self) -> int:
        """The row the chart draws it on: its rank."""
        return self.stage if self.rank < 0 else self.rank


def stage_order(schedule: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The operations stage ``stage`` runs, in order: ``("forward" | "backward", micro-batch)``
    (the schedule's own order, :meth:`autosplit.schedules.Schedule.stage_order`)."""
    return schedules.lookup(schedule).stage_order(stage, stages, micro_batches)


def _durations(stage: StageReport, micro_batches: int) -> tuple[float, float, float]:
    """Seconds per micro-batch forward and backward, and the optimizer step, of one stage."""
    forward, backward = stage.forward, stage.backward
    if forward + backward <= 0:  # a plan saved before stages recorded the split: backward ≈ 2 × forward
        forward, backward = stage.compute / 3, 2 * stage.compute / 3
    optimizer = max(0.0, stage.compute - forward - backward)
    half = stage.transfer / 2
    return (forward + half) / micro_batches, (backward + half) / micro_batches, optimizer


def timeline(plan: Plan) -> list[StageTask]:
    """Every task of one training step under ``plan``'s schedule, by start time (a makespan
    plan's own tasks, one per node and direction, its optimizer steps inside the backwards)."""
    if plan.objective == "makespan":
        stage = {d: s for s, d in enumerate(plan.stage_devices)}
        return sorted((StageTask(stage[t.device], 0, t.kind, t.start, t.end, t.node) for t in plan.tasks),
                      key=lambda t: (t.start, t.stage))
    S, M = len(plan.stages), plan.micro_batches
    durations = [_durations(st, M) for st in plan.stages]
    entry = schedules.lookup(plan.schedule)
    if entry.asynchronous:
        return _asynchronous(S, M, durations)
    if entry.torch_class is not None:
        return _replayed(plan, durations)
    orders = [entry.stage_order(s, S, M) for s in range(S)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * S
    nxt = [0] * S
    tasks: list[StageTask] = []
    while any(nxt[s] < len(orders[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while nxt[s] < len(orders[s]):
                kind, m = orders[s][nxt[s]]
                if kind == "forward":
                    dep = ("forward", s - 1, m) if s > 0 else None
                else:
                    dep = ("backward", s + 1, m) if s < S - 1 else ("forward", s, m)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                end = start + durations[s][0 if kind == "forward" else 1]
                done[(kind, s, m)] = free[s] = end
                tasks.append(StageTask(s, m, kind, start, end))
                nxt[s] += 1
                progressed = True
        if not progressed:  # cannot happen for the orders above; guards a new schedule's order
            raise ConstraintError(advice(
                f"the {plan.schedule} order deadlocks on {S} stages × {M} micro-batches",
                "a stage waits for a task that waits for it", "report this with the plan file",
            ))
    if entry.one_process:  # the stages step their optimizers in turn
        end = max(free)
        for s in range(S):
            tasks.append(StageTask(s, -1, "optimizer", end, end + durations[s][2]))
            end += durations[s][2]
    else:
        end = max(free)
        tasks += [StageTask(s, -1, "optimizer", end, end + durations[s][2]) for s in range(S)]
    return sorted(tasks, key=lambda t: (t.start, t.stage))


def _replayed(plan: Plan, durations: list[tuple[float, float, float]]) -> list[StageTask]:
    """The schedule's own action lists, replayed (:mod:`autosplit.solver.replay`): one row per rank,
    each rank's optimizer step after its last backward."""
    entry, M, v = schedules.lookup(plan.schedule), plan.micro_batches, plan.stages_per_rank
    S = len(plan.stages)
    ranks = S // v
    rank_of = [entry.rank_of(s, S, ranks) if v > 1 else s for s in range(S)]
    work = []
    for (f, b, _), st in zip(durations, plan.stages):
        weight = min(b, st.backward_weight / M)
        work.append(StageWork(f, b - weight, weight))
    actions = entry.actions(ranks, M, v)
    run = replay(actions, rank_of=rank_of, durations=work)
    kinds = {"F": "forward", "B": "backward", "I": "input", "W": "weight"}
    tasks = [StageTask(a.stage, a.micro, kinds[a.kind], t0, t1, rank=r)
             for r, rank in enumerate(actions) for a, t0, t1 in zip(rank, run.start[r], run.end[r])]
    for r, end in enumerate(run.ends):
        for s in (s for s in range(S) if rank_of[s] == r):
            tasks.append(StageTask(s, -1, "optimizer", end, end + durations[s][2], rank=r))
            end += durations[s][2]
    return sorted(tasks, key=lambda t: (t.start, t.row))


def _asynchronous(S: int, M: int, durations: list[tuple[float, float, float]], mini_batches: int = 3) -> list[StageTask]:
    """An asynchronous schedule over ``mini_batches`` mini-batches (micro-batch ``b·M + m``), no
    flush between them: each stage's optimizer step follows its mini-batch's last backward."""
    sim = simulate(stages=S, micro_batches=M, mini_batches=mini_batches, forward=[d[0] for d in durations],
                   backward=[d[1] for d in durations], update=[d[2] for d in durations])
    tasks = [
        StageTask(s, -1 if w.kind == "update" else w.mini * M + w.micro, "optimizer" if w.kind == "update" else w.kind,
             sim.start[s, w], sim.end[s, w])
        for s in range(S) for w in sim.order[s]
    ]
    return sorted(tasks, key=lambda t: (t.start, t.stage))


def bubbles(tasks: list[StageTask]) -> list[tuple[int, float, float]]:
    """Idle spans ``(row, start, end)`` of each row (rank) before the step's last backward ends."""
    work = [t for t in tasks if t.kind != "optimizer"]
    if not work:
        return []
    horizon = max(t.end for t in work)
    out = []
    for s in sorted({t.row for t in work}):
        at = 0.0
        for t in sorted((t for t in work if t.row == s), key=lambda t: t.start):
            if t.start > at + 1e-12:
                out.append((s, at, t.start))
            at = max(at, t.end)
        if horizon > at + 1e-12:
            out.append((s, at, horizon))
    return out
