"""The distributed runtime's edges: checkpoints that move between split and unsplit models, and
bad input, a failing rank or a schedule it cannot run ending in a typed error on every rank —
never a hang."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import autosplit
from autosplit.examples import GPT
from tests.helpers import NO_SEARCH, says

TIMEOUT = 10


def _model():
    torch.manual_seed(0)
    return GPT(vocab=40, d_model=16, n_layers=2, n_heads=2, max_len=8), torch.randint(0, 40, (4, 8)), torch.randint(0, 40, (4, 8))


def _loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _checkpoint_case(tmp: str, *, rank: int, world: int) -> None:
    model, tokens, targets = _model()
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(tokens,), loss_fn=_loss, micro_batches=2, **NO_SEARCH)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    pipe.step(tokens, target=targets)
    opt.step()
    dcp.save(pipe.state_dict(), checkpoint_id=f"{tmp}/from_split")  # each rank writes its stage
    full = pipe.full_state_dict()  # collective: every rank gathers
    if rank == 0:
        torch.save(full, f"{tmp}/expected.pt")
    dist.barrier()
    # The other way: a checkpoint of the unsplit model (written by the test) loads into the stages.
    state = pipe.state_dict()
    dcp.load(state, checkpoint_id=f"{tmp}/from_unsplit")
    pipe.load_state_dict(state)
    unsplit = torch.load(f"{tmp}/unsplit.pt")
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value, unsplit[name], msg=name)


@pytest.mark.smoke  # the fast tier's case of this runtime path
def test_checkpoints_move_between_the_distributed_and_the_unsplit_model(gloo, tmp_path):
    # An unsplit model, trained differently, saved with DCP for the stages to load.
    model, tokens, targets = _model()
    torch.optim.SGD(model.parameters(), lr=0.5).zero_grad()
    _loss(model(tokens), targets).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "from_unsplit", no_dist=True)
    torch.save(model.state_dict(), tmp_path / "unsplit.pt")

    gloo(2, timeout=TIMEOUT).run(_checkpoint_case, [(str(tmp_path),)])

    # What the stages saved loads into a fresh unsplit model under the original names.
    fresh, _, _ = _model()
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "from_split", no_dist=True)
    fresh.load_state_dict(state)
    expected = torch.load(tmp_path / "expected.pt")
    assert set(expected) == set(fresh.state_dict())
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, expected[name], msg=name)
    assert not torch.equal(expected["blocks.0.fc.weight"], _model()[0].blocks[0].fc.weight), "the step changed it"


def _gloo_threads() -> int:
    """Threads of this process that gloo started (a process group's I/O loop and workers)."""
    names = (Path(task, "comm").read_text() for task in Path("/proc/self/task").iterdir())
    return sum("gloo" in name for name in names)


def _close_case(*, rank: int, world: int) -> None:
    from autosplit.runtime.distributed import _close_all

    model, tokens, targets = _model()

    def pipeline():
        pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(tokens,), loss_fn=_loss, micro_batches=2, **NO_SEARCH)
        pipe.step(tokens, target=targets)
        return pipe

    closed, dropped, kept = pipeline(), pipeline(), pipeline()
    del dropped  # its stages' reference cycles hold its process groups until a garbage collection
    closed.close()
    with pytest.raises(autosplit.errors.DistributedError, match="this pipeline was closed"):
        closed.step(tokens, target=targets)
    assert set(closed.state_dict()) == set(kept.state_dict()), "the weights stay with a closed pipeline"
    dist.destroy_process_group()
    _close_all()  # what runs at exit: closes `kept`, collects `dropped`
    assert _gloo_threads() == 0, f"rank {rank}: {_gloo_threads()} gloo threads outlive the process groups"


def test_closed_and_dropped_pipelines_let_their_process_groups_go_before_exit(gloo):
    """A gloo process group destructed only during interpreter teardown can abort the process
    (SIGABRT, "terminate called without an active exception", pytorch/pytorch#65513): close() and
    the exit hook leave none alive once destroy_process_group() has run."""
    gloo(2, timeout=TIMEOUT).run(_close_case, [()])  # the case ends the process group; the ranks start another after it


