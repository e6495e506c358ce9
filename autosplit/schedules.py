"""The one registry of pipeline schedules: what each one is, for every module that asks.

A *schedule* is the order of forward and backward work per stage (DESIGN §2). Each schedule
autosplit knows is one frozen :class:`Schedule` entry here — whether it flushes, whether it is
asynchronous, how many micro-batches a stage holds in flight, its order of work per stage, how
its stages sit on ranks, how many stages a rank may hold, whether it splits the backward, which
weights a forward reads (and so what weight copies it keeps) and the
``torch.distributed.pipelining`` class that runs it. Planning, memory, prediction, timelines,
reports and runtimes read these attributes instead of comparing names.

- ``sequential``, ``gpipe`` (Huang et al. 2019), ``1f1b`` (PipeDream-Flush, Narayanan et al.
  2021): flushed, one stage per rank; GPipe and 1F1B run on torch's ``ScheduleGPipe`` /
  ``Schedule1F1B``, ``sequential`` in one process (:class:`~autosplit.runtime.SplitModule`).
- ``xpipe`` (Guan et al. 2019), ``async``, ``pipedream`` (Narayanan et al. 2019): no flush
  between mini-batches (DESIGN §4.7), run by autosplit's own loop
  (:mod:`autosplit.runtime.asynchronous`).
- torch's multi-stage and zero-bubble schedules (``Interleaved1F1B``, ``LoopedBFS``,
  ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``): several stages per rank (a loop or
  a V), their order torch's own action lists (:meth:`Schedule.actions`), replayed by
  :mod:`autosplit.solver.replay`; torch's constructor rules are :meth:`Schedule.refusal`.

``"makespan"`` is an *objective* (what the solver minimises), not a schedule: a plan says it in
``Plan.objective``. Names are looked up case-insensitively, torch's class names too
(``"Schedule1F1B"``, ``"1F1B"`` and ``"1f1b"`` are one schedule).

Ground floor: imports nothing from autosplit but :mod:`autosplit.errors`, and no torch (the
solver reads it).

Usage::

    from autosplit import schedules
    entry = schedules.lookup("Schedule1F1B")          # the "1f1b" entry
    entry.in_flight(stage=0, stages=4, micro_batches=8)  # 4
    entry.torch_class                                  # "Schedule1F1B"
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeAlias

from autosplit.errors import ConstraintError, advice

__all__ = [
    "Action", "Schedule", "ScheduleName", "Objective", "REGISTRY", "SCHEDULES", "ASYNCHRONOUS", "OBJECTIVES", "lookup", "runnable",
]

ScheduleName: TypeAlias = Literal[
    "sequential", "gpipe", "1f1b", "xpipe", "async", "pipedream",
    "interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev",
]
"""The schedules autosplit plans and runs (``PlanOptions.schedule``)."""
Objective: TypeAlias = Literal["pipeline", "makespan"]
"""What the solver minimises: the ``pipeline`` step of a schedule, or the ``makespan`` of one step (DLPlacer)."""
OBJECTIVES: tuple[str, ...] = typing.get_args(Objective)

Order: TypeAlias = Literal["sequential", "fill_drain", "1f1b", "async_1f1b", "torch"]
Placement: TypeAlias = Literal["linear", "loop", "v"]
Weights: TypeAlias = Literal["current", "predicted", "stashed"]
Rounds: TypeAlias = Literal["any", "at_least_stages", "whole_rounds"]


class Action(NamedTuple):
    """One unit of a rank's work in a step: ``kind`` ``"F"`` (forward), ``"B"`` (the whole backward),
    ``"I"`` (the backward to the stage's inputs) or ``"W"`` (to its weights), of ``stage`` on micro-batch ``micro``."""

    kind: Literal["F", "B", "I", "W"]
    stage: int
    micro: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro}"


