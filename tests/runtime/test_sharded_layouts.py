"""Sharded layouts on the ``("pp", "dp_replicate", "dp_shard", "tp")`` mesh train like the unsplit model.

Each rank builds its part of a fixed plan (:data:`~tests.helpers.NO_SEARCH`: the planner is not
under test) with FSDP2's ``fully_shard`` over the mesh's ``dp_shard`` dimension, and trains on its
data-parallel copy's slice of a global batch of 8 rows; beside it, in the same process, the unsplit
model trains on the whole global batch, its gradient the mean loss's over all of it. In float64 the
losses of every step, every gradient and the parameters after 3 AdamW steps agree to rounding:
2 stages × ``dp_shard`` 2 on 4 processes and 1 stage × ``dp_shard`` 2 on 2, for a GPT with tied
embeddings and a small transformers Llama (captured by ``torch.export``: in one pass, each decoder layer
outlined as an FSDP unit of its own, its checkpointed region inside under ``checkpointing="full"``);
in ``"bf16-mixed"`` against the unsplit model under
``torch.autocast`` run micro-batch by micro-batch. A model and optimizer checkpoint saved under
2 stages × ``dp_shard`` 2 resumes under 1 stage × ``dp_shard`` 4, under 1 stage × ``dp_replicate``
2 × ``dp_shard`` 2 (HSDP), under 4 stages and in the unsplit model, and the next step is the
unsplit model's.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

import autosplit
from autosplit.errors import ConstraintError, DistributedError
from autosplit.passes.capture import capture
from autosplit.passes.outline import outlinable_blocks
from autosplit.runtime.checkpoint import load_checkpoint
from autosplit.runtime.placement import MESH_DIMS
from tests.helpers import NO_SEARCH, full_tensor, gpt_case, says, where
from tests.layouts import (
    ROWS,
    Comparison,
    assert_resumed,
    assert_the_unsplit_model_resumes,
    forward_in,
    llama_case,
    reference_step,
    train_alike,
    trained_reference,
)

STEPS = 3
MICRO = 2
TOL: dict[str, dict[str, Any]] = {"fp32": {}, "bf16-mixed": {"rtol": 1e-3, "atol": 1e-4}, "bf16-fsdp": {"rtol": 1e-3, "atol": 1e-4}}
"""float64 runs agree to rounding (default tolerances); the mixed precisions at tests/runtime/test_precision.py's
(bf16-fsdp's gradients are bit for bit the reference's on the first step: the same bf16 ops, fp32 sums)."""


CASES = {"gpt": gpt_case, "llama": llama_case}


def _distribute(model, args, kwargs, loss_fn, stages: int, copies: int, **options: Any) -> Any:
    return autosplit.distribute(  # the whole mesh, the global batch
        model, None if "plan" in options else ["cpu"] * (stages * copies), example_inputs=args,
        example_kwargs=kwargs, loss_fn=loss_fn, data_parallel=copies,
        replicate="fully_shard", **{"schedule": "1f1b", "micro_batches": MICRO, **NO_SEARCH, **options},
    )


def _train_case(
    name: str, stages: int, precision: str, micro: int = MICRO, checkpointing: str = "none", *, rank: int, world: int,
) -> None:
    model, args, kwargs, target, loss_fn = CASES[name]()
    model = model.double() if precision == "fp32" else model
    reference, copies = copy.deepcopy(model), world // stages
    pipe = _distribute(model, args, kwargs, loss_fn, stages, copies, precision=precision, micro_batches=micro,
                       checkpointing="full" if checkpointing == "selective" else checkpointing, selective=checkpointing == "selective")
    assert bool(pipe.plan.recompute) is (checkpointing != "none"), pipe.plan.recompute
    assert pipe.plan.recompute_selective is (checkpointing == "selective")
    assert pipe.plan.mesh == {"pp": stages, "dp_replicate": 1, "dp_shard": copies, "tp": 1}
    assert pipe.mesh.mesh_dim_names == MESH_DIMS and tuple(pipe.mesh.shape) == (stages, 1, copies, 1)
    place = pipe.layout.place(pipe.stage_index)  # rank = ((pp · dp_replicate + r) · dp_shard + s) · tp + t
    assert rank == place * copies + pipe.layout.replica
    for pname, p in pipe.named_parameters():  # sharded by FSDP2 over the mesh's dp_shard dimension
        assert p.device_mesh.mesh_dim_names == ("dp_shard",) and p.placements[0].is_shard(), pname
        assert p.device_mesh.mesh.tolist() == [place * copies + s for s in range(copies)], pname
    # torchtitan's choice: under pipelining (or several micro-batches) the gathered parameters stay from forward
    # to backward; FSDP alone in one pass shards each block the runtime can outline (traced or exported: the
    # predicate the cost model shares) and each other leaf as a unit of its own, and reshards it after forward
    alone = stages == 1 and micro == 1
    assert pipe.module._get_fsdp_state()._fsdp_param_group._reshard_after_forward is alone
    units = {q: m for q, m in pipe.module.named_modules() if m is not pipe.module and isinstance(m, FSDPModule)}
    rows = ROWS // copies
    blocks = set(outlinable_blocks(capture(reference, tuple(a[:rows] for a in args), {k: v[:rows] for k, v in kwargs.items()},
                                           method=pipe.plan.capture).gm)) if alone else set()
    assert bool(units) is alone and blocks <= set(units), (name, micro, sorted(units), sorted(blocks))
    assert name != "llama" or not alone or blocks == {"model.layers.0", "model.layers.1"}, blocks
    assert all(getattr(m._get_fsdp_state()._fsdp_param_group, "_reshard_after_forward", False) for m in units.values()), name
    if precision == "bf16-fsdp":  # FSDP2's policy on the stage, over fp32 master weights
        assert pipe.module._get_fsdp_state()._mp_policy.param_dtype is torch.bfloat16
        assert all(p.dtype == torch.float32 for p in pipe.parameters())
    comparison = Comparison(STEPS, precision, chunks=micro if precision != "fp32" else 1, tol=TOL[precision],
                            tied_apart=any(p.policy == "replicate" for p in pipe.plan.shared_params))  # a tied weight cast on each stage
    train_alike(pipe, reference, (args, kwargs, target, loss_fn), comparison, f"{name} {precision} rank {rank}")
    pipe.close()


def test_two_stages_by_dp_shard_two_train_like_the_unsplit_model(gloo):
    pytest.importorskip("transformers")
    gloo(4).run(_train_case, [("gpt", 2, "fp32"), ("llama", 2, "fp32"), ("gpt", 2, "bf16-mixed"), ("llama", 2, "bf16-fsdp")])


def test_one_stage_by_dp_shard_two_trains_like_the_unsplit_model(gloo):
    pytest.importorskip("transformers")
    gloo(2).run(_train_case, [("gpt", 1, "fp32"), ("llama", 1, "fp32"), ("gpt", 1, "fp32", 1), ("llama", 1, "fp32", 1),
                              ("llama", 1, "fp32", 1, "full"), ("llama", 1, "fp32", 1, "selective")])  # units wrap the regions


def test_bf16_fsdp_trains_like_the_unsplit_model_under_fsdp2s_policy(gloo, tmp_path):
    """FSDP2's ``MixedPrecisionPolicy`` on every stage, on a data-parallel mesh of one without copies:
    2 stages of the GPT (its tied weight cast on each) and of the exported Llama (captured with bf16
    parameters), and one stage in one pass (each block a unit of its own; the Llama's recomputed in backward)."""
    pytest.importorskip("transformers")
    gloo(2).run(_train_case, [("gpt", 2, "bf16-fsdp"), ("llama", 2, "bf16-fsdp"), ("gpt", 1, "bf16-fsdp", 1),
                              ("llama", 1, "bf16-fsdp", 1, "full")])  # each unit recomputes its checkpointed region in bf16
    gloo(2).run(_given_plan_case, [(str(tmp_path),)])


def _given_plan_case(folder: str, *, rank: int, world: int) -> None:
    """A bf16-fsdp plan handed to ``distribute`` without its precision: the exported Llama is captured as
    the plan computes (bf16 parameters), and its first step's gradients are the reference's; then what a
    loop does between steps — the global norm clipped, an evaluation, a checkpoint loaded into the
    unsplit model — as the unsplit model does it under the policy."""
    model, args, kwargs, target, loss_fn = llama_case()
    reference = copy.deepcopy(model)
    made = autosplit.plan(model, ["cpu"] * 2, example_inputs=args, precision="bf16-fsdp", schedule="1f1b", micro_batches=MICRO,
                          **NO_SEARCH)
    pipe = autosplit.distribute(model, None, example_inputs=args, loss_fn=loss_fn, plan=made)
    stage: Any = pipe.module  # an FSDPModule
    assert pipe.plan.precision == "bf16-fsdp" and stage._get_fsdp_state()._mp_policy.param_dtype is torch.bfloat16
    loss = pipe.step(*args, target=target)
    (expected,) = reference_step(reference, args, kwargs, target, loss_fn, 1, "bf16-fsdp", chunks=MICRO)
    if pipe.is_last:
        torch.testing.assert_close(loss, expected, **TOL["bf16-fsdp"])
    ref_params = dict(reference.named_parameters())
    for pname, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p.grad), ref_params[pname].grad, **TOL["bf16-fsdp"], msg=where(f"given plan: {pname}"))
    norm = pipe.clip_grad_norm_(0.1)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1), **TOL["bf16-fsdp"], check_dtype=False)
    opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt.step()
    ref_opt.step()
    pipe.eval()
    evaluated = pipe.eval_step(*args, target=target)
    with torch.no_grad():
        expected = loss_fn(forward_in(reference, "bf16-fsdp", args, kwargs), target)
    if pipe.is_last:
        torch.testing.assert_close(evaluated, expected, **TOL["bf16-fsdp"])
    pipe.save(f"{folder}/ckpt", optimizer=opt)
    unsplit, *_ = llama_case()
    load_checkpoint(f"{folder}/ckpt", unsplit)  # fp32 master weights, as the unsplit model holds them
    for pname, p in unsplit.named_parameters():
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, ref_params[pname], **TOL["bf16-fsdp"], msg=where(f"loaded {pname}"))
    pipe.close()


