"""The gloo groups the multi-process tests run their cases in (``tests.helpers.Gloo``, the ``gloo``
fixture): values come back by case and rank, a failing case is named with each rank's traceback,
and the group that failed is replaced by a fresh one. One group per world size serves every file:
the tests that start processes share one xdist worker (``tests/conftest.py``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


def _sum_of_ranks(offset: int, *, rank: int, world: int) -> int:
    total = torch.tensor([rank + offset])
    dist.all_reduce(total)
    return int(total)


def _refuses_on(failing: int, *, rank: int, world: int) -> None:
    if rank == failing or failing < 0:
        raise ValueError(f"rank {rank} refuses")
    dist.barrier()


def _exits(*, rank: int, world: int) -> None:
    if rank == 0:
        os._exit(3)
    dist.barrier()


def _ends_its_group(*, rank: int, world: int) -> int:
    dist.destroy_process_group()
    return rank


def test_each_case_runs_on_every_rank_and_returns_by_rank(gloo):
    group = gloo(2)
    assert group.run(_sum_of_ranks, [(0,), (10,)]) == [[1, 1], [21, 21]]
    assert group.run(_ends_its_group, [()]) == [[0, 1]]
    assert group.run(_sum_of_ranks, [(1,)]) == [[3, 3]], "the ranks start another process group after a case ended it"
    assert gloo(2) is group, "one group per world size"


def test_a_failing_case_is_named_with_each_ranks_traceback_and_the_group_replaced(gloo):
    group = gloo(2)
    with pytest.raises(pytest.fail.Exception) as failed:
        group.run(_refuses_on, [(-1,)])
    text = str(failed.value)
    assert "case _refuses_on(-1,) failed on 2 gloo processes" in text
    assert "-- rank 0: Traceback" in text and "ValueError: rank 0 refuses" in text and "ValueError: rank 1 refuses" in text
    assert group.closed and gloo(2) is not group
    # One rank fails, its peer waits at the case's barrier: stopped after a grace period, named as such.
    with pytest.raises(pytest.fail.Exception, match=r"(?s)rank 0: no result within \d+ s of the failure.*rank 1 refuses"):
        gloo(2).run(_refuses_on, [(1,)])
    with pytest.raises(pytest.fail.Exception, match=r"(?s)case _exits\(\) failed.*rank 0: the process exited with code 3"):
        gloo(2).run(_exits, [()])
    assert gloo(2).run(_sum_of_ranks, [(0,)]) == [[1, 1]]


def test_every_test_that_starts_processes_runs_in_one_group_of_the_session(request):
    """The ``gloo`` fixture lives as long as the session, and the tests that use it, or launch torchrun,
    share one xdist group: one worker runs them, in turn, on the same groups. Under xdist the group
    shows in each node id (``…@processes``): where a pytest release stops xdist from writing it
    (pytest-xdist#1386), the groups are gone and this fails."""
    from tests.conftest import PROCESSES, starts_processes

    assert request._fixturemanager.getfixturedefs("gloo", request.node)[-1].scope == "session"
    items = request.session.items
    launching = [item for item in items if starts_processes(item)]
    assert any("gloo" in item.fixturenames for item in launching), "this file's own gloo tests were found"
    grouped = os.environ.get("PYTEST_XDIST_WORKER") is not None and request.config.getvalue("loadgroup")
    for item in items:
        group = PROCESSES if item in launching else item.path.relative_to(request.config.rootpath).as_posix()
        assert [mark.args[0] for mark in item.iter_markers("xdist_group")] == [group], item.nodeid
        assert item.nodeid.endswith(f"@{group}") or not grouped, f"xdist did not group {item.nodeid} (pytest-xdist#1386)"
