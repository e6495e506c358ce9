"""The replayed step (autosplit/solver/replay.py): torch's action lists as a list schedule, against
the closed forms where they are exact, and the memory the same lists hold."""

import random

import pytest

from autosplit import schedules
from autosplit.errors import SolverError
from autosplit.schedules import Action
from autosplit.solver.replay import StageWork, peaks, replay

MULTI = ["interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev"]


def _run(name, ranks, M, v, work):
    entry = schedules.lookup(name)
    S = ranks * v
    actions = entry.actions(ranks, M, v)
    return actions, replay(actions, rank_of=[entry.rank_of(s, S, ranks) for s in range(S)], durations=work)


def test_gpipe_replays_to_the_closed_form_when_one_stage_is_slowest_both_ways():
    rng = random.Random(0)
    for _ in range(200):
        S, M = rng.randint(1, 5), rng.randint(1, 9)
        f = [rng.uniform(0.1, 2.0) for _ in range(S)]
        _, run = _run("gpipe", S, M, 1, [StageWork(x, 0.9 * x, 1.1 * x) for x in f])
        t = [3 * x for x in f]
        assert run.step == pytest.approx(sum(t) + (M - 1) * max(t))


def test_1f1b_replays_to_the_closed_form_on_equal_stages_and_never_above_it():
    rng = random.Random(1)
    for S in range(1, 6):
        for M in range(S, 10):
            _, run = _run("1f1b", S, M, 1, [StageWork(1, 1, 1)] * S)
            assert run.step == pytest.approx(3 * S + (M - 1) * 3)
    for _ in range(200):
        S = rng.randint(1, 5)
        M = rng.randint(S, 9)
        f = [rng.uniform(0.1, 2.0) for _ in range(S)]
        _, run = _run("1f1b", S, M, 1, [StageWork(x, 0.9 * x, 1.1 * x) for x in f])
        t = [3 * x for x in f]
        assert run.step <= sum(t) + (M - 1) * max(t) + 1e-9  # the formula is exact only when stages are equal


@pytest.mark.parametrize("pp, v, M", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 3, 6)])
def test_interleaved_1f1b_on_equal_stages_has_megatrons_bubble(pp, v, M):
    # Narayanan et al. 2021, §2.2.2: the bubble shrinks by v — (M + (pp − 1)/v) · (v · t) for a stage time t
    _, run = _run("interleaved1f1b", pp, M, v, [StageWork(1, 1, 1)] * (pp * v))
    assert run.step == pytest.approx((M + (pp - 1) / v) * v * 3)


@pytest.mark.parametrize("name", MULTI)
def test_every_multi_stage_schedule_replays_each_action_once_after_its_inputs(name):
    pp, M, v = 4, 8, 2
    S = pp * v
    entry = schedules.lookup(name)
    rank_of = [entry.rank_of(s, S, pp) for s in range(S)]
    rng = random.Random(2)
    work = [StageWork(rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5)) for _ in range(S)]
    delay = [0.25] * (S - 1)
    actions = entry.actions(pp, M, v)
    run = replay(actions, rank_of=rank_of, durations=work, delay=delay)
    when = {}
    for r, rank in enumerate(actions):
        for a, t0, t1 in zip(rank, run.start[r], run.end[r]):
            assert rank_of[a.stage] == r and (a.stage, a.kind, a.micro) not in when
            when[a.stage, a.kind, a.micro] = (t0, t1)
        assert all(e <= s for e, s in zip(run.end[r], run.start[r][1:])), "a rank runs one action at a time"
    for s in range(S):
        for m in range(M):
            backward = "I" if (s, "I", m) in when else "B"  # DualPipeV splits some backwards, not all
            assert (s, "F", m) in when and (s, backward, m) in when
            assert ((s, "W", m) in when) == (backward == "I")
            if s > 0:
                gap = 0.0 if rank_of[s] == rank_of[s - 1] else 0.25
                assert when[s, "F", m][0] >= when[s - 1, "F", m][1] + gap - 1e-12
            if s < S - 1:
                gap = 0.0 if rank_of[s] == rank_of[s + 1] else 0.25
                after = when.get((s + 1, "I", m)) or when[s + 1, "B", m]
                assert when[s, backward, m][0] >= after[1] + gap - 1e-12
            if backward == "I":
                assert when[s, "W", m][0] >= when[s, "I", m][1]
    busiest = max(sum(w.forward + w.backward_input + w.backward_weight for s, w in enumerate(work) if rank_of[s] == r)
                  for r in range(pp))
    assert run.step >= M * busiest - 1e-9


def test_zero_bubble_fills_the_bubble_interleaved_1f1b_leaves():
    pp, M = 4, 8
    work = [StageWork(1, 1, 1)] * (2 * pp)
    steps = {name: _run(name, pp, M, 2, work)[1].step for name in MULTI}
    assert steps["interleavedzerobubble"] < steps["interleaved1f1b"]
    assert steps["zbvzerobubble"] < steps["interleaved1f1b"]
    assert min(steps.values()) >= M * 2 * 3  # no rank does its work in less than the sum of it


def test_a_delay_between_ranks_is_paid_both_ways_and_a_turn_on_one_rank_is_free():
    _, run = _run("gpipe", 2, 1, 1, [StageWork(1, 2, 0), StageWork(3, 4, 0)])
    assert run.step == pytest.approx(1 + 3 + 4 + 2)
    run = replay(schedules.lookup("gpipe").actions(2, 1), rank_of=[0, 1], durations=[StageWork(1, 2, 0), StageWork(3, 4, 0)],
                 delay=[0.5])
    assert run.step == pytest.approx(1 + 0.5 + 3 + 4 + 0.5 + 2)
    run = replay([[Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0), Action("B", 0, 0)]], rank_of=[0, 0],
                 durations=[StageWork(1, 2, 0), StageWork(3, 4, 0)], delay=[0.5])
    assert run.step == pytest.approx(10)


def test_memory_follows_the_lists():
    for S, M in ((4, 8), (3, 3)):
        one = schedules.lookup("1f1b").actions(S, M)
        assert peaks(one, saved=[2.0] * S) == tuple(2.0 * min(M, S - s) for s in range(S))
        assert peaks(schedules.lookup("gpipe").actions(S, M), saved=[2.0] * S) == (2.0 * M,) * S
    # zero bubble: after I only what W needs stays, until W
    held = peaks([[Action("F", 0, 0), Action("F", 0, 1), Action("I", 0, 0), Action("I", 0, 1), Action("W", 0, 0), Action("W", 0, 1)]],
                 saved=[10.0], weight_held=[3.0])
    assert held == (20.0,)
    held = peaks([[Action("F", 0, 0), Action("I", 0, 0), Action("F", 0, 1), Action("W", 0, 0), Action("I", 0, 1), Action("W", 0, 1)]],
                 saved=[10.0], weight_held=[3.0])
    assert held == (13.0,)


def test_lists_that_wait_on_each_other_are_an_error_not_a_hang():
    stuck = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]]
    with pytest.raises(SolverError, match="wait on each other forever"):
        replay(stuck, rank_of=[0, 1], durations=[StageWork(1, 1, 1)] * 2)