def _faults_case(tmp: str, other_plan: str, *, rank: int, world: int) -> float:
    model, tokens, targets = _model()
    with pytest.raises(autosplit.errors.DistributedError, match="process group has 2 ranks, but 3 devices were given"):
        autosplit.distribute(model, ["cpu"] * 3, example_inputs=(tokens,), loss_fn=_loss)
    with pytest.raises(autosplit.errors.DistributedError) as whole:  # the devices are the whole mesh, whatever the degrees
        autosplit.distribute(model, ["cpu"] * 4, example_inputs=(tokens,), loss_fn=_loss, tensor_parallel=2, data_parallel=2)
    says(whole, "the process group has 2 ranks, but 4 devices were given", "pp = 4 / (data_parallel 2 × tensor_parallel)",
         "pass 2 devices")
    with pytest.raises(autosplit.errors.PlanMismatchError, match="made for graph"):
        autosplit.distribute(model, None, example_inputs=(tokens,), loss_fn=_loss, plan=other_plan)
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(tokens,), loss_fn=_loss, micro_batches=2, **NO_SEARCH)
    bad = torch.zeros(4, 8, 3, dtype=torch.long) if pipe.is_last else targets  # the last stage's loss raises
    start = time.monotonic()
    with pytest.raises(autosplit.errors.DistributedError, match=f"rank {rank} \\(stage {rank} of 2") as err:
        pipe.step(tokens, target=bad)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT + 5, f"rank {rank} waited {elapsed:.1f}s"
    if pipe.is_last:
        assert "target" in str(err.value)
        while not Path(tmp, "rank0.ok").exists() and time.monotonic() - start < 3 * TIMEOUT:
            time.sleep(0.2)  # stay alive: the peer must fail by timeout, not by our exit
    with pytest.raises(autosplit.errors.DistributedError, match="failed in an earlier step"):
        pipe.step(tokens, target=targets)
    Path(tmp, f"rank{rank}.ok").write_text(f"{elapsed:.1f}")
    dist.destroy_process_group()  # the timed-out step closed its connections; the ranks start another group after this case
    return elapsed


def test_bad_input_and_a_failing_rank_end_in_typed_errors_on_every_rank(gloo, tmp_path):
    other = autosplit.plan(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), ["cpu"] * 2,
                           example_inputs=(torch.randn(4, 8),), **NO_SEARCH)
    other.save(tmp_path / "other.json")
    ((first, last),) = gloo(2, timeout=TIMEOUT).run(_faults_case, [(str(tmp_path), str(tmp_path / "other.json"))])
    assert first <= TIMEOUT + 5 and last <= TIMEOUT + 5
    assert (tmp_path / "rank0.ok").exists() and (tmp_path / "rank1.ok").exists()


def _refused_schedules_case(*, rank: int, world: int) -> list[str]:
    from tests.helpers import LinearStack

    lines = []
    refused: list[tuple[str, dict[str, Any]]] = [("ZBVZeroBubble", dict(stages_per_rank=3)), ("DualPipeV", dict(micro_batches=1)),
                                                 ("sequential", {}), ("zigzag", {})]
    for name, options in refused:
        try:
            autosplit.distribute(LinearStack(), ["cpu"], example_inputs=(torch.randn(4, 8),), loss_fn=F.mse_loss,
                                 schedule=name, **NO_SEARCH, **options)
        except autosplit.errors.ConstraintError as e:
            lines.append(f"{name} {type(e).__name__} {str(e).split('.')[0]}")
        else:
            raise AssertionError(f"{name} was not refused")
    return lines


def test_schedules_torch_cannot_run_so_are_refused_by_distribute_without_hanging(gloo):
    ((lines,),) = gloo(1).run(_refused_schedules_case, [()])  # one rank: a refusal that waited on a peer would hang
    assert lines[0] == "ZBVZeroBubble ConstraintError option stages_per_rank=3 is out of range"
    assert lines[1] == "DualPipeV ConstraintError schedule 'dualpipev' with 2 stages on 1 ranks and 1 micro-batches"
    assert lines[2] == "sequential ConstraintError schedule='sequential' cannot run pipelined"
    assert lines[3] == "zigzag ConstraintError schedule='zigzag' cannot run pipelined"