@dataclass(frozen=True)
class Schedule:
    """One schedule and everything the rest of autosplit needs to know about it."""

    name: str
    """autosplit's name (lower case), as ``PlanOptions(schedule=...)`` and plan files write it."""
    order: Order
    """Each stage's order of work: ``"sequential"`` (one micro-batch through every stage and back
    before the next), ``"fill_drain"`` (every forward, then every backward: GPipe), ``"1f1b"``
    (``min(S − s − 1, M)`` forwards, then one forward and one backward in turn, then the rest of
    the backwards), ``"async_1f1b"`` (``S − s`` forwards, then one backward and one forward in turn,
    across mini-batches: :func:`autosplit.solver.asynchronous.async_order`), or ``"torch"`` (torch's
    own action lists, :meth:`actions`)."""
    flushes: bool
    """Every step drains the pipeline before the optimizer step (synchronous training)."""
    asynchronous: bool
    """No flush between mini-batches; trained by ``DistributedModel.run``, predicted as the steady state."""
    weights: Weights
    """The weights a forward reads: ``"current"``, ``"predicted"`` for the update its gradient meets
    (XPipe: the current ones kept aside meanwhile, one copy), or ``"stashed"`` (PipeDream: the
    version its backward will use, one copy per version in flight)."""
    placement: Placement
    """Where stages sit on the ``pp`` ranks: ``"linear"`` (stage s on rank s), ``"loop"`` (stage s
    on rank s mod pp: interleaved), ``"v"`` (rank r holds stages r and 2·pp − 1 − r)."""
    stages_per_rank: tuple[int, int | None]
    """Fewest and most stages one rank may hold (None: no limit)."""
    split_backward: bool
    """Backward split into input-gradient (I) and weight-gradient (W) work (zero bubble)."""
    torch_class: str | None
    """The ``torch.distributed.pipelining`` class that runs it; None when autosplit runs it itself
    (``sequential`` in one process, the asynchronous ones in :mod:`autosplit.runtime.asynchronous`)."""
    runnable: bool
    """autosplit plans and runs it (every entry today; one that is not would be refused by name)."""
    summary: str
    """One line for messages and the CLI's help."""
    rounds: Rounds = "any"
    """The micro-batch counts its class accepts (torch 2.13): ``"any"``; ``"at_least_stages"``
    (``Schedule1F1B``, ``ScheduleDualPipeV``: M ≥ stages); ``"whole_rounds"`` (interleaved 1F1B and
    zero bubble: rounds of ``max(1, M // pp)`` micro-batches must divide M)."""

    @property
    def distributed(self) -> bool:
        """``autosplit.distribute`` runs it: on a torch schedule class, or autosplit's asynchronous loop."""
        return self.runnable and (self.torch_class is not None or self.asynchronous)

    @property
    def forwards_first(self) -> bool:
        """Every forward of a step runs before any backward (what a measured pass replays)."""
        return self.order == "fill_drain"

    @property
    def micro_batched(self) -> bool:
        """The batch is cut into micro-batches (``sequential`` runs it whole: always 1)."""
        return self.order != "sequential"

    @property
    def one_process(self) -> bool:
        """The stages run in turn in one process (their optimizer steps too)."""
        return self.order == "sequential"

    def require_runnable(self, said: str | None = None) -> Schedule:
        """This entry, or a :class:`ConstraintError` saying autosplit cannot plan or run it yet.
        ``said``: how the caller named it, e.g. ``"option schedule='ZBVZeroBubble'"``."""
        if not self.runnable:
            what = said or f"schedule {self.name!r}"
            raise ConstraintError(advice(
                f"{what} names torch's {self.torch_class}, which autosplit cannot plan or run yet",
                f"autosplit plans one stage per rank with a modelled order ({', '.join(SCHEDULES)}); torch's multi-stage "
                f"and zero-bubble schedules ({self.summary}) need their own step and memory model, a later issue",
                f"choose one of {SCHEDULES}, or run torch.distributed.pipelining.{self.torch_class} on stages you build",
            ))
        return self

    def replayed(self, stages_per_rank: int) -> bool:
        """The solver's closed form only approximates how torch runs this schedule (several stages
        per rank, or a split backward): the replay of its action lists judges the split
        (``compiler/refine.py``), and the step is bounded apart (``compiler/prediction.step_bound``)."""
        return self.torch_class is not None and (stages_per_rank > 1 or self.split_backward)

    def backward_in_weight_pass(self, stage: int) -> bool:
        """Stage ``stage`` runs its whole backward in its weight pass (W), none in its input pass
        (I): torch's first stage of a split backward, whose inputs need no gradient, skips the input
        pass and runs one plain backward in the weight pass (``PipelineStage.backward_one_chunk`` and
        ``backward_weight_one_chunk``, torch 2.13)."""
        return self.split_backward and stage == 0

    def rank_of(self, stage: int, stages: int, ranks: int) -> int:
        """The rank that holds stage ``stage`` of ``stages`` on ``ranks`` ranks (torch's own maps:
        ``"loop"`` stage s on rank s mod pp, ``"v"`` rank r holds r and 2·pp − 1 − r)."""
        if self.placement == "v":
            return stage if stage < ranks else stages - 1 - stage
        return stage % ranks

    def refusal(self, *, ranks: int, stages: int, micro_batches: int) -> str | None:
        """Why torch's class (or autosplit's runtime) cannot run ``stages`` stages on ``ranks`` ranks
        with ``micro_batches`` micro-batches — the rule, in words — or None when it can."""
        low, high = self.stages_per_rank
        if ranks < 1 or stages % ranks:
            return f"{self.name} puts the same number of stages on every rank, and {stages} stages do not divide into {ranks} ranks"
        v = stages // ranks
        if v < low or (high is not None and v > high):
            allowed = f"exactly {low}" if low == high else f"at least {low}" if high is None else f"{low} to {high}"
            return f"{self.name} runs {allowed} stage(s) per rank, not {v}"
        M = micro_batches
        if M < 1:
            return f"{self.name} needs at least one micro-batch, not {M}"
        if self.rounds == "at_least_stages" and M < stages:
            return f"{self.name} needs at least as many micro-batches as stages ({stages}), not {M}"
        if self.rounds == "whole_rounds" and M % max(1, M // ranks):
            return (f"{self.name} runs micro-batches in rounds of max(1, M // pp) = {max(1, M // ranks)}, "
                    f"which must divide M = {M} (torch's rule)")
        return None

    def check(self, *, ranks: int, stages: int, micro_batches: int) -> Schedule:
        """This entry, or a :class:`ConstraintError` naming the rule :meth:`refusal` finds broken."""
        why = self.refusal(ranks=ranks, stages=stages, micro_batches=micro_batches)
        if why is not None:
            counts = [m for m in range(1, 4 * stages + 1) if self.refusal(ranks=ranks, stages=stages, micro_batches=m) is None]
            raise ConstraintError(advice(
                f"schedule {self.name!r} with {stages} stages on {ranks} ranks and {micro_batches} micro-batches",
                why,
                (f"micro_batches in {counts[:8]}" if counts else f"another number of stages per rank (allowed: {self.stages_per_rank})")
                + ", or another schedule",
            ))
        return self

    def actions(self, ranks: int, micro_batches: int, stages_per_rank: int = 1) -> tuple[tuple[Action, ...], ...]:
        """Every rank's work in one step, in the order it runs it: GPipe and 1F1B as
        :meth:`stage_order`; torch's multi-stage schedules as their classes order it (torch's
        ``get_schedule_ops``; DualPipeV's overlapped pairs as the forward, then the backward)."""
        stages = ranks * stages_per_rank
        self.check(ranks=ranks, stages=stages, micro_batches=micro_batches)
        if self.order != "torch":
            return tuple(
                tuple(Action("F" if k == "forward" else "B", s, m) for k, m in self.stage_order(s, stages, micro_batches))
                for s in range(stages)
            )
        assert self.torch_class is not None
        return _torch_actions(self.torch_class, ranks, micro_batches, stages_per_rank)

    def in_flight(self, stage: int, stages: int, micro_batches: int, ranks: int | None = None) -> int:
        """Micro-batches whose activations stage ``stage`` of ``stages`` holds at its peak (DESIGN
        §4.2): sequential 1; GPipe all M; 1F1B ``min(M, S − s)``; asynchronous ``S − s`` (no flush:
        the next mini-batch's micro-batches are in flight too); torch's multi-stage schedules, counted
        on their action lists (forward to the end of the backward, its weight part included) over
        ``ranks`` ranks (default: one stage per rank)."""
        self.require_runnable()
        if self.order == "sequential":
            return 1
        if self.order == "fill_drain":
            return micro_batches
        if self.order == "1f1b":
            return min(micro_batches, stages - stage)
        if self.order == "torch":  # the most its rank's moments hold of it (:meth:`peak_counts`)
            ranks = ranks or stages
            rank = self.rank_of(stage, stages, ranks)
            mine = [s for s in range(stages) if self.rank_of(s, stages, ranks) == rank]
            return max(moment[mine.index(stage)] for moment in _peak_counts(self, stages, micro_batches, ranks)[rank])
        return stages - stage  # async_1f1b

    def peak_counts(self, stages: int, micro_batches: int, ranks: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """[rank][peak] the micro-batches whose activations each of the rank's stages (in stage order)
        holds at the moments its memory may peak, counted on its action list as :meth:`in_flight`
        counts them: after each forward, the counts kept only where no other moment holds as many or
        more on every stage (one of these is the rank's peak, whatever each stage's activations weigh).
        A rank's stages peak at different moments — on 8 ranks × 5 stages and 64 micro-batches the
        first rank's stages peak at 16, 16, 15, 8, 8 micro-batches, but together at no more than 47 of
        those 63 — so a rank's memory is its stages' held memory at its worst moment, not their peaks
        summed. Empty with one stage per rank (a stage's peak is its rank's)."""
        return _peak_counts(self, stages, micro_batches, ranks) if self.order == "torch" and stages > ranks else ()

    def stage_order(self, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
        """The work stage ``stage`` runs in one flushed step, in order: ``("forward" | "backward",
        micro-batch)`` (GPipe as ``ScheduleGPipe``, micro-batch 0 first; 1F1B as ``Schedule1F1B``)."""
        self.require_runnable()
        M = micro_batches
        if self.order == "fill_drain":
            return [("forward", m) for m in range(M)] + [("backward", m) for m in range(M)]
        if self.order == "1f1b":
            warmup = min(stages - stage - 1, M)
            order = [("forward", m) for m in range(warmup)]
            for m in range(M - warmup):
                order += [("forward", warmup + m), ("backward", m)]
            return order + [("backward", m) for m in range(M - warmup, M)]
        if self.order == "sequential":
            return [(kind, m) for m in range(M) for kind in ("forward", "backward")]
        raise ConstraintError(advice(
            f"schedule {self.name!r} has no order of one stage alone",
            "an asynchronous schedule runs across mini-batches without a flush; torch's multi-stage schedules "
            "order the work of a rank, several stages at once",
            "read the order from autosplit.solver.asynchronous.async_order, or Schedule.actions",
        ))

    def fewest_micro_batches(self, stages: int, ranks: int | None = None) -> int:
        """The fewest micro-batches its torch class runs a step in (torch 2.13)."""
        ranks = ranks or stages
        return next(m for m in range(1, 4 * stages + 2) if self.refusal(ranks=ranks, stages=stages, micro_batches=m) is None)


@functools.lru_cache(maxsize=256)
def _peak_counts(schedule: Schedule, stages: int, micro_batches: int, ranks: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    out = []
    for work in schedule.actions(ranks, micro_batches, stages // ranks):
        mine = sorted({a.stage for a in work})
        held, moments = dict.fromkeys(mine, 0), set()
        for a in work:
            if a.kind in ("F", "B", "W"):
                held[a.stage] += 1 if a.kind == "F" else -1
                if a.kind == "F":
                    moments.add(tuple(held[s] for s in mine))
        kept: list[tuple[int, ...]] = []
        for m in sorted(moments, key=lambda m: (-sum(m), m)):  # whatever holds as many on every stage comes first
            if not any(all(x <= y for x, y in zip(m, k)) for k in kept):
                kept.append(m)
        out.append(tuple(kept))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _torch_actions(torch_class: str, ranks: int, micro_batches: int, stages_per_rank: int) -> tuple[tuple[Action, ...], ...]:
    """torch's own per-rank order for a multi-stage schedule class: the class built over stand-in
    stages, as torch's schedule visualizer builds it (no process group; its ``pipeline_order`` is
    what the class runs), for any number of stages per rank (the visualizer refuses one). Imports
    torch (only here)."""
    import warnings
    from unittest import mock

    from torch.distributed import pipelining

    stand_in = mock.create_autospec(pipelining.PipelineStage, instance=True)
    stand_in.group_rank, stand_in.group_size, stand_in.submod = 0, ranks, None
    stand_in.num_stages = ranks * stages_per_rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = getattr(pipelining, torch_class)([stand_in] * stages_per_rank, micro_batches)
    ops = [built.pipeline_order[r] for r in range(ranks)]
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}

    def flat(action: Any) -> list[Action]:
        if action is None:
            return []
        if action.sub_actions:  # DualPipeV's overlapped forward and backward
            return [a for sub in action.sub_actions for a in flat(sub)]
        kind = kinds.get(action.computation_type.name)
        return [] if kind is None else [Action(kind, action.stage_index, action.microbatch_index)]  # type: ignore[arg-type]

    return tuple(tuple(a for action in rank for a in flat(action)) for rank in ops)


_ONE_PER_RANK = (1, 1)
_ENTRIES = (
    Schedule("sequential", "sequential", flushes=True, asynchronous=False, weights="current", placement="linear",
             stages_per_rank=_ONE_PER_RANK, split_backward=False, torch_class=None, runnable=True,
             summary="one batch, the stages in turn, in one process"),
    Schedule("gpipe", "fill_drain", flushes=True, asynchronous=False, weights="current", placement="linear",
             stages_per_rank=_ONE_PER_RANK, split_backward=False, torch_class="ScheduleGPipe", runnable=True,
             summary="all forwards, then all backwards (GPipe)"),
    Schedule("1f1b", "1f1b", flushes=True, asynchronous=False, weights="current", placement="linear",
             stages_per_rank=_ONE_PER_RANK, split_backward=False, torch_class="Schedule1F1B", runnable=True,
             summary="one forward, one backward (PipeDream-Flush): each stage holds at most S − s micro-batches",
             rounds="at_least_stages"),
    Schedule("xpipe", "async_1f1b", flushes=False, asynchronous=True, weights="predicted", placement="linear",
             stages_per_rank=_ONE_PER_RANK, split_backward=False, torch_class=None, runnable=True,
             summary="asynchronous, forwards on predicted weights (XPipe)"),
    Schedule("async", "async_1f1b", flushes=False, asynchronous=True, weights="current", placement="linear",
             stages_per_rank=_ONE_PER_RANK, split_backward=False, torch_class=None, runnable=True,
             summary="asynchronous, forwards on the current weights"),
    Schedule("pipedream", "async_1f1b", flushes=False, asynchronous=True, weights="stashed", placement="linear",
             stages_per_rank=_ONE_PER_RANK, split_backward=False, torch_class=None, runnable=True,
             summary="asynchronous, weight stashing (PipeDream)"),
    Schedule("interleaved1f1b", "torch", flushes=True, asynchronous=False, weights="current", placement="loop",
             stages_per_rank=(1, None), split_backward=False, torch_class="ScheduleInterleaved1F1B", runnable=True,
             summary="interleaved 1F1B, several looped stages per rank", rounds="whole_rounds"),
    Schedule("loopedbfs", "torch", flushes=True, asynchronous=False, weights="current", placement="loop",
             stages_per_rank=(1, None), split_backward=False, torch_class="ScheduleLoopedBFS", runnable=True,
             summary="looped breadth-first, several looped stages per rank"),
    Schedule("interleavedzerobubble", "torch", flushes=True, asynchronous=False, weights="current", placement="loop",
             stages_per_rank=(1, None), split_backward=True, torch_class="ScheduleInterleavedZeroBubble", runnable=True,
             summary="interleaved zero bubble, backward split into input and weight gradients", rounds="whole_rounds"),
    Schedule("zbvzerobubble", "torch", flushes=True, asynchronous=False, weights="current", placement="v",
             stages_per_rank=(2, 2), split_backward=True, torch_class="ScheduleZBVZeroBubble", runnable=True,
             summary="zero bubble on a V of two stages per rank"),
    Schedule("dualpipev", "torch", flushes=True, asynchronous=False, weights="current", placement="v",
             stages_per_rank=(2, 2), split_backward=True, torch_class="ScheduleDualPipeV", runnable=True,
             summary="DualPipe on a V of two stages per rank", rounds="at_least_stages"),
)

REGISTRY: dict[str, Schedule] = {s.name: s for s in _ENTRIES}
"""Every schedule autosplit knows, by its name (runnable or not)."""
SCHEDULES: tuple[str, ...] = tuple(s.name for s in _ENTRIES if s.runnable)
"""The names of the schedules autosplit plans and runs (``PlanOptions.schedule``)."""
ASYNCHRONOUS: tuple[str, ...] = tuple(s.name for s in _ENTRIES if s.asynchronous)
"""The asynchronous ones (no flush between mini-batches)."""

_BY_NAME: dict[str, Schedule] = {}
for _s in _ENTRIES:
    for _key in (_s.name, _s.torch_class, _s.torch_class and _s.torch_class.removeprefix("Schedule")):
        if _key:
            _BY_NAME.setdefault(_key.lower(), _s)


def lookup(name: Any) -> Schedule:
    """The entry of schedule ``name`` — autosplit's name, or torch's class name with or without
    ``Schedule`` — in any case; a :class:`ConstraintError` listing the known names otherwise.
    Not-runnable entries are returned too (:meth:`Schedule.require_runnable` refuses them)."""
    entry = _BY_NAME.get(name.lower()) if isinstance(name, str) else None
    if entry is not None:
        return entry
    if isinstance(name, str) and name.lower() in OBJECTIVES:
        raise ConstraintError(advice(
            f"{name!r} is an objective, not a schedule",
            "the objective says what the solver minimises, the schedule the order of work per stage",
            f"pass objective={name.lower()!r}, and a schedule from {SCHEDULES} for pipeline plans",
        ))
    raise ConstraintError(advice(
        f"unknown schedule {name!r}",
        f"autosplit knows the schedules {tuple(REGISTRY)} (torch's class names too, in any case); "
        f"it plans and runs {SCHEDULES}",
        f"choose one of {SCHEDULES}",
    ))


def runnable(name: Any) -> Schedule:
    """:func:`lookup`, refusing a schedule autosplit cannot plan or run yet."""
    return lookup(name).require_runnable()
