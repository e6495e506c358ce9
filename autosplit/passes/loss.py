"""Loss: the training loss, costed as the last stage runs it.

``loss_fn(output, target)`` runs once per micro-batch on the stage that returns the model's output.
Over a large vocabulary (a language model's cross-entropy) it is no small part of a step. Given the loss and an
example target, the estimate pass charges its time and what it saves for backward to the node that
makes the model's output (``autosplit.passes.costs.estimate``); without them the loss is not costed.

- **analytic**: the loss runs on fake tensors shaped as one micro-batch's output
  (:func:`output_like`), its forward and its backward each under torch's ``FlopCounterMode`` and a
  dispatch mode that counts the bytes every ATen op reads and writes; each is costed with the
  roofline of the model's nodes, one launch per op.
- **measured**: forward and backward are timed on real tensors of that shape on the device
  (random outputs, the target's first micro-batch).

Usage::

    cost = cost_loss(Loss(loss_fn, target), output_like(captured, micro_inputs), 4, specs)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autosplit.compat import FakeTensorMode, TorchDispatchMode, graph_codegen, pytree
from autosplit.compat import PyTreeCodeGen as _PyTreeCodeGen
from autosplit.devices import DeviceSpec
from autosplit.errors import CostModelError, advice
from autosplit.microbatch import split_target
from autosplit.passes.autocast_policy import precision_context
from autosplit.passes.capture import Captured
from autosplit.passes.costs import LossCost
from autosplit.passes.in_context import flat
from autosplit.passes.time_model import roofline
from autosplit.timers import timed

__all__ = ["Loss", "LossCost", "cost_loss", "output_like"]


@dataclass(frozen=True)
class Loss:
    """The training loss the plan is for: ``fn(output, target)``, and an example ``target`` of the
    whole batch (cut into micro-batches by :func:`autosplit.microbatch.split_batch`)."""

    fn: Callable[[Any, Any], torch.Tensor]
    target: Any


class _Traffic(TorchDispatchMode):
    """Bytes every ATen op reads and writes (each tensor argument and result), and the ops run."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.bytes += sum(t.nbytes for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        return out


def output_like(captured: Captured, inputs: Sequence[Any], precision: str = "fp32", device_type: str = "cpu") -> Any:
    """The model's output for ``inputs`` (one micro-batch) as meta tensors, made on fake tensors:
    nothing is computed or allocated, on a meta model too."""
    gm = captured.gm
    state = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
    meta = any(t.is_meta for t in state.values())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, precision_context(precision, device_type):
        fake = [mode.from_tensor(x.to("meta") if meta else x) if isinstance(x, torch.Tensor) else x for x in inputs]
        # fake copies of the weights too: a forward that writes its own state (an EMA teacher) writes those
        fake_state: dict[str, torch.Tensor] = {name: mode.from_tensor(t) for name, t in state.items()}
        out = torch.func.functional_call(flat(gm), fake_state, tuple(fake))
    codegen = graph_codegen(gm.graph)
    if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info.out_spec is not None:  # exported: the flat outputs, restructured
        out = pytree.tree_unflatten(list(out), codegen.pytree_info.out_spec)
    return pytree.tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t, out)


