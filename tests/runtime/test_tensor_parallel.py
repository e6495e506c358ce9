"""Tensor parallelism on the mesh's ``tp`` dimension trains like the unsplit model.

Each rank builds its part of a fixed plan (the split DP's, :data:`~tests.helpers.NO_SEARCH`), given
``tensor_parallel=2`` and ``tp_shards`` by hand: for the GPT the MLP pair of each block (``fc`` weight
and bias along 0, ``out``'s weight along 1); for a small transformers Llama (captured by
``torch.export``) the attention's q/k/v along 0 and o along 1, the MLP's gate/up along 0 and down along
1, the embedding and the head along 0 (vocabulary-parallel). Beside it, in the same process, the
unsplit model trains on the whole global batch. In float64 the losses of every step, every gradient
(whole, ``full_tensor``; the last step's clipped by the whole model's norm, ``pipe.clip_grad_norm_``)
and the parameters after 3 AdamW steps agree to rounding, and so does ``eval_step`` after them:

- tp 2 alone (2 processes), the planner's own plans (``tensor_parallel=2``: ``tp_shards`` from the graph's
  rules, the GPT's tied embedding and head vocabulary-parallel, a traced graph's ``nn.Embedding`` leaf);
  both models also under ``checkpointing="full"``, and compiled (``compile=True``, inductor);
- tp 2 × pp 2 (4); with two stages per rank too (interleaved 1F1B, the zero-bubble V);
- tp 2 × ``dp_replicate`` 2 (4, FSDP2's ``replicate``);
- tp 2 × pp 2 × ``dp_shard`` 2 (8, the GPT: FSDP2's ``fully_shard`` over the tp DTensors), and one stage under
  tp 2 × HSDP (8, the Llama).

A step under ``"bf16-mixed"`` agrees to bf16's precision (tp sums partial products in bfloat16). A
checkpoint saved under tp 2 × pp 2 loads under pp 2 alone, under tp 2 alone and into the unsplit
model; a model on the meta device takes its weights from one under tp 2 × pp 2. A world size other
than the mesh's and a ``tp_shards`` name the model lacks are refused by name.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import autosplit
from autosplit.errors import ConstraintError, DistributedError
from autosplit.runtime.checkpoint import load_checkpoint, save_checkpoint
from autosplit.runtime.placement import MESH_DIMS
from tests.helpers import NO_SEARCH, full_tensor, gpt_case, says, where
from tests.layouts import ROWS, assert_resumed, llama_case, lm_loss, reference_step, trained_reference

STEPS = 3
MICRO = 2
CLIP = 0.05
"""A max norm below the models' gradient norms, so that clipping scales every gradient."""
BF16_GRADIENT = 0.015
"""Under ``"bf16-mixed"``: the largest error of a gradient, relative to its norm (about 4 × bf16's 2^-8)."""


CASES = {"gpt": gpt_case, "gpt-vocab": gpt_case, "llama": llama_case}


def _rms_norm_in_its_dtype(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward`` without its cast to float32 (and back)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@contextlib.contextmanager
def _float64_throughout(name: str) -> Iterator[None]:
    """The Llama in float64 end to end while captured and run: transformers' ``LlamaRMSNorm`` normalises
    in float32 whatever its input's dtype. Its input sums a row-parallel product (``o_proj``,
    ``down_proj``) that tp 2 adds in two halves, so the float64 values differ from the unsplit model's
    in the last bits, and an element now and then rounds to the neighbouring float32: gradients differ
    at float32's precision (1e-8), and AdamW's normalised step makes that 1e-5 in a parameter whose
    gradient is near 0. Without the cast both models run float64 through and agree to rounding."""
    if name != "llama":
        yield
        return
    from transformers.models.llama import modeling_llama

    saved = modeling_llama.LlamaRMSNorm.forward
    setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_its_dtype)  # noqa: B010 -- a method, set for a while
    try:
        yield
    finally:
        setattr(modeling_llama.LlamaRMSNorm, "forward", saved)  # noqa: B010


