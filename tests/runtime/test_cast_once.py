"""Under a mixed precision each weight is cast once per step, and that one compute copy is shared by
every micro-batch (:func:`autosplit.runtime.precision.cast_once`; DESIGN §4.9).

- On CPU, with real autocast: over a step of 4 micro-batches the tensors saved for backward hold one
  bf16 copy of each weight, where per-micro-batch autocast alone (the runtime before) saves 4; the
  gradients are bitwise those of per-micro-batch autocast, through recomputation too, and over two
  steps with an AdamW step between (a copy kept past the step would be stale: shown to differ).
- On 2 gloo processes, bf16-mixed GPT pipelines (GPipe, 1F1B, the split backward of a zero-bubble
  schedule, FSDP2 replicas) save one copy per weight per step, cast each weight once in
  ``eval_step``, and train like the unsplit model under autocast with the same micro-batches.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

import autosplit
from autosplit.compat import TorchDispatchMode
from autosplit.microbatch import split_batch
from autosplit.runtime.precision import autocast, cast_once
from tests.helpers import NO_SEARCH, full_tensor, gpt_case, where

MICRO = 4
TOL: dict[str, Any] = {"rtol": 1e-3, "atol": 1e-4}
"""bf16-mixed's tolerance in tests/runtime/test_precision.py: split and unsplit differ in summation orders only."""


