"""Asynchronous pipeline schedules across processes (gloo): XPipe, async and PipeDream train as
their rules say, checked against a one-process reference that applies the same rules to the
unsplit model, and against plain training when there is only one mini-batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autosplit.runtime.prediction import update_direction
from autosplit.solver.asynchronous import simulate
from autosplit.solver.build import weight_copies
from tests.helpers import NO_SEARCH

MICRO, LR = 2, 0.05


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))
    return model.double()


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)) for _ in range(n)]


def _pipeline_case(schedule, n, *, rank, world):
    """``n`` mini-batches through a 2-stage pipeline; rank 1 returns what the test checks."""
    import autosplit

    model, batches = _model(), _batches(n)
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(batches[0][0],), loss_fn=F.mse_loss,
                                schedule=schedule, micro_batches=MICRO, **NO_SEARCH, pin={"0": 0, "6": 1})
    opt = torch.optim.Adam(pipe.parameters(), lr=LR)
    losses = pipe.run(batches, optimizer=opt)
    names, runs = [None, None], [None, None]
    dist.all_gather_object(names, [name for name, _ in pipe.named_parameters()])
    dist.all_gather_object(runs, pipe.last_run)
    state = pipe.full_state_dict()
    if rank == 1:
        return {"state": state, "losses": losses, "stage0": names[0], "runs": runs, "plan": pipe.plan.schedule}
    return None


def _run(gloo, schedule, n):
    return gloo(2).run(_pipeline_case, [(schedule, n)])[0][1]


def reference(schedule, n, stage0):
    """The schedule's rules on the unsplit model in one process: stage 0's forward of micro-batch
    (b, m) on the weights after ``u = b − s`` of its updates (XPipe: predicted ``s`` updates on),
    its backward on those (PipeDream) or on the weights of its time, ``W_b`` (async, XPipe);
    stage 1 always on ``W_b`` (the last stage's version difference is 0)."""
    model, batches = _model(), _batches(n)
    params = dict(model.named_parameters())
    first = [params[k] for k in stage0]
    rest = [p for k, p in params.items() if k not in stage0]
    opt0, opt1 = torch.optim.Adam(first, lr=LR), torch.optim.Adam(rest, lr=LR)
    sim = simulate(stages=2, micro_batches=MICRO, mini_batches=n, forward=[1, 1], backward=[2, 2])
    versions = [[p.detach().clone() for p in first]]  # stage 0's weights after u updates
    directions: list = [[None] * len(first)]          # and Adam's direction then
    losses = []
    for b, (x, y) in enumerate(batches):
        now = [p.detach().clone() for p in first]
        total = 0.0
        for m in range(MICRO):
            rows = slice(m * 8 // MICRO, (m + 1) * 8 // MICRO)
            gap = sim.version_difference(0, b, m)
            fwd = versions[b - gap]
            if schedule == "xpipe" and gap:
                fwd = [w if d is None else w - LR * gap * d for w, d in zip(fwd, directions[b - gap])]
            with torch.no_grad():
                for p, w in zip(first, fwd):
                    p.copy_(w)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # backward reads the live weights
                loss = F.mse_loss(model(x[rows]), y[rows]) / MICRO
            with torch.no_grad():
                for p, w in zip(first, versions[b - gap] if schedule == "pipedream" else now):
                    p.copy_(w)
            loss.backward()
            with torch.no_grad():
                for p, w in zip(first, now):
                    p.copy_(w)
            total += float(loss.detach()) * MICRO
        losses.append(total / MICRO)
        opt0.step()
        opt1.step()
        opt0.zero_grad()
        opt1.zero_grad()
        versions.append([p.detach().clone() for p in first])
        directions.append([update_direction(opt0, p).clone() for p in first])
    return model.state_dict(), losses


@pytest.mark.parametrize("schedule", ["xpipe", "async", "pipedream"])
def test_asynchronous_schedules_follow_their_rules(gloo, schedule):
    got = _run(gloo, schedule, 4)
    assert got["plan"] == schedule, "the plan records the schedule it runs"
    assert got["stage0"] and len(got["stage0"]) < 8, "the model is split across both stages"
    state, losses = reference(schedule, 4, got["stage0"])
    for k, v in state.items():
        torch.testing.assert_close(got["state"][k], v, msg=k)
    torch.testing.assert_close(torch.stack(got["losses"]), torch.tensor(losses, dtype=torch.float64))
    # The last stage's forwards always see the weights their gradient updates; stage 0 runs ahead.
    first, last = got["runs"]
    assert last["version_differences"] == [0] * (4 * MICRO) and any(first["version_differences"])
    # PipeDream stashes as many copies as the memory model charges; the others none.
    copies = weight_copies("pipedream", 2, MICRO)
    assert copies == (1, 0)
    assert (first["stashed_copies"], last["stashed_copies"]) == (copies if schedule == "pipedream" else (0, 0))


@pytest.mark.smoke  # the fast tier's case of this runtime path
def test_the_schedules_differ_and_one_mini_batch_is_plain_training(gloo):
    finals = {}
    for schedule in ("xpipe", "async", "pipedream"):
        finals[schedule] = reference(schedule, 4, ["0.weight", "0.bias", "2.weight", "2.bias"])[0]
    differ = lambda a, b: any(not torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    assert differ(finals["xpipe"], finals["async"]) and differ(finals["async"], finals["pipedream"])

    got = _run(gloo, "xpipe", 1)  # no update mid-run: every schedule is plain training
    model, ((x, y),) = _model(), _batches(1)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    F.mse_loss(model(x), y).backward()
    opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got["state"][k], v, msg=k)


def test_step_and_run_refuse_the_other_kind_of_schedule(gloo):
    gloo(2).run(_refusals, [()])


def _refusals(*, rank, world):
    import autosplit
    from autosplit.errors import ConstraintError, DistributedError

    model, batches = _model(), _batches(1)
    pipe = autosplit.distribute(copy.deepcopy(model), ["cpu"] * 2, example_inputs=(batches[0][0],), loss_fn=F.mse_loss,
                                schedule="pipedream", micro_batches=MICRO, **NO_SEARCH)
    with pytest.raises(DistributedError, match=r"call pipe\.run"):
        pipe.step(batches[0][0], target=batches[0][1])
    with pytest.raises(ConstraintError, match="without momentum"):
        xpipe = autosplit.distribute(copy.deepcopy(model), ["cpu"] * 2, example_inputs=(batches[0][0],),
                                     loss_fn=F.mse_loss, schedule="xpipe", micro_batches=MICRO, **NO_SEARCH)
        xpipe.run(batches, optimizer=torch.optim.SGD(xpipe.parameters(), lr=0.1))
    with pytest.raises(DistributedError, match="one replica so far"):
        autosplit.distribute(copy.deepcopy(model), ["cpu"] * 2, example_inputs=(torch.cat([batches[0][0]] * 2),), loss_fn=F.mse_loss,
                             schedule="async", micro_batches=MICRO, data_parallel=2, **NO_SEARCH)
    sync = autosplit.distribute(copy.deepcopy(model), ["cpu"] * 2, example_inputs=(batches[0][0],), loss_fn=F.mse_loss,
                                micro_batches=MICRO, **NO_SEARCH)
    with pytest.raises(DistributedError, match=r"run\(\) trains with asynchronous schedules"):
        sync.run(batches, optimizer=torch.optim.Adam(sync.parameters()))