def _shards(name: str, model: torch.nn.Module) -> dict[str, int]:
    """The tp_shards of the module docstring, by the model's own parameter names."""
    if name.startswith("gpt"):  # "gpt-vocab": its tied embedding and head too, vocabulary-parallel
        mlp = {k: 0 if ".fc." in k else 1 for k in dict(model.named_parameters()) if ".fc." in k or k.endswith(".out.weight")}
        return {**mlp, "wte.weight": 0, "head.weight": 0} if name == "gpt-vocab" else mlp
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
    row = ("o_proj", "down_proj")
    return {k: 0 if any(c in k for c in column) else 1 for k in dict(model.named_parameters(remove_duplicate=False))
            if k.endswith("weight") and any(c in k for c in (*column, *row))}


def _plan(name: str, stages: int, copies: int, tp: int, folder: str, replicate: str = "fully_shard", **options: Any) -> str:
    """A fixed plan of ``stages`` × ``copies`` (``dp_shard``, or ``dp_replicate`` under ``replicate="replicate"``)
    with ``tensor_parallel=tp`` set by hand, saved to a file; ``options``: other plan options (a multi-stage
    schedule), and ``dp_shard`` (below ``copies``: HSDP, set by hand as well)."""
    with _float64_throughout(name):
        return _made_plan(name, stages, copies, tp, folder, replicate, options)


def _made_plan(name: str, stages: int, copies: int, tp: int, folder: str, replicate: str, options: dict[str, Any]) -> str:
    shard = options.pop("dp_shard", None)
    torch.manual_seed(0)
    model, args, kwargs, _, _ = CASES[name]()
    rows = ROWS // copies
    options = {"schedule": "1f1b" if stages <= MICRO else "gpipe", "micro_batches": MICRO, **NO_SEARCH, **options}
    made = autosplit.plan(model.double(), ["cpu"] * stages, example_inputs=tuple(a[:rows] for a in args),
                          example_kwargs={k: v[:rows] for k, v in kwargs.items()}, data_parallel=copies,
                          replicate=replicate, **options)
    if tp > 1:
        made = dataclasses.replace(made, tensor_parallel=tp, tp_shards=_shards(name, model))
    if shard is not None:
        made = dataclasses.replace(made, dp_shard=shard)
    # gpt-vocab: the GPT's plan, its tp_shards its own
    path = (f"{folder}/{name}-pp{stages}-{replicate}{copies}-shard{made.dp_shard}-tp{tp}-{options['schedule']}"
            f"{'-recompute' if made.recompute else ''}.json")
    made.save(path)
    return path


def _distribute(model, args, kwargs, loss_fn, plan_path: str, compiled: bool = False) -> Any:
    made = autosplit.Plan.load(plan_path)
    rows = ROWS // made.data_parallel
    return autosplit.distribute(model, None, example_inputs=tuple(a[:rows] for a in args), plan=plan_path,
                                example_kwargs={k: v[:rows] for k, v in kwargs.items()}, loss_fn=loss_fn, compile=compiled)


def _check_placement(pipe: Any, rank: int, shards: dict[str, int]) -> None:
    """The rank sits where the mesh's row-major order puts it; every parameter is a DTensor on tp (and dp_shard)."""
    mesh = pipe.plan.mesh
    assert pipe.mesh.mesh_dim_names == MESH_DIMS and tuple(pipe.mesh.shape) == tuple(mesh.values())
    place, copy_, t = pipe.layout.place(pipe.stage_index), pipe.layout.replica, pipe.layout.tp_rank
    assert rank == (place * pipe.layout.replicas + copy_) * mesh["tp"] + t, (rank, place, copy_, t)
    dims = (*(d for d in ("dp_replicate", "dp_shard") if mesh[d] > 1), "tp")  # FSDP2 outside tp
    for pname, p in pipe.named_parameters():
        assert p.device_mesh.mesh_dim_names == dims, (pname, p.device_mesh)
        for dim, placement in zip(dims[:-1], p.placements):
            # fully_shard shards dimension 0 (a _StridedShard over a tp Shard(0): torch's 2-D order); replicate keeps it whole
            assert getattr(placement, "dim", None) == 0 if dim == "dp_shard" else placement.is_replicate(), (pname, p.placements)
        placement = p.placements[-1]
        assert placement.is_shard(shards[pname]) if pname in shards else placement.is_replicate(), (pname, placement)