def _matmul_weights(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The 2-D parameters (matmul weights and embedding tables), whole (FSDP2's DTensors gathered)."""
    return {n: full_tensor(p).detach() for n, p in named.items() if p.dim() == 2}


@contextlib.contextmanager
def _saved_copies(weights: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> Iterator[dict[str, set[int]]]:
    """Weight name → the storages of the tensors saved for backward inside that are its ``dtype`` copy
    (the whole storage equal to the weight cast to ``dtype``; the weights do not change inside a step)."""
    low = {n: w.to(dtype).flatten() for n, w in weights.items()}
    found: dict[str, set[int]] = {n: set() for n in weights}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == dtype:
            storage = t.untyped_storage()
            whole = torch.empty(0, dtype=dtype, device=t.device).set_(storage)
            for n, w in low.items():
                if whole.numel() == w.numel() and torch.equal(whole, w):
                    found[n].add(storage.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield found


class _CountCasts(TorchDispatchMode):
    """How many times each of ``weights`` is cast to bf16 inside (by the storage it is cast from)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = {w.untyped_storage().data_ptr(): n for n, w in weights.items()}
        self.casts = dict.fromkeys(weights, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.casts[name] += 1
        return func(*args, **kwargs)


# -- one process, real autocast ---------------------------------------------------------------------


def _step(model, args, kwargs, target, loss_fn, *, once: bool, recompute: bool = False) -> torch.Tensor:
    """One step of ``MICRO`` micro-batches, each forward under its own bf16 autocast (as the stages run
    them), the backwards after all forwards (GPipe's order) outside autocast; inside one
    :func:`cast_once` when ``once``. Returns the mean loss."""
    losses = []
    with cast_once("bf16-mixed", "cpu") if once else contextlib.nullcontext():
        for (a, k), t in zip(split_batch(args, kwargs, MICRO), target.chunk(MICRO)):
            with autocast("bf16-mixed", "cpu"):
                if recompute:
                    out = torch.utils.checkpoint.checkpoint(model, *a, use_reentrant=False, **k)
                else:
                    out = model(*a, **k)
                losses.append(loss_fn(out, t) / MICRO)
        for loss in losses:
            loss.backward()
    return torch.stack([loss.detach() for loss in losses]).sum()


def test_a_step_saves_one_bf16_copy_of_each_weight_where_per_micro_batch_autocast_saves_one_per_micro_batch():
    model, args, kwargs, target, loss_fn = gpt_case()
    weights = _matmul_weights(dict(model.named_parameters()))
    counts = {}
    for once in (False, True):
        with _saved_copies(weights) as found:
            _step(model, args, kwargs, target, loss_fn, once=once)
        counts[once] = {n: len(s) for n, s in found.items() if s}
    cast = [n for n in weights if n != "wpe.weight"]  # the position table is only looked up: autocast casts it nowhere
    assert sorted(counts[True]) == sorted(cast), counts
    assert set(counts[True].values()) == {1}, f"one copy per weight per step: {counts[True]}"
    assert counts[False] == dict.fromkeys(cast, MICRO), f"the runtime before: one per micro-batch: {counts[False]}"


def _train(model, args, kwargs, target, loss_fn, *, once: bool, recompute: bool) -> list[tuple[torch.Tensor, dict, dict]]:
    """Two steps with an AdamW step after each: per step its loss, gradients and the weights after it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kept = []
    for _ in range(2):
        loss = _step(model, args, kwargs, target, loss_fn, once=once, recompute=recompute)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        kept.append((loss, grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return kept


def test_gradients_equal_per_micro_batch_autocast_bitwise_over_two_optimizer_steps():
    """Losses, gradients and the weights after each AdamW step are bitwise those of per-micro-batch
    autocast, with and without recomputation in the backward (which reads the shared copy); a copy
    kept across the optimizer step (one scope held over both steps) would be stale, and differs."""
    model, args, kwargs, target, loss_fn = gpt_case()
    for recompute in (False, True):
        reference = _train(copy.deepcopy(model), args, kwargs, target, loss_fn, once=False, recompute=recompute)
        once = _train(copy.deepcopy(model), args, kwargs, target, loss_fn, once=True, recompute=recompute)
        for step, ((loss, grads, weights), (ref_loss, ref_grads, ref_weights)) in enumerate(zip(once, reference)):
            case = f"recompute={recompute} step {step}"
            assert torch.equal(loss, ref_loss), f"{case} loss {loss} vs {ref_loss}"
            for name, g in grads.items():
                assert torch.equal(g, ref_grads[name]), f"{case} grad {name}"
                assert torch.equal(weights[name], ref_weights[name]), f"{case} {name} after AdamW"
        with cast_once("bf16-mixed", "cpu"):
            stale = _train(copy.deepcopy(model), args, kwargs, target, loss_fn, once=False, recompute=recompute)
        assert torch.equal(stale[0][0], reference[0][0]) and not torch.equal(stale[1][0], reference[1][0]), (
            "a scope held over the optimizer step keeps the first step's copies: the second step would compute with stale weights")


# -- two gloo processes ----------------------------------------------------------------------------


def _reference_step(model, args, kwargs, target, loss_fn, chunks: int) -> torch.Tensor:
    """The unsplit model micro-batch by micro-batch, each forward and loss under autocast, gradients as the mean loss's."""
    losses = []
    for (a, k), t in zip(split_batch(args, kwargs, chunks), target.chunk(chunks)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model(*a, **k), t) / chunks
        loss.backward()
        losses.append(loss.detach() * chunks)
    return torch.stack(losses).mean()


def _pipeline_case(schedule: str, dp: int, replicate: Literal["replicate", "fully_shard"], *, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    reference = copy.deepcopy(model)
    rows = args[0].shape[0] // dp
    mine = slice(rank % dp * rows, (rank % dp + 1) * rows)
    my_args, my_kwargs = tuple(a[mine] for a in args), {k: v[mine] for k, v in kwargs.items()}
    pipe = autosplit.distribute(model, ["cpu"] * world, example_inputs=args, example_kwargs=kwargs,
                                loss_fn=loss_fn, schedule=schedule, micro_batches=MICRO, data_parallel=dp,
                                replicate=replicate, precision="bf16-mixed", **NO_SEARCH)
    opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3), torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_params = dict(reference.named_parameters())
    case = f"{schedule} dp={dp} {replicate} rank {rank}"
    for step in range(3):
        with _saved_copies(_matmul_weights(dict(pipe.named_parameters()))) as found:
            loss = pipe.step(*my_args, target=target[mine], **my_kwargs)
        copies = {n: len(s) for n, s in found.items() if s}
        assert copies and set(copies.values()) == {1}, f"{case} step {step}: bf16 copies saved per weight {copies}"
        expected = _reference_step(reference, args, kwargs, target, loss_fn, chunks=MICRO * dp)
        if pipe.is_last and dp == 1:
            torch.testing.assert_close(loss, expected, **TOL, msg=where(f"{case} step {step} loss"))
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(full_tensor(p.grad), ref_params[name].grad, **TOL, msg=where(f"{case} step {step} grad {name}"))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p), ref_params[name], **TOL, msg=where(f"{case} {name} after 3 steps"))
    if dp == 1:  # forward only: each weight the step cast is cast once for the whole batch
        counter = _CountCasts({n: p for n, p in pipe.named_parameters() if p.dim() == 2})
        with counter:
            pipe.eval_step(*my_args, target=target[mine], **my_kwargs)
        assert {n: c for n, c in counter.casts.items() if c} == dict.fromkeys(copies, 1), f"{case} eval_step casts {counter.casts}"
    dist.barrier()


def test_bf16_mixed_pipelines_cast_once_per_step_and_train_like_the_unsplit_model(gloo):
    gloo(2).run(_pipeline_case, [
        ("gpipe", 1, "replicate"), ("1f1b", 1, "replicate"), ("interleavedzerobubble", 1, "replicate"),
        ("1f1b", 2, "fully_shard"), ("gpipe", 2, "replicate"),
    ])
