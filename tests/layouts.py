"""The harness every "trains like the unsplit model" case of a mesh's layouts runs on
(``tests/runtime/test_distributed.py``, ``test_hybrid_mesh.py``, ``test_sharded_layouts.py``, ``test_float8_stages.py``,
``tests/tp_cases.py``): the models trained there (:data:`MODELS`), the unsplit reference step on the global batch, the
training of a pipeline beside it (:func:`train_alike`, held to a :class:`Comparison`), a row of a table — a model, a
layout (``distribute``'s options) and a comparison — built and trained (:func:`trained_layout`), and the check that a
resumed model and optimizer equal the reference's.

A case of a new axis is a row (a layout, and its comparison where it rounds apart) and the checks only that axis
has (where its parameters sit, which modules it converted); the steps and what they are compared on are these.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tests.helpers import NO_SEARCH, InceptionNet, as_float64, full_tensor, gpt2_lm, gpt_case, where

ROWS = 8
"""The global batch of every case."""


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def llama_case(layers: int = 2) -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, Any]:
    """A small transformers Llama of ``layers`` decoder layers (grouped-query attention, captured by ``torch.export``) and a
    global batch of ``ROWS``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=16, attn_implementation="eager")
    tokens = torch.randint(0, 128, (ROWS, 8))
    return LlamaForCausalLM(LlamaConfig(**shape)), (tokens,), {}, torch.randint(0, 128, (ROWS, 8)), lm_loss


def gpt2_case() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, Any]:
    """A two-layer transformers GPT-2 (its output a dict of logits) and a global batch of ``ROWS``."""
    return gpt2_lm(), (torch.randint(0, 60, (ROWS, 8)),), {}, torch.randint(0, 60, (ROWS, 8)), lm_loss


def inception_case() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, Any]:
    """Parallel branches with BatchNorm: compared micro-batch by micro-batch (``Comparison.chunks``)."""
    return InceptionNet(), (torch.randn(ROWS, 3, 12, 12),), {}, torch.randint(0, 5, (ROWS,)), F.cross_entropy


def gnmt_case() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, Any]:
    """GNMT's LSTMs: two inputs (source and target tokens)."""
    from benchmarks.workloads.models import GNMT

    src, tgt = torch.randint(0, 30, (ROWS, 5)), torch.randint(0, 30, (ROWS, 4))
    return GNMT(vocab=30, hidden=8, layers=3), (src, tgt), {}, torch.randint(0, 30, (ROWS, 4)), lm_loss


def moe_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, and the router's load-balancing loss where the model returns one (as Mixtral's own loss adds it):
    a statistic of each forward call's tokens, so the reference runs copy by copy as the pipeline does."""
    aux = out.get("aux_loss")
    return lm_loss(out, target) + (0.02 * aux if aux is not None else 0.0)


def _moe_case(family: str) -> Callable[[], tuple[torch.nn.Module, tuple, dict, torch.Tensor, Any]]:
    def case() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, Any]:
        """A tiny transformers mixture of experts (``tests/moe_cases.py``: 4 experts, top 2) and a global batch of ``ROWS``."""
        from tests.moe_cases import VOCAB, moe_model

        model = moe_model(family)  # seeded: every rank builds the same weights
        return model, (torch.randint(0, VOCAB, (ROWS, 8)),), {}, torch.randint(0, VOCAB, (ROWS, 8)), moe_loss

    return case


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple, dict, torch.Tensor, Any]]] = {
    "gpt": gpt_case, "llama": llama_case, "gpt2": gpt2_case, "inception": inception_case, "gnmt": gnmt_case,
    "qwen3_moe": _moe_case("qwen3_moe"), "deepseek_v3": _moe_case("deepseek_v3"),
}
"""The models of the table, each a function of no arguments: the model, its global batch's args and kwargs, a target,
a loss. Seeded by the caller."""


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