def _planned(name: str, folder: str) -> str:
    """The planner's own plan of ``name`` with ``tensor_parallel=2`` over two devices (the whole mesh):
    its tp_shards from the graph's rules (:mod:`autosplit.passes.tensor_parallel`), not by hand."""
    with _float64_throughout(name):
        torch.manual_seed(0)
        model, args, kwargs, _, _ = CASES[name]()
        made = autosplit.plan(model.double(), ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, tensor_parallel=2,
                              data_parallel=1, micro_batches=MICRO, schedule="1f1b", **NO_SEARCH)
    assert made.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 2}
    if name == "llama":  # the rules find what a person writes by hand
        assert dict(made.tp_shards) == _shards(name, model), made.tp_shards
    else:  # the fused qkv stays whole, and the report's rows say why
        assert all(k in made.tp_shards for k in _shards(name, model)) and "blocks.0.attn.qkv" in made.tp_whole
    path = f"{folder}/{name}-planned-tp2.json"
    made.save(path)
    return path


def _train_case(name: str, plan_path: str, compiled: bool = False, *, rank: int, world: int) -> None:
    with _float64_throughout(name):
        _train(name, plan_path, rank, compiled)


def _train(name: str, plan_path: str, rank: int, compiled: bool = False) -> None:
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = CASES[name]()
    model = model.double()
    reference = copy.deepcopy(model)
    pipe = _distribute(model, args, kwargs, loss_fn, plan_path, compiled)
    assert set(pipe.compiled.values()) == ({"compiled"} if compiled else set()), pipe.compiled
    copies = pipe.plan.data_parallel
    _check_placement(pipe, rank, dict(pipe.plan.tp_shards))
    if pipe.plan.sequence_parallel:  # the activations between the split layers turned as planned
        code = "".join(m.code for m in pipe.module.modules() if isinstance(m, torch.fx.GraphModule))
        assert "to_token_shards" in code and "to_whole" in code, code[:2000]
    mine = slice(pipe.layout.replica * ROWS // copies, (pipe.layout.replica + 1) * ROWS // copies)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    what = f"{name} {pipe.plan.mesh} rank {rank}"
    for step in range(STEPS):
        loss = pipe.step(*(a[mine] for a in args), target=target[mine], **{k: v[mine] for k, v in kwargs.items()})
        expected = reference_step(reference, args, kwargs, target, loss_fn, copies)
        if pipe.is_last:
            torch.testing.assert_close(loss, expected[pipe.layout.replica], msg=where(f"{what} step {step} loss"))
        if step == STEPS - 1:  # the last step clipped by the whole model's norm (each element counted once)
            norm = pipe.clip_grad_norm_(CLIP)
            torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP), msg=where(f"{what} norm"))
        for pname, p in pipe.named_parameters():
            torch.testing.assert_close(full_tensor(p.grad), ref_params[pname].grad, msg=where(f"{what} step {step} grad {pname}"))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # inductor reassociates sums (gradients 1e-10 apart, relatively), which AdamW's m/√v magnifies where a gradient is
    # near 0: 3 steps of lr 1e-2 then leave a few weights up to 1e-6 apart
    after = 1e-5 if compiled else None
    for pname, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p), ref_params[pname], atol=after, rtol=after,
                                   msg=where(f"{what} {pname} after {STEPS} steps"))
    evaluated = pipe.eval_step(*(a[mine] for a in args), target=target[mine], **{k: v[mine] for k, v in kwargs.items()})
    with torch.no_grad():  # forward only, under the same scope as a step
        rows = {k: v[mine] for k, v in kwargs.items()}
        expected_loss = loss_fn(reference(*(a[mine] for a in args), **rows), target[mine])
    if pipe.is_last:
        torch.testing.assert_close(evaluated, expected_loss, msg=where(f"{what} eval_step"))
    pipe.close()


