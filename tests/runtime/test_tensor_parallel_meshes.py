"""Tensor parallelism with data parallelism beside it, and what moves between layouts, against the unsplit model.

With the cases of :mod:`tests.tp_cases` (float64, gloo): tp 2 × ``dp_replicate`` 2 (4 processes,
FSDP2's ``replicate``); tp 2 × pp 2 × ``dp_shard`` 2 (8, the GPT: FSDP2's ``fully_shard`` over the tp
DTensors), and one stage under tp 2 × HSDP (8, the Llama). A step under ``"bf16-mixed"`` and one under
``"fp16-mixed"`` agree to their precision (tp sums partial products in the compute dtype). A checkpoint saved under tp 2 × pp 2 loads
under pp 2 alone, under tp 2 alone and into the unsplit model; a model on the meta device takes its
weights from one under tp 2 × pp 2. A world size other than the mesh's and a ``tp_shards`` name the
model lacks are refused by name.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

import autosplit
from autosplit.errors import ConstraintError, DistributedError
from autosplit.runtime.checkpoint import save_checkpoint
from tests.helpers import NO_SEARCH, full_tensor, gpt_case, says, where
from tests.layouts import ROWS, assert_resumed, assert_the_unsplit_model_resumes, lm_loss, reference_step, trained_reference
from tests.tp_cases import MICRO, STEPS, distribute, fixed_plan, shards, train_case

MIXED_GRADIENT = {"bf16-mixed": 0.015, "fp16-mixed": 0.002}
"""The largest error of a gradient, relative to its norm: about 4 × the compute dtype's precision (bf16 2^-8,
fp16 2^-11)."""


def test_tp2_by_dp_replicate2_trains_like_the_unsplit_model(gloo, tmp_path):
    """FSDP2's ``replicate`` over ``dp_replicate`` keeps the tp DTensors' copies in step (one stage)."""
    pytest.importorskip("transformers")
    plans = [(name, fixed_plan(name, 1, 2, 2, str(tmp_path), "replicate")) for name in ("gpt", "llama")]
    gloo(4).run(train_case, plans)


def test_tp2_by_pp2_by_dp_shard2_trains_like_the_unsplit_model(gloo, tmp_path):
    """FSDP2's ``fully_shard`` over ``dp_shard`` wraps the stages whose parameters are already tp DTensors:
    each parameter a DTensor on the 2-D ``("dp_shard", "tp")`` mesh."""
    pytest.importorskip("transformers")
    plans = [("gpt", fixed_plan("gpt", 2, 2, 2, str(tmp_path)))]  # the Llama's tp DTensors under FSDP2: the HSDP test below
    gloo(8, timeout=120).run(train_case, plans)


def test_tp2_under_hsdp_trains_like_the_unsplit_model(gloo, tmp_path):
    """One stage on tp 2 × ``dp_replicate`` 2 × ``dp_shard`` 2 (HSDP, from a plan given those degrees): the Llama in
    one micro-batch (one row: FSDP alone, each decoder layer outlined as a unit of its own, its graph a module
    inside the stage's)."""
    pytest.importorskip("transformers")
    plans = [("llama", fixed_plan("llama", 1, 4, 2, str(tmp_path), dp_shard=2, micro_batches=1))]
    gloo(8, timeout=120).run(train_case, plans)


def _mixed_case(plan_path: str, *, rank: int, world: int) -> None:
    """One step under the plan's ``"bf16-mixed"`` or ``"fp16-mixed"`` beside the unsplit model under
    ``torch.autocast``, micro-batch by micro-batch (fp16: its loss scaled by 2^16, as the pipeline's is);
    under fp16, a scale that overflows skips the step on both tp ranks."""
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    reference = copy.deepcopy(model)
    pipe = distribute(model, args, kwargs, loss_fn, plan_path)
    low = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[pipe.plan.precision]
    scale = 2.0**16 if low == torch.float16 else 1.0
    loss = pipe.step(*args, target=target, **kwargs)
    losses = []
    for rows in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS)):
        with torch.autocast("cpu", dtype=low):
            part = loss_fn(reference(*(a[rows] for a in args), **{k: v[rows] for k, v in kwargs.items()}), target[rows])
        (part * scale / MICRO).backward()
        losses.append(part.detach())
    what = f"{pipe.plan.precision} rank {rank}"
    torch.testing.assert_close(loss, torch.stack(losses).mean(), rtol=1e-4, atol=1e-5, msg=where(f"{what} loss"))
    ref_params = dict(reference.named_parameters())
    for pname, p in pipe.named_parameters():
        grad, expected = full_tensor(p.grad), ref_params[pname].grad / scale
        error = float((grad - expected).norm() / expected.norm())
        assert error < MIXED_GRADIENT[pipe.plan.precision], f"{what} {pname}: gradient off by {error:.2%} of its norm"
    if low == torch.float16:
        pipe.scaler.load_state_dict({**pipe.scaler.state_dict(), "scale": 2.0**40})
        pipe.step(*args, target=target, **kwargs)
        assert all(p.grad is None for p in pipe.parameters()) and pipe.scaler.skipped == 1, what
        assert pipe.scaler.get_scale() == 2.0**39, what
    pipe.close()


