"""Asynchronous pipelines (XPipe, PipeDream): the simulated order, version differences against
values derived by hand, weight stashing, and times that keep every dependency."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autosplit.errors import ConstraintError
from autosplit.solver.asynchronous import Work, async_order, simulate, stashed_versions


def sim(S, M, B, fwd=1.0, bwd=2.0, **kw):
    return simulate(stages=S, micro_batches=M, mini_batches=B, forward=[fwd] * S, backward=[bwd] * S, **kw)


def test_two_stages_two_micro_batches_by_hand():
    # Stage 0 keeps 2 micro-batches in flight: F00 F01 B00 F10 B01 U0 F11 B10 F20 B11 U1 F21 ...
    F, B, U = (lambda b, m: Work("forward", b, m)), (lambda b, m: Work("backward", b, m)), (lambda b: Work("update", b, -1))
    assert async_order(0, 2, 2, 3)[:11] == (F(0, 0), F(0, 1), B(0, 0), F(1, 0), B(0, 1), U(0), F(1, 1), B(1, 0), F(2, 0), B(1, 1), U(1))
    s = sim(2, 2, 3)
    # F10 runs before update 0 (u = 0, b = 1): s = 1; F11 after it: s = 0; F20: u = 1, s = 1; F21: s = 0.
    assert s.differences(0) == [0, 0, 1, 0, 1, 0]
    assert s.differences(1) == [0] * 6, "the last stage always sees the weights synchronous training would"


def test_four_stages_two_micro_batches_by_hand():
    # Stage 0: F00 F01 F10 F11 B00 F20 B01 U0 F21 B10 F30 B11 U1 F31: s = 0 0 1 1 2 1 2 1
    s = sim(4, 2, 4)
    assert s.differences(0) == [0, 0, 1, 1, 2, 1, 2, 1]
    # Stage 2 keeps 2 in flight, like stage 0 of a 2-stage pipeline.
    assert s.differences(2) == [0, 0, 1, 0, 1, 0, 1, 0]


@pytest.mark.parametrize("S", [2, 3, 4, 6])
def test_one_micro_batch_per_mini_batch_is_pipedream_staleness(S):
    # PipeDream (M = 1): stage s runs S − s − 1 updates behind in the steady state.
    s = sim(S, 1, 3 * S)
    for stage in range(S):
        assert s.differences(stage)[2 * S:] == [S - stage - 1] * S
        assert stashed_versions(s, stage) == S - stage, "PipeDream stashes one version per mini-batch in flight"


def test_no_version_difference_means_no_prediction_and_one_version():
    s = sim(1, 4, 3)  # one stage: every forward sees the weights its gradient is applied to
    assert s.differences(0) == [0] * 12 and stashed_versions(s, 0) == 1


@settings(max_examples=40, deadline=None, derandomize=True)
@given(S=st.integers(1, 5), M=st.integers(1, 4), B=st.integers(1, 5), times=st.lists(st.floats(0.1, 5.0), min_size=10, max_size=10))
def test_simulated_times_keep_every_dependency(S, M, B, times):
    fwd, bwd = times[:5][:S], times[5:][:S]
    s = simulate(stages=S, micro_batches=M, mini_batches=B, forward=fwd, backward=bwd, transfer=0.25)
    for stage in range(S):
        order = s.order[stage]
        assert len(order) == 2 * M * B + B
        for a, b in itertools.pairwise(order):
            assert s.end[stage, a] <= s.start[stage, b], "one thing at a time, in order"
        for w in order:
            if w.kind == "forward" and stage > 0:
                assert s.start[stage, w] >= s.end[stage - 1, w] + 0.25
            if w.kind == "backward":
                assert s.start[stage, w] >= s.end[stage, Work("forward", w.mini, w.micro)]
                if stage < S - 1:
                    assert s.start[stage, w] >= s.end[stage + 1, w] + 0.25
        assert all(d >= 0 for d in s.differences(stage))


def test_no_flush_beats_a_flushed_pipeline_in_the_steady_state():
    # Balanced stages, F = 1, B = 2: asynchronous 1F1B finishes a micro-batch every 3 units;
    # GPipe with a flush per mini-batch of M takes (S − 1 + M)·3 for M micro-batches.
    S, M = 4, 4
    s = sim(S, M, 8)
    assert s.throughput == pytest.approx(1 / 3)
    assert s.throughput > M / ((S - 1 + M) * 3)


def test_bad_counts_are_typed_errors():
    with pytest.raises(ConstraintError, match="at least 1"):
        sim(0, 1, 1)
    with pytest.raises(ConstraintError, match="runs no forward of mini-batch 5"):
        sim(2, 2, 3).version_difference(0, 5, 0)


def test_weight_copies_and_in_flight_of_the_asynchronous_schedules():
    from autosplit.solver.build import in_flight, weight_copies

    S = 4
    assert weight_copies("pipedream", S, 1) == (3, 2, 1, 0), "PipeDream stashes one version per mini-batch in flight"
    assert weight_copies("pipedream", S, 2) == (2, 1, 1, 0)
    assert weight_copies("async", S, 2) == (0,) * S
    assert weight_copies("xpipe", S, 2) == (1, 1, 1, 0), "XPipe keeps the weights aside where it predicts"
    for s in range(S):
        assert in_flight("pipedream", s, S, 2) == S - s, "no flush: the next mini-batch's micro-batches are in flight too"
        assert in_flight("1f1b", s, S, 2) == min(2, S - s)
