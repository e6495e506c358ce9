"""Stages run in the plan's precision: a split model trains like the unsplit one under the same policy.

- ``"bf16-mixed"`` / ``"fp16-mixed"``: the unsplit reference runs its forward and loss under
  ``torch.autocast("cpu", dtype)``; parameters, gradients and Adam state stay fp32; fp16 is
  trained with a loss scaler (``torch.amp.GradScaler`` locally, the pipeline's own across processes).
- ``"bf16"``: the reference is ``model.to(torch.bfloat16)`` with bf16 inputs.
- Across 2 gloo processes, the static metadata of what crosses the stages carry the dtype autocast
  gives it (the same on the sending and the receiving rank), and a step whose scaled loss overflows
  is skipped on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autosplit
from autosplit.errors import ConstraintError
from autosplit.microbatch import split_batch
from autosplit.runtime.batches import capture_chain, meta_copy
from tests.helpers import NO_SEARCH, gpt_case, where

LOW = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "bf16": torch.bfloat16}
TOL: dict[str, dict[str, Any]] = {
    "bf16-mixed": {"rtol": 1e-3, "atol": 1e-4}, "fp16-mixed": {"rtol": 1e-3, "atol": 1e-4}, "bf16": {"rtol": 1e-2, "atol": 1e-3},
}
"""Split and unsplit run the same ops on the same shapes: only summation orders (a tied weight's two
gradients, an all-reduce) differ, and a bf16 parameter may round one step the other way."""
MICRO = 2
STEPS = 3


def _mlp_case():
    """An MLP whose every cut crosses a Linear's or a Tanh's output (low precision under autocast)."""
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, (torch.randn(8, 8),), {}, torch.randint(0, 4, (8,)), F.cross_entropy


CASES = {"gpt": gpt_case, "mlp": _mlp_case}


def _policy(precision: str):
    """What the reference runs its forward and loss under."""
    return torch.autocast("cpu", dtype=LOW[precision]) if precision.endswith("-mixed") else contextlib.nullcontext()


def _reference(model, precision: str):
    return copy.deepcopy(model).to(torch.bfloat16) if precision == "bf16" else copy.deepcopy(model)


def _inputs(args, precision: str):
    return tuple(a.to(torch.bfloat16) if precision == "bf16" and a.is_floating_point() else a for a in args)


def _reference_step(model, args, kwargs, target, loss_fn, precision, scaler, opt, chunks=MICRO):
    """The unsplit model micro-batch by micro-batch (the pipeline's shapes), gradients as the mean loss's."""
    losses = []
    for (a, k), t in zip(split_batch(_inputs(args, precision), kwargs, chunks), target.chunk(chunks)):
        with _policy(precision):
            loss = loss_fn(model(*a, **k), t) / chunks
        (loss if scaler is None else scaler.scale(loss)).backward()
        losses.append(loss.detach() * chunks)
    if scaler is not None:
        scaler.unscale_(opt)
    return torch.stack(losses).mean()


# -- one process ---------------------------------------------------------------------------------


def _step(opt: torch.optim.Optimizer, scaler) -> None:
    """One optimizer step (through ``scaler`` when there is one, as GradScaler drives it), gradients cleared."""
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16", "fp16-mixed"])
def test_a_split_model_trains_like_the_unsplit_one_in_the_plans_precision(precision):
    """Outputs, gradients and the parameters after 3 Adam steps (fp16: through GradScaler) agree; the
    mixed precisions keep fp32 master weights and Adam state, bf16 holds them in bf16."""
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = _mlp_case() if precision == "bf16" else gpt_case()
    reference = _reference(model, precision)
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, precision=precision, **NO_SEARCH)
    assert split.plan.precision == precision
    held = torch.bfloat16 if precision == "bf16" else torch.float32
    assert {p.dtype for p in split.parameters()} == {held}
    opt, ref_opt = torch.optim.Adam(split.parameters(), lr=1e-3), torch.optim.Adam(reference.parameters(), lr=1e-3)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")) if precision == "fp16-mixed" else (None, None)
    ref_params = dict(reference.named_parameters())
    for step in range(STEPS):
        with _policy(precision):  # the loss under the same autocast as the reference's (the split casts its stages itself)
            out = split(*args, **kwargs)
            loss = loss_fn(out, target)
        (loss if scaler is None else scaler.scale(loss)).backward()
        expected = _reference_step(reference, args, kwargs, target, loss_fn, precision, ref_scaler, ref_opt, chunks=1)
        if step == 0 and precision != "bf16":
            assert out.dtype == LOW[precision], "the last stage's head runs under autocast"
        torch.testing.assert_close(loss, expected, **TOL[precision], msg=where(f"step {step} loss"))
        if scaler is not None:
            scaler.unscale_(opt)
        for name, p in split.named_parameters():
            assert p.grad.dtype == held
            torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL[precision], msg=where(f"step {step} grad {name}"))
        _step(opt, scaler)
        _step(ref_opt, ref_scaler)
    for name, p in split.named_parameters():
        torch.testing.assert_close(p, ref_params[name], **TOL[precision], msg=where(f"{name} after {STEPS} steps"))
        assert {v.dtype for v in opt.state[p].values() if v.is_floating_point() and v.dim()} == {held}


@pytest.mark.parametrize("model_case", ["gpt", "mlp"])
def test_crossing_dtypes_are_what_autocast_gives_for_real_and_meta_models(model_case):
    """The chain's static metadata under bf16-mixed: the same from the model and from its copy on the meta
    device (where autocast casts nothing, so the fakes live on the stages' device type), and equal to the
    dtypes the first stage really returns under autocast; every MLP crossing is bf16."""
    torch.manual_seed(0)
    model, args, kwargs, _, _ = CASES[model_case]()
    plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, precision="bf16-mixed", **NO_SEARCH,
                          micro_batches=MICRO)
    micro_args = tuple(a[: a.shape[0] // MICRO] for a in args)
    micro_kwargs = {k: v[: v.shape[0] // MICRO] for k, v in kwargs.items()}
    method = "symbolic_trace"
    real, _ = capture_chain(model, plan, 2, micro_args, micro_kwargs, method=method, replicate=set())
    on_meta = tuple(a.to("meta") for a in micro_args), {k: v.to("meta") for k, v in micro_kwargs.items()}
    meta, _ = capture_chain(meta_copy(model), plan, 2, *on_meta, method=method, replicate=set())
    dtypes = lambda metas: [[t.dtype for t in stage] for stage in metas]  # noqa: E731
    assert dtypes(real.outputs_meta) == dtypes(meta.outputs_meta)
    assert dtypes(real.inputs_meta) == dtypes(meta.inputs_meta)
    assert dtypes(real.outputs_meta)[0] == dtypes(real.inputs_meta)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sent = real.stages[0](**dict(zip(real.input_names, [*micro_args, *micro_kwargs.values()])))
    assert [t.dtype for t in sent] == dtypes(real.outputs_meta)[0]
    if model_case == "mlp":
        assert set(dtypes(real.outputs_meta)[0]) == {torch.bfloat16}
    fp32 = autosplit.plan(model, ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, **NO_SEARCH, micro_batches=MICRO)
    plain, _ = capture_chain(model, fp32, 2, micro_args, micro_kwargs, method=method, replicate=set())
    assert {t.dtype for stage in plain.outputs_meta for t in stage} == {torch.float32}


def test_a_makespan_plan_in_another_precision_is_refused_when_built():
    model, args, _, _, _ = _mlp_case()
    with pytest.raises(ConstraintError, match="makespan"):
        autosplit.autosplit(model, ["cpu"] * 2, example_inputs=args, objective="makespan", precision="bf16-mixed", time_limit=2)


# -- two gloo processes ------------------------------------------------------------------------------


def _run_case(model_case: str, precision: str, schedule: str, build: str, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = CASES[model_case]()
    reference = _reference(model, precision)
    if build == "meta":  # planned on meta, each rank's stage materialised from the model's state dict
        given = dict(model=meta_copy(model), example_inputs=tuple(a.to("meta") for a in args), weights=copy.deepcopy(model.state_dict()))
    else:
        given = dict(model=model, example_inputs=args)
    pipe = autosplit.distribute(**given, devices=["cpu"] * world, example_kwargs=kwargs, loss_fn=loss_fn,
                                schedule=schedule, micro_batches=MICRO, **NO_SEARCH, precision=precision)
    assert pipe.plan.precision == precision
    held = torch.bfloat16 if precision == "bf16" else torch.float32
    assert {p.dtype for p in pipe.parameters()} == {held}, f"rank {rank}"
    # What rank 0 sends is what rank 1's receive buffers are made for, and autocast's dtype where it gives one.
    sent, received = pipe.chain.outputs_meta[0], pipe.chain.inputs_meta[1]
    both: list = [None] * world
    dist.all_gather_object(both, [str(t.dtype) for t in (sent if rank == 0 else received)])
    assert both[0] == both[1], both
    if model_case == "mlp":
        assert set(both[0]) == {str(LOW[precision])}, both
    assert set(both[0]) <= {str(torch.float32), str(LOW[precision])}, both

    opt, ref_opt = torch.optim.Adam(pipe.parameters(), lr=1e-3), torch.optim.Adam(reference.parameters(), lr=1e-3)
    ref_scaler = torch.amp.GradScaler("cpu") if precision == "fp16-mixed" else None
    ref_params = dict(reference.named_parameters())
    for step in range(STEPS):
        loss = pipe.step(*args, target=target, **kwargs)
        expected = _reference_step(reference, args, kwargs, target, loss_fn, precision, ref_scaler, ref_opt)
        if pipe.is_last:
            torch.testing.assert_close(loss, expected, **TOL[precision], msg=where(f"{model_case} {precision} step {step} loss"))
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL[precision],
                                       msg=where(f"{model_case} {precision} rank {rank} step {step} grad {name}"))
        _step(opt, None)
        _step(ref_opt, ref_scaler)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref_params[name], **TOL[precision], msg=where(f"{model_case} {precision} {name} after {STEPS} steps"))
    if build == "meta":  # a batch of other rows: stages re-cut on meta at its micro-batch shape
        rows = args[0].shape[0] // 2
        loss = pipe.step(*(a[:rows] for a in args), target=target[:rows])
        expected = _reference_step(reference, tuple(a[:rows] for a in args), {}, target[:rows], loss_fn, precision, None, ref_opt)
        if pipe.is_last:
            torch.testing.assert_close(loss, expected, **TOL[precision], msg=where(f"{model_case} {precision}: {rows} rows"))
    if precision == "fp16-mixed":
        _overflowing_step_is_skipped_everywhere(pipe, opt, args, kwargs, target, rank, world)
    else:
        assert pipe.scaler is None


def _overflowing_step_is_skipped_everywhere(pipe, opt, args, kwargs, target, rank: int, world: int) -> None:
    """A scale of 2⁴⁰ overflows the fp16 gradients: every rank skips the step
    (no gradient, parameters unchanged by the optimizer) and halves the scale; the next step is kept."""
    assert pipe.scaler.get_scale() == 2.0**16
    pipe.scaler.load_state_dict({**pipe.scaler.state_dict(), "scale": 2.0**40})
    before = {name: p.detach().clone() for name, p in pipe.named_parameters()}
    pipe.step(*args, target=target, **kwargs)
    assert all(p.grad is None for p in pipe.parameters()), f"rank {rank} kept gradients of a skipped step"
    opt.step()
    opt.zero_grad()
    for name, p in pipe.named_parameters():
        assert torch.equal(p, before[name]), f"rank {rank}: {name} changed by a skipped step"
    assert pipe.scaler.get_scale() == 2.0**39
    assert pipe.scaler.skipped == 1
    pipe.scaler.load_state_dict({**pipe.scaler.state_dict(), "scale": 2.0**8})
    pipe.step(*args, target=target, **kwargs)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in pipe.parameters())
    assert pipe.scaler.skipped == 1
    # The scaler's state travels with the checkpoint: a resumed run keeps its scale and growth count.
    folder: list = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    saved = pipe.scaler.state_dict()
    assert saved["_growth_tracker"] == 1
    pipe.save(os.path.join(folder[0], "ckpt"), optimizer=opt)
    pipe.scaler.load_state_dict({**saved, "scale": 2.0**3, "_growth_tracker": 0})
    pipe.load(os.path.join(folder[0], "ckpt"), optimizer=opt)
    assert pipe.scaler.state_dict() == saved, f"rank {rank}"
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0])


def test_pipelined_training_in_mixed_and_bf16_precision_equals_unsplit_training(gloo):
    """bf16-mixed and fp16-mixed GPT (GPipe and 1F1B), a bf16-mixed MLP built on the meta device, a bf16 MLP, on 2 processes."""
    gloo(2).run(_run_case, [
        ("gpt", "bf16-mixed", "gpipe", "real"), ("gpt", "fp16-mixed", "1f1b", "real"), ("mlp", "bf16-mixed", "1f1b", "meta"),
        ("mlp", "bf16", "gpipe", "real"),
    ])