def test_tp2_alone_trains_like_the_unsplit_model(gloo, tmp_path):
    pytest.importorskip("transformers")
    # the planner's own plans (tp_shards from the graph: the GPT's MLPs and its tied table and head, the Llama's
    # attention, MLP, embedding and head); then activation checkpointing around the DTensor ops, by hand
    plans = [(name, _planned(name, str(tmp_path))) for name in ("gpt", "llama")]
    plans += [(name, _plan(name, 1, 1, 2, str(tmp_path), checkpointing="full")) for name in ("gpt", "llama")]
    gloo(2).run(_train_case, plans)


def _sequence_parallel(folder: str, stages: int) -> str:
    """The planner's own plan of the Llama with sequence parallelism over tp 2 (and ``stages`` along pp)."""
    with _float64_throughout("llama"):
        torch.manual_seed(0)
        model, args, kwargs, _, _ = CASES["llama"]()
        made = autosplit.plan(model.double(), ["cpu"] * 2 * stages, example_inputs=args, example_kwargs=kwargs, tensor_parallel=2,
                              data_parallel=1, sequence_parallel=True, micro_batches=MICRO, schedule="1f1b", **NO_SEARCH)
    assert made.sequence_parallel and made.mesh == {"pp": stages, "dp_replicate": 1, "dp_shard": 1, "tp": 2}
    path = f"{folder}/llama-sp-pp{stages}.json"
    made.save(path)
    return path


def test_sequence_parallel_trains_like_the_unsplit_model(gloo, tmp_path):
    """The norms and residuals between the split layers on half the tokens each (reduce-scatter after each
    row-parallel product and the lookup, all-gather before each column-parallel group): tp 2 alone and
    tp 2 × pp 2, the Llama (grouped-query attention), against the unsplit model in float64."""
    pytest.importorskip("transformers")
    gloo(2).run(_train_case, [("llama", _sequence_parallel(str(tmp_path), 1))])
    gloo(4).run(_train_case, [("llama", _sequence_parallel(str(tmp_path), 2))])


def test_compiled_tp_stages_train_like_the_unsplit_model(gloo, tmp_path):
    """``compile=True`` (inductor) after tp, as torchtitan orders them: the Llama with sequence parallelism
    and its vocabulary-parallel embedding and head, twice, so that the second compile finds the first's
    graphs in inductor's on-disk cache, which the ranks share and whose key does not hold the rank (a
    rank then ran the other's slice of the tokens: a loss 0.3% off, silently, until
    :func:`autosplit.compat.rank_local_compile`)."""
    pytest.importorskip("transformers")
    sequence = _sequence_parallel(str(tmp_path), 1)
    gloo(2).run(_train_case, [("llama", sequence, True), ("llama", sequence, True)])


def test_tp2_by_pp2_trains_like_the_unsplit_model(gloo, tmp_path):
    pytest.importorskip("transformers")
    plans = [("gpt", _plan("gpt", 2, 1, 2, str(tmp_path))), ("llama", _plan("llama", 2, 1, 2, str(tmp_path)))]
    gloo(4).run(_train_case, plans)


