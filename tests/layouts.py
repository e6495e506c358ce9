"""What the tests of a mesh's layouts share (``tests/runtime/test_sharded_layouts.py``,
``tests/tp_cases.py``): the language models trained there, the unsplit reference
step on the global batch, and the check that a resumed model and optimizer equal the reference's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tests.helpers import full_tensor, gpt_case, where

ROWS = 8
"""The global batch of every case."""


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def llama_case() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, Any]:
    """A small transformers Llama (grouped-query attention, captured by ``torch.export``) and a global batch of ``ROWS``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=16, attn_implementation="eager")
    tokens = torch.randint(0, 128, (ROWS, 8))
    return LlamaForCausalLM(LlamaConfig(**shape)), (tokens,), {}, torch.randint(0, 128, (ROWS, 8)), lm_loss


def forward_in(model: torch.nn.Module, precision: str, args: tuple, kwargs: dict, *, tied_apart: bool = False) -> Any:
    """``model``'s forward as ``precision`` runs it unsplit: under autocast for bf16-mixed; for
    bf16-fsdp, FSDP2's ``MixedPrecisionPolicy`` by its definition — every floating parameter cast to
    bf16, floating inputs too, the gradients flowing back to the fp32 parameters through the casts.
    ``tied_apart``: each name of a tied parameter cast apart, as the stages that each hold a copy of it
    cast their own (their gradients then meet in fp32, not in bf16: one rounding apart)."""
    if precision != "bf16-fsdp":
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            return model(*args, **kwargs)
    low = lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    cast = {name: low(p) for name, p in model.named_parameters(remove_duplicate=not tied_apart)}
    return torch.func.functional_call(model, cast, tuple(low(a) for a in args), {k: low(v) for k, v in kwargs.items()},
                                      tie_weights=not tied_apart)


def reference_step(
    model, args, kwargs, target, loss_fn, copies: int, precision: str = "fp32", chunks: int = 1, *, tied_apart: bool = False,
) -> list[torch.Tensor]:
    """The unsplit model on the global batch, copy by copy (and ``chunks`` micro-batches each, as
    ``precision`` runs it: :func:`forward_in`): gradients of the global batch's mean loss; returns each
    data-parallel copy's mean loss."""
    parts = copies * chunks
    losses = []
    for c in range(parts):
        rows = slice(c * ROWS // parts, (c + 1) * ROWS // parts)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):  # the loss too
            out = forward_in(model, precision, tuple(a[rows] for a in args), {k: v[rows] for k, v in kwargs.items()}, tied_apart=tied_apart)
            loss = loss_fn(out, target[rows])
        (loss / parts).backward()
        losses.append(loss.detach())
    return [torch.stack(losses[c * chunks:(c + 1) * chunks]).mean() for c in range(copies)]


def trained_reference(steps: int) -> tuple[Any, torch.optim.Optimizer, tuple]:
    """The unsplit GPT (seed 0, float64) after ``steps`` AdamW steps on the global batch, its optimizer, and the case."""
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    model = model.double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        reference_step(model, args, kwargs, target, loss_fn, 1)
        opt.step()
        opt.zero_grad()
    return model, opt, (args, kwargs, target, loss_fn)


def assert_resumed(named: dict[str, torch.Tensor], opt: torch.optim.Optimizer, reference: Any, ref_opt: Any, what: str) -> None:
    """Parameters and every AdamW state entry (and the learning rate) equal the reference's."""
    ref_params = dict(reference.named_parameters())
    assert opt.param_groups[0]["lr"] == 1e-2, what
    for pname, p in named.items():
        torch.testing.assert_close(full_tensor(p), ref_params[pname], msg=where(f"{what}: {pname}"))
        state, ref_state = opt.state[p], ref_opt.state[ref_params[pname]]
        assert set(state) == set(ref_state), (what, pname, set(state))
        for key, value in ref_state.items():
            torch.testing.assert_close(full_tensor(state[key]), value, msg=where(f"{what}: {pname} optimizer {key}"))


def assert_the_unsplit_model_resumes(folder: Any, steps: int) -> None:
    """A GPT of other initial weights loads ``folder/ckpt`` (saved after ``steps`` AdamW steps under some
    layout): its parameters and AdamW state equal the unsplit reference's, and so do they one step on."""
    from autosplit.runtime.checkpoint import load_checkpoint

    reference, ref_opt, (args, kwargs, target, loss_fn) = trained_reference(steps)
    torch.manual_seed(7)
    unsplit = type(reference)(vocab=40, d_model=16, n_layers=2, n_heads=2, max_len=8).double()
    opt = torch.optim.AdamW(unsplit.parameters(), lr=5.0)
    load_checkpoint(Path(folder) / "ckpt", unsplit, opt)
    assert_resumed(dict(unsplit.named_parameters()), opt, reference, ref_opt, "the unsplit model")
    for model, optimizer in ((unsplit, opt), (reference, ref_opt)):
        reference_step(model, args, kwargs, target, loss_fn, 1)
        optimizer.step()
    assert_resumed(dict(unsplit.named_parameters()), opt, reference, ref_opt, "the unsplit model, one step on")