# -- a checkpoint moves between layouts -------------------------------------------------------------


def _save_case(folder: str, *, rank: int, world: int) -> None:
    model, args, kwargs, target, loss_fn = gpt_case()
    pipe = _distribute(model.double(), args, kwargs, loss_fn, 2, 2)
    mine = slice(pipe.layout.replica * ROWS // 2, (pipe.layout.replica + 1) * ROWS // 2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for _ in range(STEPS):
        pipe.step(*(a[mine] for a in args), target=target[mine], **{k: v[mine] for k, v in kwargs.items()})
        opt.step()
        opt.zero_grad()
    pipe.save(f"{folder}/ckpt", optimizer=opt)
    pipe.close()


def _resume_case(folder: str, stages: int, shard: int, *, rank: int, world: int) -> None:
    reference, ref_opt, (args, kwargs, target, loss_fn) = trained_reference(STEPS)
    torch.manual_seed(7)  # other initial weights and optimizer: everything comes from the checkpoint
    model = type(reference)(vocab=40, d_model=16, n_layers=2, n_heads=2, max_len=8).double()
    copies = world // stages
    options: dict[str, Any] = {"schedule": "gpipe"} if stages > MICRO else {}  # 1F1B needs a micro-batch per stage
    if shard != copies:  # HSDP: only a given plan asks for both degrees
        made = autosplit.plan(model, ["cpu"] * world, example_inputs=args, example_kwargs=kwargs, data_parallel=copies,
                              replicate="fully_shard", schedule="1f1b", micro_batches=MICRO, **NO_SEARCH)
        options["plan"] = dataclasses.replace(made, dp_shard=shard)
    pipe = _distribute(model, args, kwargs, loss_fn, stages, copies, **options)
    assert pipe.plan.mesh == {"pp": stages, "dp_replicate": copies // shard, "dp_shard": shard, "tp": 1}
    dims = ("dp_replicate", "dp_shard") if 1 < shard < copies else ("dp_shard",) if shard > 1 else None
    assert all(full_tensor(p) is p if dims is None else p.device_mesh.mesh_dim_names == dims for p in pipe.parameters())
    opt = torch.optim.AdamW(pipe.parameters(), lr=5.0)
    pipe.load(f"{folder}/ckpt", optimizer=opt)
    what = f"resumed under {pipe.plan.mesh}"
    assert_resumed(dict(pipe.named_parameters()), opt, reference, ref_opt, what)
    mine = slice(pipe.layout.replica * ROWS // copies, (pipe.layout.replica + 1) * ROWS // copies)
    loss = pipe.step(*(a[mine] for a in args), target=target[mine], **{k: v[mine] for k, v in kwargs.items()})
    expected = reference_step(reference, args, kwargs, target, loss_fn, copies)
    if pipe.is_last:
        torch.testing.assert_close(loss, expected[pipe.layout.replica], msg=where(f"{what}: loss"))
    opt.step()
    ref_opt.step()
    assert_resumed(dict(pipe.named_parameters()), opt, reference, ref_opt, f"{what}, one step on")
    pipe.close()


def test_a_checkpoint_saved_under_pp2_by_dp_shard2_resumes_under_other_layouts_and_unsplit(gloo, tmp_path):
    gloo(4).run(_save_case, [(str(tmp_path),)])
    gloo(4).run(_resume_case, [(str(tmp_path), 1, 4), (str(tmp_path), 1, 2), (str(tmp_path), 4, 1)])
    assert_the_unsplit_model_resumes(tmp_path, STEPS)


# -- refusals ---------------------------------------------------------------------------------------


def _refusal_case(plan_path: str, *, rank: int, world: int) -> None:
    model, args, kwargs, _, loss_fn = gpt_case()
    example = dict(example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn)
    with pytest.raises(DistributedError) as e:  # 2 stages × dp_shard 2 need 4 ranks: the devices are the whole mesh
        autosplit.distribute(model, ["cpu"] * 4, **example, data_parallel=2, replicate="fully_shard", **NO_SEARCH)
    says(e, "the process group has 2 ranks, but 4 devices were given", "world size = len(devices)", "pass 2 devices")
    with pytest.raises(DistributedError) as e:  # a plan for the 4-rank mesh, on 2
        autosplit.distribute(model, None, **example, data_parallel=2, replicate="fully_shard", plan=plan_path)
    says(e, "2 ranks", "= 4", "another plan")
    with pytest.raises(ConstraintError) as refused:  # the plan's degrees, other than the arguments'
        autosplit.distribute(model, None, **example, data_parallel=1, plan=plan_path)
    says(refused, "'dp_shard': 2", "data_parallel=2", "replicate='fully_shard'")


def test_a_mesh_the_process_group_cannot_hold_is_refused_by_name(gloo, tmp_path):
    model, args, kwargs, _, _ = gpt_case()
    made = autosplit.plan(model, ["cpu"] * 4, example_inputs=args, example_kwargs=kwargs, data_parallel=2, replicate="fully_shard",
                          **NO_SEARCH)
    assert made.mesh == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
    made.save(tmp_path / "plan.json")
    gloo(2).run(_refusal_case, [(str(tmp_path / "plan.json"),)])


# -- a plan whose degrees the planner chose runs as it was made -------------------------------------


def _mesh_plan_case(plan_path: str, *, rank: int, world: int) -> None:
    model, args, kwargs, target, loss_fn = gpt_case()
    model = model.double()
    reference = copy.deepcopy(model)
    made = autosplit.Plan.load(plan_path)
    share = ROWS // made.data_parallel
    mine = slice(rank * share, (rank + 1) * share)
    pipe = autosplit.distribute(model, None, example_inputs=args, loss_fn=loss_fn, plan=plan_path, example_kwargs=kwargs)
    assert pipe.plan.mesh == made.mesh and math.prod(made.mesh.values()) == world  # the degrees the planner chose
    loss = pipe.step(*(a[mine] for a in args), target=target[mine], **{k: v[mine] for k, v in kwargs.items()})
    expected = reference_step(reference, args, kwargs, target, loss_fn, made.data_parallel)
    torch.testing.assert_close(loss, expected[rank], msg=where("loss"))
    ref_params = dict(reference.named_parameters())
    for pname, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p.grad), ref_params[pname].grad, msg=where(f"grad {pname}"))
    pipe.close()


@pytest.mark.smoke  # the fast tier's case of this runtime path
def test_a_plan_with_the_degrees_chosen_runs_as_it_was_made(gloo, tmp_path):
    """``plan(..., data_parallel=2, replicate="auto")`` chooses how the two copies keep in step with the
    split, over the global batch; ``distribute(plan=...)`` runs it with those degrees without being told."""
    model, args, kwargs, _, _ = gpt_case()
    made = autosplit.plan(model.double(), ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, data_parallel=2, replicate="auto",
                          **NO_SEARCH)
    assert made.mesh["pp"] == 1 and made.data_parallel == 2 and len(made.alternatives) == 2
    made.save(tmp_path / "plan.json")
    # a recipe with the layout the planner did not choose is a plan distribute runs just the same
    other = "replicate" if made.dp_shard > 1 else "fully_shard"
    recipe = autosplit.Planner(model.double(), ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, **NO_SEARCH).manual(
        autosplit.Recipe(data_parallel=2, replicate=other))
    assert recipe.mesh["pp"] == 1 and recipe.data_parallel == 2 and recipe.dp_shard != made.dp_shard
    recipe.save(tmp_path / "recipe.json")
    gloo(2).run(_mesh_plan_case, [(str(tmp_path / "plan.json"),), (str(tmp_path / "recipe.json"),)])