def test_tp2_by_pp2_with_two_stages_per_rank_trains_like_the_unsplit_model(gloo, tmp_path):
    """torch's multi-stage classes: interleaved 1F1B on the Llama; the zero-bubble V on the GPT with its tied
    embedding and head vocabulary-parallel (both arms of the V on one rank, a copy each, gradients summed per
    tp place; the backward split into input and weight passes)."""
    pytest.importorskip("transformers")
    multi = {"stages_per_rank": 2, "micro_batches": 4}
    plans = [("llama", _plan("llama", 2, 1, 2, str(tmp_path), schedule="interleaved1f1b", **multi)),
             ("gpt-vocab", _plan("gpt-vocab", 2, 1, 2, str(tmp_path), schedule="zbvzerobubble", **multi))]
    gloo(4).run(_train_case, plans)


def test_tp2_by_dp_replicate2_trains_like_the_unsplit_model(gloo, tmp_path):
    """FSDP2's ``replicate`` over ``dp_replicate`` keeps the tp DTensors' copies in step (one stage)."""
    pytest.importorskip("transformers")
    plans = [(name, _plan(name, 1, 2, 2, str(tmp_path), "replicate")) for name in ("gpt", "llama")]
    gloo(4).run(_train_case, plans)


def test_tp2_by_pp2_by_dp_shard2_trains_like_the_unsplit_model(gloo, tmp_path):
    """FSDP2's ``fully_shard`` over ``dp_shard`` wraps the stages whose parameters are already tp DTensors:
    each parameter a DTensor on the 2-D ``("dp_shard", "tp")`` mesh."""
    pytest.importorskip("transformers")
    plans = [("gpt", _plan("gpt", 2, 2, 2, str(tmp_path)))]  # the Llama's tp DTensors under FSDP2: the HSDP test below
    gloo(8, timeout=120).run(_train_case, plans)


def test_tp2_under_hsdp_trains_like_the_unsplit_model(gloo, tmp_path):
    """One stage on tp 2 × ``dp_replicate`` 2 × ``dp_shard`` 2 (HSDP, from a plan given those degrees): the Llama in
    one micro-batch (one row: FSDP alone, each decoder layer outlined as a unit of its own, its graph a module
    inside the stage's)."""
    pytest.importorskip("transformers")
    plans = [("llama", _plan("llama", 1, 4, 2, str(tmp_path), dp_shard=2, micro_batches=1))]
    gloo(8, timeout=120).run(_train_case, plans)


def _bf16_case(plan_path: str, *, rank: int, world: int) -> None:
    """One step under ``"bf16-mixed"`` beside the unsplit model under ``torch.autocast``, micro-batch by micro-batch."""
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    reference = copy.deepcopy(model)
    pipe = _distribute(model, args, kwargs, loss_fn, plan_path)
    assert pipe.plan.precision == "bf16-mixed"
    loss = pipe.step(*args, target=target, **kwargs)
    losses = []
    for rows in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            part = loss_fn(reference(*(a[rows] for a in args), **{k: v[rows] for k, v in kwargs.items()}), target[rows])
        (part / MICRO).backward()
        losses.append(part.detach())
    torch.testing.assert_close(loss, torch.stack(losses).mean(), rtol=1e-4, atol=1e-5, msg=where("bf16-mixed loss"))
    ref_params = dict(reference.named_parameters())
    for pname, p in pipe.named_parameters():
        grad, expected = full_tensor(p.grad), ref_params[pname].grad
        error = float((grad - expected).norm() / expected.norm())
        assert error < BF16_GRADIENT, f"bf16-mixed {pname}: gradient off by {error:.2%} of its norm"
    pipe.close()


def test_bf16_mixed_under_tp2_agrees_to_bf16s_precision(gloo, tmp_path):
    """tp 2 sums each row-parallel product's halves in bfloat16 (DTensor's partial sums, all-reduced in the
    compute dtype, as Megatron's do), where the unsplit model accumulates the whole product in float32:
    the loss agrees to 1e-5 and each gradient to about bf16's precision (0.2–0.7 % of its norm measured,
    2^-8 ≈ 0.4 %), which float64 cannot show."""
    torch.manual_seed(0)
    model, args, kwargs, _, _ = gpt_case()
    made = autosplit.plan(model, ["cpu"], example_inputs=args, example_kwargs=kwargs, schedule="1f1b", micro_batches=MICRO,
                          precision="bf16-mixed", **NO_SEARCH)
    dataclasses.replace(made, tensor_parallel=2, tp_shards=_shards("gpt-vocab", model)).save(tmp_path / "bf16.json")
    gloo(2).run(_bf16_case, [(str(tmp_path / "bf16.json"),)])


