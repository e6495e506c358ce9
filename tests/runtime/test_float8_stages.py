"""FP8 stages train like the unsplit model converted the same way (torchao's float8 training, on a CPU).

The reference is the unsplit model with the plan's linears converted by ``convert_to_float8_training``
(the same recipe, the same module filter) run under the same autocast, micro-batch by micro-batch and
copy by copy as the pipeline runs them: every FP8 cast then scales the same rows with the same amax, and
FSDP2's FP8 all-gather casts each weight with the scale of the whole weight (its amax all-reduced over
the shards, ``precompute_float8_dynamic_scale_for_fsdp`` before each step) as the unsharded cast does. So
both compute the same FP8 values and differ only where bf16 and fp32 sums run in another order (the
pipeline's gradient accumulation, FSDP's reduce-scatter, a tied weight's two gradients): the tolerance
is bf16-mixed's (tests/runtime/test_precision.py). Were a cast's scale taken over other rows, or a weight
gathered in FP8 with a stale scale, values would move by FP8 steps (6–12%) and fail it.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autosplit
from autosplit.errors import CodegenError
from tests.helpers import NO_SEARCH, full_tensor, gpt_case, says, where
from tests.layouts import Comparison, forward_in, reference_step, train_alike

float8 = pytest.importorskip("torchao.float8")

STEPS = 3
MICRO = 2
TOL: dict[str, Any] = {"rtol": 1e-3, "atol": 1e-4}
"""bf16-mixed's: the same FP8 values, sums in another order (the module docstring)."""


def _converted(model: nn.Module, plan: autosplit.Plan, *, all_gather: bool = False) -> nn.Module:
    """``model``'s copy with the plan's FP8 linears converted as the stages convert theirs."""
    config = float8.Float8LinearConfig.from_recipe_name(plan.float8)
    wanted = set(plan.float8_linears)
    return float8.convert_to_float8_training(copy.deepcopy(model), module_filter_fn=lambda _, fqn: fqn in wanted, config=config)


def _float8_modules(module: nn.Module) -> set[str]:
    return {name for name, m in module.named_modules() if type(m).__name__ == "Float8Linear"}


def test_a_split_fp8_model_trains_like_the_unsplit_fp8_model_and_leaves_the_users_untouched():
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, precision="bf16-mixed",
                                float8="tensorwise", **NO_SEARCH)
    plan = split.plan
    # the tied head, linear(x, wte.weight), named by its weight's module
    assert plan.float8 == "tensorwise" and len(plan.float8_linears) == 8 and [p for p, _ in plan.float8_kept] == ["wte"]
    assert set().union(*(_float8_modules(s) for s in split.stages)) == set(plan.float8_linears)
    assert not _float8_modules(model), "the user's model keeps its nn.Linear modules"
    assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items()), "building changed the user's weights"
    reference = _converted(model, plan)
    opt, ref_opt = torch.optim.AdamW(split.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(split(*args, **kwargs), target)
        loss.backward()
        expected = reference_step(reference, args, kwargs, target, loss_fn, 1, "bf16-mixed")
        torch.testing.assert_close(loss, expected[0], **TOL, msg=where(f"step {step} loss"))
        for name, p in split.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL, msg=where(f"step {step} grad {name}"))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for name, p in split.named_parameters():
        torch.testing.assert_close(p, ref_params[name], **TOL, msg=where(f"{name} after {STEPS} steps"))


def _distributed_case(stages: int, copies: int, schedule: str, precision: str = "bf16-mixed", *, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    unsplit = copy.deepcopy(model)  # (the stages share the model's modules, which FSDP2 shards)
    pipe = autosplit.distribute(
        model, ["cpu"] * world, example_inputs=args, example_kwargs=kwargs,
        loss_fn=loss_fn, data_parallel=copies, replicate="fully_shard", schedule=schedule, micro_batches=MICRO, **NO_SEARCH,
        precision=precision, float8="tensorwise",
    )
    plan = pipe.plan
    held = _float8_modules(pipe.module)
    assert held and held <= set(plan.float8_linears), (rank, held)
    fp8: list[Any] = [m for m in pipe.module.modules() if type(m).__name__ == "Float8Linear"]
    gathered = {m.config.enable_fsdp_float8_all_gather for m in fp8}
    # FSDP2 all-gathers the FP8 weights in FP8 exactly where it shards fp32 ones (under its bf16 policy, its own cast first)
    assert gathered == {copies > 1 and precision == "bf16-mixed"}, f"rank {rank}"
    reference = _converted(unsplit, plan)
    comparison = Comparison(STEPS, precision, chunks=MICRO, tol=TOL, tied_apart=any(p.policy == "replicate" for p in plan.shared_params))
    opt, _, mine = train_alike(pipe, reference, (args, kwargs, target, loss_fn), comparison, f"{stages}×{copies} {precision} rank {rank}")
    _between_steps(pipe, opt, reference, (args, kwargs, target, loss_fn), mine, rank, precision)
    pipe.close()


def _between_steps(pipe: Any, opt: torch.optim.Optimizer, reference: nn.Module, case: tuple, mine: slice, rank: int,
                   precision: str) -> None:
    """What a loop does between steps, on FP8 stages: an evaluation equals the unsplit FP8 model's; a checkpoint
    saved (FP8-gathered weights included) loads into a fresh FP8 copy of the unsplit model as the stages hold it."""
    from autosplit.runtime.checkpoint import load_checkpoint

    args, kwargs, target, loss_fn = case
    loss = pipe.eval_step(*(a[mine] for a in args), target=target[mine], **{k: v[mine] for k, v in kwargs.items()})
    part = (mine.stop - mine.start) // MICRO  # the pipeline's micro-batches: each FP8 cast scales the same rows
    micro = [slice(mine.start + k * part, mine.start + (k + 1) * part) for k in range(MICRO)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        expected = [loss_fn(forward_in(reference, precision, tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}), target[r])
                    for r in micro]
    if pipe.is_last:
        torch.testing.assert_close(loss, torch.stack(expected).mean(), **TOL, msg=where(f"rank {rank} eval_step"))
    folder: list = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    pipe.save(os.path.join(folder[0], "ckpt"), optimizer=opt)
    fresh = copy.deepcopy(reference)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_checkpoint(os.path.join(folder[0], "ckpt"), fresh)
    held = dict(fresh.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p), held[name], rtol=0, atol=0, msg=where(f"rank {rank} {name} loaded from the checkpoint"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0])