def test_mixed_precision_under_tp2_agrees_to_its_precision(gloo, tmp_path):
    """tp 2 sums each row-parallel product's halves in the compute dtype (DTensor's partial sums, all-reduced
    in bf16 or fp16, as Megatron's do), where the unsplit model accumulates the whole product in float32:
    the loss agrees to 1e-5 and each gradient to about bf16's precision (0.2–0.7 % of its norm measured
    under bf16, 2^-8 ≈ 0.4 %), which float64 cannot show. fp16 through the loss scaler: the gradients
    unscaled on each tp rank's shard, an overflow found on one skipping the step on both."""
    torch.manual_seed(0)
    model, args, kwargs, _, _ = gpt_case()
    cases = []
    for precision in ("bf16-mixed", "fp16-mixed"):
        made = autosplit.plan(model, ["cpu"], example_inputs=args, example_kwargs=kwargs, schedule="1f1b", micro_batches=MICRO,
                              precision=precision, **NO_SEARCH)
        dataclasses.replace(made, tensor_parallel=2, tp_shards=shards("gpt-vocab", model)).save(tmp_path / f"{precision}.json")
        cases.append((str(tmp_path / f"{precision}.json"),))
    gloo(2).run(_mixed_case, cases)


# -- a checkpoint moves between layouts -------------------------------------------------------------


def _save_case(plan_path: str, folder: str, *, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    pipe = distribute(model.double(), args, kwargs, loss_fn, plan_path)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for _ in range(STEPS):
        pipe.step(*args, target=target, **kwargs)
        opt.step()
        opt.zero_grad()
    pipe.save(f"{folder}/ckpt", optimizer=opt)
    pipe.close()


def _resume_case(plan_path: str, folder: str, *, rank: int, world: int) -> None:
    reference, ref_opt, (args, kwargs, target, loss_fn) = trained_reference(STEPS)
    torch.manual_seed(7)  # other initial weights and optimizer: everything comes from the checkpoint
    model = type(reference)(vocab=40, d_model=16, n_layers=2, n_heads=2, max_len=8).double()
    pipe = distribute(model, args, kwargs, loss_fn, plan_path)
    opt = torch.optim.AdamW(pipe.parameters(), lr=5.0)
    pipe.load(f"{folder}/ckpt", optimizer=opt)
    what = f"resumed under {pipe.plan.mesh}"
    assert_resumed(dict(pipe.named_parameters()), opt, reference, ref_opt, what)
    whole = pipe.full_state_dict()  # every stage's, gathered on every rank
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(whole[key], value, msg=where(f"{what}: full_state_dict {key}"))
    pipe.load_state_dict({k: torch.zeros_like(v) for k, v in whole.items()})  # into this rank's part of each DTensor
    assert all(not full_tensor(p).any() for p in pipe.parameters()), what
    pipe.load_state_dict(whole)
    loss = pipe.step(*args, target=target, **kwargs)
    expected = reference_step(reference, args, kwargs, target, loss_fn, 1)
    if pipe.is_last:
        torch.testing.assert_close(loss, expected[0], msg=where(f"{what}: loss"))
    opt.step()
    ref_opt.step()
    assert_resumed(dict(pipe.named_parameters()), opt, reference, ref_opt, f"{what}, one step on")
    pipe.close()


def test_a_checkpoint_saved_under_tp2_by_pp2_loads_under_pp2_under_tp2_and_unsplit(gloo, tmp_path):
    folder = str(tmp_path)
    gloo(4).run(_save_case, [(fixed_plan("gpt", 2, 1, 2, folder), folder)])
    gloo(2).run(_resume_case, [(fixed_plan("gpt", 2, 1, 1, folder), folder), (fixed_plan("gpt", 1, 1, 2, folder), folder)])
    assert_the_unsplit_model_resumes(tmp_path, STEPS)


def _meta_case(plan_path: str, weights: str, *, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    reference = model.double()
    with torch.device("meta"):
        meta = type(reference)(vocab=40, d_model=16, n_layers=2, n_heads=2, max_len=8).double()
    pipe = autosplit.distribute(meta, None, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn, plan=plan_path, weights=weights)
    ref_params = dict(reference.named_parameters())
    for pname, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p), ref_params[pname], msg=where(f"materialised {pname}"))
    loss = pipe.step(*args, target=target, **kwargs)
    expected = reference_step(reference, args, kwargs, target, loss_fn, 1)
    if pipe.is_last:
        torch.testing.assert_close(loss, expected[0], msg=where("loss"))
    for pname, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p.grad), ref_params[pname].grad, msg=where(f"grad {pname}"))
    pipe.close()