# -- a checkpoint moves between layouts -------------------------------------------------------------


def _save_case(plan_path: str, folder: str, *, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    pipe = _distribute(model.double(), args, kwargs, loss_fn, plan_path)
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
    pipe = _distribute(model, args, kwargs, loss_fn, plan_path)
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
    gloo(4).run(_save_case, [(_plan("gpt", 2, 1, 2, folder), folder)])
    gloo(2).run(_resume_case, [(_plan("gpt", 2, 1, 1, folder), folder), (_plan("gpt", 1, 1, 2, folder), folder)])
    reference, ref_opt, (args, kwargs, target, loss_fn) = trained_reference(STEPS)
    torch.manual_seed(7)
    unsplit = type(reference)(vocab=40, d_model=16, n_layers=2, n_heads=2, max_len=8).double()
    opt = torch.optim.AdamW(unsplit.parameters(), lr=5.0)
    load_checkpoint(tmp_path / "ckpt", unsplit, opt)
    assert_resumed(dict(unsplit.named_parameters()), opt, reference, ref_opt, "the unsplit model")
    for model, optimizer in ((unsplit, opt), (reference, ref_opt)):
        reference_step(model, args, kwargs, target, loss_fn, 1)
        optimizer.step()
    assert_resumed(dict(unsplit.named_parameters()), opt, reference, ref_opt, "the unsplit model, one step on")


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


def test_a_meta_model_under_tp2_by_pp2_takes_its_weights_from_a_checkpoint(gloo, tmp_path):
    """Each rank materialises its stage whole from the checkpoint (the unsplit model's, ``save_checkpoint``),
    then splits it over tp: the GPT with its tied embedding and head vocabulary-parallel."""
    torch.manual_seed(0)
    model, *_ = gpt_case()
    save_checkpoint(tmp_path / "ckpt", model.double())
    gloo(4).run(_meta_case, [(_plan("gpt-vocab", 2, 1, 2, str(tmp_path)), str(tmp_path / "ckpt"))])


# -- refusals ---------------------------------------------------------------------------------------


def _refusal_case(folder: str, *, rank: int, world: int) -> None:
    model, args, kwargs, _, loss_fn = gpt_case()
    model = model.double()  # as the plans were made
    example = dict(example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn)
    with pytest.raises(DistributedError) as e:  # tp 2 × pp 2 need 4 ranks
        autosplit.distribute(model, None, **example, plan=f"{folder}/gpt-pp2-fully_shard1-shard1-tp2-1f1b.json")
    says(e, "2 ranks", "pp × dp_replicate × dp_shard × tp = 2 × 1 × 1 × 2 = 4", "× 2 × 2)")
    made = autosplit.Plan.load(f"{folder}/gpt-pp1-fully_shard1-shard1-tp2-1f1b.json")
    for shards, names in [({"blocks.0.fc.weight": 0, "blocks.0.mlp.weight": 0}, ["'blocks.0.mlp.weight'", "named_parameters"]),
                          ({"blocks.0.fc.bias": 1}, ["'blocks.0.fc.bias'", "dimension 1"]),
                          ({"wte.weight": 0, "head.weight": 1}, ["head.weight", "wte.weight", "tied"])]:
        with pytest.raises(ConstraintError) as refused:
            autosplit.distribute(model, None, **example, plan=dataclasses.replace(made, tp_shards=shards))
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
    _plan("gpt", 2, 1, 2, str(tmp_path))
    _plan("gpt", 1, 1, 2, str(tmp_path))
    gloo(2).run(_refusal_case, [(str(tmp_path),)])
