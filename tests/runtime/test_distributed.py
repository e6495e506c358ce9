"""The distributed runtime across processes (gloo): pipelined training equals unsplit training.

Every worker runs several models through ``autosplit.distribute`` and, beside it, the unsplit
model on the same global batch in the same process (float64, seeded). Losses, every gradient
and the parameters after 3 Adam steps must agree. Models with BatchNorm are compared with the
*micro-batched* reference (the unsplit model run micro-batch by micro-batch, the losses
averaged): a pipeline normalises each micro-batch with its own statistics, so it cannot equal
full-batch BatchNorm, and it should not pretend to.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Literal

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import NO_SEARCH, InceptionNet, as_float64, full_tensor, gpt2_lm, gpt_case, reference_step, where

MICRO = 2


STEPS = 3


def _gpt2():
    ids = torch.randint(0, 60, (8, 8))
    return gpt2_lm(), (ids,), {}, torch.randint(0, 60, (8, 8)), lambda out, t: F.cross_entropy(
        out["logits"].flatten(0, 1), t.flatten()
    )


def _inception():
    return InceptionNet(), (torch.randn(8, 3, 12, 12),), {}, torch.randint(0, 5, (8,)), F.cross_entropy


def _gnmt():
    from benchmarks.workloads.models import GNMT

    src, tgt = torch.randint(0, 30, (8, 5)), torch.randint(0, 30, (8, 4))
    return GNMT(vocab=30, hidden=8, layers=3), (src, tgt), {}, torch.randint(0, 30, (8, 4)), lambda out, t: F.cross_entropy(
        out.flatten(0, 1), t.flatten()
    )


MODELS = {"gpt": gpt_case, "gpt2": _gpt2, "inception": _inception, "gnmt": _gnmt}


BATCHNORM = {"inception"}


def _mismatch(key: str, stored, value) -> Callable[[str], str]:
    """A ``msg=`` naming the entry and both values, formatted only when they differ."""
    return lambda message: f"{key}: {stored} vs {value}: {message}"


def _run_case(name: str, schedule: str, dp: int, replicate: Literal["replicate", "fully_shard"], rank: int, world: int) -> None:
    import autosplit

    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = MODELS[name]()
    model = model.double()
    args, kwargs = tuple(as_float64(a) for a in args), {k: as_float64(v) for k, v in kwargs.items()}
    reference = copy.deepcopy(model)
    replica, rows = rank % dp, args[0].shape[0] // dp
    mine = slice(replica * rows, (replica + 1) * rows)
    my_args = tuple(a[mine] for a in args)
    my_kwargs = {k: v[mine] for k, v in kwargs.items()}
    pipe = autosplit.distribute(
        model, ["cpu"] * world, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn,  # the whole mesh, the global batch
        data_parallel=dp, replicate=replicate, schedule=schedule, micro_batches=MICRO, **NO_SEARCH,
    )
    assert len(set(pipe.plan.assignment.values())) == world // dp
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    assert {n for n, _ in pipe.named_parameters()} <= set(ref_params), "original names"
    for step in range(STEPS):
        loss = pipe.step(*my_args, target=target[mine], **my_kwargs)
        # dp replicas each see their rows: the mean over replicas of per-replica means is the global mean.
        expected = reference_step(reference, args, kwargs, target, loss_fn, chunks=MICRO * dp if name in BATCHNORM else 1)
        if pipe.is_last and dp == 1:
            torch.testing.assert_close(loss, expected, msg=where(f"{name} step {step} loss"))
        assert (loss is None) == (not pipe.is_last)
        for pname, p in pipe.named_parameters():
            torch.testing.assert_close(
                full_tensor(p.grad), ref_params[pname].grad, msg=where(f"{name} rank {rank} step {step} grad {pname}")
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for pname, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p), ref_params[pname], msg=where(f"{name} {pname} after {STEPS} steps"))
    if dp == 1:  # the gathered state dict loads into the unsplit model and equals it
        full = pipe.full_state_dict()
        assert set(full) == set(reference.state_dict())
        fresh = copy.deepcopy(reference)
        fresh.load_state_dict(full)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(fresh.state_dict()[key], value, msg=_mismatch(key, full[key], value))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_training_equals_unsplit_training_on_two_processes(gloo, schedule):
    pytest.importorskip("transformers")
    gloo(2).run(_run_case, [(name, schedule, 1, "replicate") for name in MODELS])


@pytest.mark.parametrize("replicate", ["replicate", "fully_shard"])
def test_hybrid_two_stages_by_two_replicas_equals_unsplit_training(gloo, replicate):
    gloo(4).run(_run_case, [("gpt", "1f1b", 2, replicate), ("inception", "gpipe", 2, replicate)])