@pytest.mark.smoke  # the fast tier's case of this runtime path
def test_a_meta_model_under_tp2_by_pp2_takes_its_weights_from_a_checkpoint(gloo, tmp_path):
    """Each rank materialises its stage whole from the checkpoint (the unsplit model's, ``save_checkpoint``),
    then splits it over tp: the GPT with its tied embedding and head vocabulary-parallel."""
    torch.manual_seed(0)
    model, *_ = gpt_case()
    save_checkpoint(tmp_path / "ckpt", model.double())
    gloo(4).run(_meta_case, [(fixed_plan("gpt-vocab", 2, 1, 2, str(tmp_path)), str(tmp_path / "ckpt"))])


# -- refusals ---------------------------------------------------------------------------------------


def _refusal_case(folder: str, *, rank: int, world: int) -> None:
    model, args, kwargs, _, loss_fn = gpt_case()
    model = model.double()  # as the plans were made
    example = dict(example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn)
    with pytest.raises(DistributedError) as e:  # tp 2 × pp 2 need 4 ranks
        autosplit.distribute(model, None, **example, plan=f"{folder}/gpt-pp2-fully_shard1-shard1-tp2-1f1b.json")
    says(e, "2 ranks", "pp × dp_replicate × dp_shard × tp = 2 × 1 × 1 × 2 = 4", "devices=None or 4 devices")
    made = autosplit.Plan.load(f"{folder}/gpt-pp1-fully_shard1-shard1-tp2-1f1b.json")
    for bad, names in [({"blocks.0.fc.weight": 0, "blocks.0.mlp.weight": 0}, ["'blocks.0.mlp.weight'", "named_parameters"]),
                          ({"blocks.0.fc.bias": 1}, ["'blocks.0.fc.bias'", "dimension 1"]),
                          ({"wte.weight": 0, "head.weight": 1}, ["head.weight", "wte.weight", "tied"])]:
        with pytest.raises(ConstraintError) as refused:
            autosplit.distribute(model, None, **example, plan=dataclasses.replace(made, tp_shards=bad))
        says(refused, *names)
    with pytest.raises(ConstraintError) as refused:
        autosplit.distribute(model, None, **example, plan=dataclasses.replace(made, sequence_parallel=True))
    says(refused, "sequence_parallel=True")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the Llama with torch's fused attention: DTensor cannot split its CPU backward
    shape: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, attn_implementation="sdpa")
    llama = LlamaForCausalLM(LlamaConfig(**shape))
    tokens = torch.randint(0, 128, (4, 8))
    fused = autosplit.plan(llama, ["cpu"] * 2, example_inputs=(tokens,), tensor_parallel=2, data_parallel=1, micro_batches=1,
                           schedule="1f1b", time_limit=1)
    with pytest.raises(ConstraintError) as refused:
        autosplit.distribute(llama, None, example_inputs=(tokens,), loss_fn=lm_loss, plan=fused)
    says(refused, "scaled_dot_product_attention over tp on CPU", "attn_implementation='eager'")


def test_a_mesh_the_process_group_cannot_hold_and_unknown_tp_shards_are_refused_by_name(gloo, tmp_path):
    fixed_plan("gpt", 2, 1, 2, str(tmp_path))
    fixed_plan("gpt", 1, 1, 2, str(tmp_path))
    gloo(2).run(_refusal_case, [(str(tmp_path),)])