def test_fp8_stages_pipelined_and_sharded_on_two_processes_train_like_the_unsplit_fp8_model(gloo):
    """Two stages (GPipe, 1F1B), one stage under fully_shard 2 with the weights all-gathered in FP8, and the same under
    FSDP2's bf16 policy (its bf16 copies gathered, then cast to FP8, as the unsplit model under the policy does)."""
    gloo(2).run(_distributed_case, [(2, 1, "gpipe"), (2, 1, "1f1b"), (1, 2, "1f1b"), (1, 2, "1f1b", "bf16-fsdp")])


def test_fp8_stages_two_by_dp_shard_two_on_four_processes_train_like_the_unsplit_fp8_model(gloo):
    gloo(4).run(_distributed_case, [(2, 2, "1f1b")])


def _tensor_parallel_case(recipe: str, *, rank: int, world: int) -> None:
    """One stage over tp 2: the column-parallel linear, GELU and the row-parallel linear in FP8, under a loss linear
    in the output (its gradient the fixed target, whatever the output's rounding)."""
    torch.manual_seed(0)
    width = 64
    model = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    x = torch.randn(8, 16, width, generator=torch.Generator().manual_seed(1))
    target = torch.randint(-2, 3, (8, 16, width), generator=torch.Generator().manual_seed(2)).float() / 64

    def loss_fn(out: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (out.float() * c).sum()

    unsplit = copy.deepcopy(model)
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(x,), loss_fn=loss_fn, tensor_parallel=2, precision="bf16-mixed",
                                float8=recipe, float8_exclude=(), micro_batches=1, schedule="gpipe", **NO_SEARCH)
    plan = pipe.plan
    assert plan.float8_linears == ("1", "3") and plan.tp_shards == {"1.weight": 0, "1.bias": 0, "3.weight": 1}
    assert _float8_modules(pipe.module) == {"1", "3"}
    reference = _converted(unsplit, plan)
    loss = pipe.step(x, target=target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = loss_fn(reference(x), target)
    expected.backward()
    # each rank sums its half of the row-parallel product in bf16 before the all-reduce: the output, the loss and
    # the norm's gradients (reached through the column-parallel input's reduced gradient) move by bf16 roundings
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-2, atol=1e-3, msg=where(f"rank {rank} {recipe} loss"))
    held = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        want = held[name].grad
        assert want is not None, name
        # the FP8 linears: the same casts with the same scales (a tensor's amax over its shards); the norm: within two
        # bf16 roundings (2⁻⁷) of its largest gradient
        atol = 0.0 if name.startswith(("1.", "3.")) else 2**-7 * float(want.abs().max())
        torch.testing.assert_close(full_tensor(p.grad), want, rtol=0, atol=atol, msg=where(f"rank {rank} {recipe} grad {name}"))
    pipe.close()


def test_fp8_linears_split_over_tp_two_compute_what_the_unsplit_fp8_model_computes(gloo):
    """torchao's Float8Linear on autosplit's DTensor tensor parallelism: each cast takes the amax of the whole tensor
    (DTensor reduces it over the shards), so the FP8 linears' weight gradients equal the unsplit FP8 model's bit for bit,
    tensorwise and rowwise. A cast scaled per shard would move them by FP8 steps. The loss is linear in the output, so
    that the bf16 rounding of the row-parallel partial sums does not reach the FP8 gradient casts (where one rounding
    flips an FP8 step, which a test could not tell from a wrong scale)."""
    gloo(2).run(_tensor_parallel_case, [("tensorwise",), ("rowwise",)])


def test_fp8_plans_this_runtime_does_not_run_are_refused_by_name():
    model, args, kwargs, _, _ = gpt_case()
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, precision="bf16-mixed", **NO_SEARCH)
    with pytest.raises(CodegenError) as e:
        planner.build(planner.with_options(float8="mxfp8").plan())
    says(e, "MXFP8 (float8='mxfp8'), costed but not run", "float8='tensorwise'")