def _with_grad(output: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """``output`` with each tensor made anew by ``make`` (floating ones requiring grad), and those."""
    leaves = []

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        x = make(t)
        if x.is_floating_point():
            x.requires_grad_()
            leaves.append(x)
        return x

    return pytree.tree_map(one, output), leaves


def _scalar(loss: Any) -> torch.Tensor:
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        raise CostModelError(advice(
            f"the loss function returned {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            + ", not a scalar tensor that needs a gradient",
            "the pipeline calls loss.backward() on what the loss function returns for each micro-batch",
            "return one scalar loss computed from the model's output (e.g. F.cross_entropy(...))",
        ))
    return loss.reshape(())


def _counted(
    loss: Loss, output: Any, target: Any, precision: str, device_type: str,
) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """((flops, bytes, ops) forward, the same backward, saved bytes) of the loss on fake tensors."""
    from torch.utils.flop_counter import FlopCounterMode  # deferred: it imports triton (a third of a second) where installed

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        out, leaves = _with_grad(output, lambda t: mode.from_tensor(t))
        fake_target = pytree.tree_map(lambda t: mode.from_tensor(t.to("meta")) if isinstance(t, torch.Tensor) else t, target)
        inputs = {id(t) for t in leaves}
        saved: dict[Any, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in inputs:
                saved[id(t)] = t.nbytes
            return t

        passes = []
        value = None
        for run in ("forward", "backward"):
            flops, traffic = FlopCounterMode(display=False), _Traffic()
            with flops, traffic:
                if run == "forward":
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), precision_context(precision, device_type):
                        value = _scalar(loss.fn(out, fake_target))
                else:
                    assert value is not None
                    value.backward()
            passes.append((flops.get_total_flops(), traffic.bytes, traffic.ops))
    return passes[0], passes[1], sum(saved.values())


def _measured(loss: Loss, output: Any, target: Any, device: torch.device) -> tuple[float, float]:
    """(forward, backward) seconds of the loss on real tensors on ``device`` (measured costs are fp32)."""
    def make(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(t.shape, dtype=t.dtype, device=device)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)

    real_target = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, target)
    values = pytree.tree_map(lambda t: make(t) if isinstance(t, torch.Tensor) else t, output)

    def fresh() -> Any:  # the same values, new leaves: making them is not the loss's time
        return _with_grad(values, lambda t: t.detach())[0]

    def forward(out: Any) -> torch.Tensor:
        return _scalar(loss.fn(out, real_target))

    # The first calls fault in fresh memory for the output-sized gradients (on this project's CPU
    # VM the first backwards were several times slower than later ones): warm up past them, as a stage has.
    fwd = timed(forward, device=str(device), setup=fresh, warmup=5, repeats=10)
    bwd = timed(lambda value: value.backward(), device=str(device), setup=lambda: forward(fresh()), warmup=5, repeats=10)
    return fwd, bwd


def cost_loss(
    loss: Loss, output: Any, micro_batches: int, specs: Sequence[DeviceSpec], *, measure: bool = False, precision: str = "fp32",
) -> LossCost:
    """One micro-batch's loss on every device of ``specs``: measured where ``measure`` and the device
    is present here, else analytic. ``output``: the model's output for one micro-batch (meta tensors)."""
    target = split_target(loss.target, micro_batches)[0]  # as the pipeline cuts it
    device_type = specs[0].device_type if specs else "cpu"
    try:
        forward, backward, saved = _counted(loss, output, target, precision, device_type)
    except CostModelError:
        raise
    except Exception as e:
        raise CostModelError(advice(
            f"could not run the loss function on the model's output for costing: {type(e).__name__}: {e}",
            "the planner runs loss_fn(output, target) on fake tensors of one micro-batch, as the last stage will call it",
            "check that example_target matches the model's output (its first micro-batch is used), or plan without loss_fn",
        )) from e
    # The roofline at the fp32 peak: autocast runs the usual losses (cross_entropy, log_softmax) in fp32,
    # and they are memory-bound whatever the dtype.
    def analytic(spec: DeviceSpec) -> tuple[float, float]:
        return tuple(roofline(flops, nbytes, spec) + (ops - 1) * spec.launch_overhead  # type: ignore[return-value]
                     for flops, nbytes, ops in (forward, backward))

    times: dict[DeviceSpec, tuple[float, float]] = {}
    for spec in dict.fromkeys(specs):
        here = spec.torch_device if measure else None
        times[spec] = _measured(loss, output, target, torch.device(here)) if here is not None else analytic(spec)
    fwd, bwd = zip(*(times[spec] for spec in specs))
    return LossCost(tuple(fwd), tuple(bwd), saved)

