"""torch.distributed.pipelining's own test models and the training-code patterns of ``tests/helpers.py``
through :func:`autosplit.distribute` on 2 gloo processes: losses and parameters after 3 Adam steps
equal single-process training of the unsplit model (float64), ``distribute`` leaves the model as
it was, and ``full_state_dict`` holds every entry of the model's state dict.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect

import pytest
import torch

from tests.helpers import NO_SEARCH, PATTERNS, PIPELINING, AutocastRegion, D, OptionalMask, pipelining_inputs, where

STEPS = 3
MICRO = 2


def _cases():
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(1))
    for name in PIPELINING:
        yield name, PIPELINING[name][0], pipelining_inputs(name), torch.float64
    for name in ("frozen backbone", "gradient reversal", "root hooks", "EMA teacher", "tensor default",
                 "dict subclass output", "dataclass output", "named tuple output"):
        yield name, PATTERNS[name], (x,), torch.float64
    yield "optional mask", OptionalMask, (x, None), torch.float64
    # bf16 crosses between the stages where the autocast region is cut: against the same autocast unsplit
    yield "autocast", AutocastRegion, (x,), torch.float32


def _loss(out, target):
    """Squared error of every output tensor against the target's first columns (any output structure)."""
    if isinstance(out, torch.Tensor):
        leaves = [out]
    elif dataclasses.is_dataclass(out):
        leaves = [getattr(out, f.name) for f in dataclasses.fields(out)]
    else:
        leaves = list(out.values() if isinstance(out, dict) else out)
    return sum(((t.to(target.dtype) - target[..., : t.shape[-1]]) ** 2).mean() for t in leaves)


def _micro_call(model, inputs, rows: slice):
    """``model`` on some rows of the batch: every batch-sized tensor argument, defaults included, is cut."""
    bound = inspect.signature(model.forward).bind(*inputs)
    bound.apply_defaults()
    cut = [x[rows] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == 4 else x for x in bound.arguments.values()]
    return model(*cut)


def _zoo_case(name: str, *, rank: int, world: int) -> None:
    import autosplit
    from autosplit.passes.fidelity import ModelSnapshot

    factory, inputs, dtype = next(case[1:] for case in _cases() if case[0] == name)
    torch.manual_seed(0)
    model = factory().to(dtype)
    inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) else x for x in inputs)
    target = torch.randn(4, 8, dtype=dtype, generator=torch.Generator().manual_seed(3))
    reference = copy.deepcopy(model)
    snapshot = ModelSnapshot.of(model)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=inputs, loss_fn=_loss, schedule="gpipe",
                                micro_batches=MICRO, **NO_SEARCH)
    assert snapshot.changes(model, versions=False) == [], name
    assert all(torch.equal(v, values[k]) for k, v in model.state_dict().items()), f"{name}: distribute changed weights"
    own = list(pipe.parameters())  # a stage may hold only parameter-free ops
    opt = torch.optim.Adam(own, lr=1e-2) if own else None
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(STEPS):
        loss = pipe.step(*inputs, target=target)
        # The reference runs the pipeline's micro-batches in turn (the EMA teacher updates once per micro-batch).
        rows = 4 // MICRO
        expected = torch.stack([
            _loss(_micro_call(reference, inputs, slice(i * rows, (i + 1) * rows)), target[i * rows:(i + 1) * rows])
            for i in range(MICRO)
        ]).mean()
        expected.backward()
        if pipe.is_last:
            torch.testing.assert_close(loss, expected.detach(), msg=where(f"{name} step {step} loss"))
        for o in filter(None, (opt, ref_opt)):
            o.step()
            o.zero_grad()
    reference_state = reference.state_dict()
    for pname, p in pipe.named_parameters():
        torch.testing.assert_close(p, reference_state[pname], msg=where(f"{name} {pname} after {STEPS} steps"))
    full = pipe.full_state_dict()
    assert set(full) == set(reference_state), f"{name}: full_state_dict lacks {set(reference_state) - set(full)}"
    fresh = factory().to(dtype)  # (not a deepcopy: MultiMLPWithDw keeps an activation on the module)
    fresh.load_state_dict(full)
    for key, value in reference_state.items():
        torch.testing.assert_close(fresh.state_dict()[key], value, msg=where(f"{name} {key}"))


def test_zoo_trains_through_distribute_like_the_unsplit_model(gloo):
    gloo(2).run(_zoo_case, [(name,) for name, *_ in _cases()])


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