@dataclasses.dataclass(frozen=True)
class Comparison:
    """How a pipeline's training is held to the unsplit model's (:func:`train_alike`)."""

    steps: int = 3
    precision: str = "fp32"
    """How the unsplit model runs (:func:`forward_in`)."""
    chunks: int = 1
    """Micro-batches per data-parallel copy the unsplit model runs: a mixed precision rounds each apart."""
    tied_apart: bool = False
    """A tied weight cast apart on each of its stages (:func:`forward_in`)."""
    tol: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``assert_close``'s tolerances for the losses and gradients (empty: its defaults, float64 rounding)."""
    after: dict[str, Any] | None = None
    """Those for the parameters after the steps (None: ``tol``)."""
    clip: float | None = None
    """The last step's gradients clipped to this global norm, the norm compared with the unsplit model's."""


def train_alike(pipe: Any, reference: torch.nn.Module, case: tuple, comparison: Comparison, what: str) -> tuple[Any, Any, slice]:
    """``comparison.steps`` AdamW steps of ``pipe`` on its data-parallel copy's rows of the global batch, and of the
    unsplit ``reference`` on all of it (``case``: its args, kwargs, target and loss): every step's loss on the last
    stage, every gradient, the clipped norm, and the parameters after. Returns both optimizers and the copy's rows."""
    args, kwargs, target, loss_fn = case
    copies = pipe.layout.replicas
    mine = slice(pipe.layout.replica * ROWS // copies, (pipe.layout.replica + 1) * ROWS // copies)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_params, tol = dict(reference.named_parameters()), comparison.tol
    for step in range(comparison.steps):
        loss = pipe.step(*(a[mine] for a in args), target=target[mine], **{k: v[mine] for k, v in kwargs.items()})
        expected = reference_step(reference, args, kwargs, target, loss_fn, copies, comparison.precision, comparison.chunks,
                                  tied_apart=comparison.tied_apart)
        assert (loss is None) == (not pipe.is_last), f"{what} step {step}: the last stage returns the loss, no other"
        if pipe.is_last:
            torch.testing.assert_close(loss, expected[pipe.layout.replica], **tol, msg=where(f"{what} step {step} loss"))
        if comparison.clip is not None and step == comparison.steps - 1:  # by the whole model's norm, each element once
            norm = pipe.clip_grad_norm_(comparison.clip)
            torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), comparison.clip), **tol,
                                       msg=where(f"{what} norm"))
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(full_tensor(p.grad), ref_params[name].grad, **tol, msg=where(f"{what} step {step} grad {name}"))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    after = tol if comparison.after is None else comparison.after
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p), ref_params[name], **after, msg=where(f"{what} {name} after {comparison.steps} steps"))
    return opt, ref_opt, mine


def trained_layout(model: str, layout: dict[str, Any], comparison: Comparison, *, rank: int, world: int) -> tuple[Any, Any]:
    """A row of the table on this rank: :data:`MODELS`' ``model`` (seed 0; in float64, inputs too, when the comparison is
    in fp32) distributed over the whole mesh of ``world`` ranks on the global batch with ``layout``'s options over a
    fixed plan's (:data:`~tests.helpers.NO_SEARCH`), trained beside the unsplit model (:func:`train_alike`). Returns the
    pipeline and the reference, for the row's own checks."""
    import autosplit

    torch.manual_seed(0)
    net, args, kwargs, target, loss_fn = MODELS[model]()
    if comparison.precision == "fp32":
        net, args, kwargs = net.double(), tuple(as_float64(a) for a in args), {k: as_float64(v) for k, v in kwargs.items()}
    reference = copy.deepcopy(net)
    pipe = autosplit.distribute(net, ["cpu"] * world, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn,
                                **{**NO_SEARCH, **layout})
    assert {n for n, _ in pipe.named_parameters()} <= {n for n, _ in reference.named_parameters()}, "the original names"
    train_alike(pipe, reference, (args, kwargs, target, loss_fn), comparison, f"{model} {layout} rank {rank}")
    return pipe, reference


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
