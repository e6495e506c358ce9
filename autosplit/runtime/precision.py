"""A plan's precision at run time (:attr:`~autosplit.plans.Plan.precision`, defined by
:attr:`~autosplit.options.PlanOptions.precision`), the same for the local and the distributed runtime.

- ``"fp32"``: the model's own dtypes; nothing changes.
- ``"bf16"``: the model's floating parameters and buffers are held in bfloat16 — converted in place
  when the split is built, as ``model.to(torch.bfloat16)`` would, so gradients and optimizer state
  are bf16 too — and floating inputs are cast to bf16 where they enter (:func:`hold`, :func:`cast_inputs`).
- ``"bf16-mixed"`` / ``"fp16-mixed"``: every stage's forward (and the pipeline's loss) runs under
  ``torch.autocast`` on the stage's device type (:func:`autocast`); parameters (fp32 master
  weights), gradients and optimizer state stay fp32, and the backward runs outside autocast, as
  PyTorch recommends. The tensors crossing stages have the dtype autocast gives them (a ``Linear``'s
  output is bf16), and the distributed stages' static metadata say so.
- One compute copy of each weight per step (:func:`cast_once`): autocast keeps the low-precision
  copy of every fp32 leaf parameter it casts until the outermost autocast context closes, so a step
  (the distributed ``step``, ``eval_step`` and ``pipe(...)``: every micro-batch, forward and
  backward; a ``SplitModule`` call) is run inside one outer context that casts nothing itself: every
  micro-batch's forward shares one copy per weight, instead of casting again and saving its own
  copy for backward, and the copies are dropped when the step ends, before the optimizer changes
  the weights they were made from.
- ``"bf16-fsdp"`` (distributed only): every stage under FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` — on a data-parallel mesh of one where the plan has none
  (:func:`~autosplit.runtime.placement.replicate_stage`) — and floating inputs cast to bf16 where
  they enter: every parameter is gathered as a bf16 copy once per step, norms and embeddings too,
  gradients are accumulated and reduced in fp32 into the fp32 master weights, as torchtitan trains.
  The graph was captured with bf16 parameters (:mod:`autosplit.passes.param_dtype`).
- ``"fp16-mixed"`` in :meth:`~autosplit.runtime.distributed.DistributedModel.step`: a
  :class:`LossScaler` scales each micro-batch's loss, unscales the gradients after the step and
  skips the step on every rank when any rank found an inf or NaN. Locally (a ``SplitModule``) the
  user drives backward, so they use ``torch.amp.GradScaler`` as with any model.

Usage::

    with cast_once(plan.precision, "cuda"):
        for received in micro_batches:
            with autocast(plan.precision, "cuda"):
                outs.append(stage(*received))
        ...                                   # the backwards, outside autocast
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from autosplit import compat
from autosplit.errors import DistributedError, advice
from autosplit.passes.autocast_policy import LOW_PRECISION, forward_autocast, is_mixed, step_scope
from autosplit.passes.param_dtype import PARAM_CAST, inputs_in
from autosplit.plans import Plan

__all__ = [
    "AutocastStage", "LossScaler", "autocast", "cast_inputs", "cast_once", "hold", "is_mixed", "stage_device_type",
]

log = logging.getLogger(__name__)


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, dtype)`` for a mixed precision, its cache of weight casts on
    (:func:`cast_once`); a null context otherwise (:func:`~autosplit.passes.autocast_policy.forward_autocast`)."""
    return forward_autocast(precision, device_type)


def cast_once(precision: str, device_type: str, *, ambient: bool = False) -> contextlib.AbstractContextManager:
    """The scope of one step for a mixed precision: each weight is cast to the low dtype once inside
    it, and that copy is shared by every :func:`autocast` region entered inside (every micro-batch's
    forward, recomputations in the backward included); a null context for other precisions.

    How: autocast caches the casts of fp32 leaf tensors that require grad (parameters) for as long
    as any autocast context is open, and clears the cache when the outermost one closes. This is an
    outer ``torch.autocast`` context that casts nothing: disabled (the backwards inside run outside
    autocast, as PyTorch recommends), or with ``ambient`` the caller's autocast state left as it is
    (a ``SplitModule`` called under the user's own autocast). Why it is exact: a cached copy is the
    same ``.to(dtype)`` autocast would make again, it is made with its autograd history (even under
    ``no_grad``), its ``ToCopyBackward`` saves no tensor, so every micro-batch's backward passes
    through it, and the step ends (the cache cleared) before the optimizer updates the fp32 weights
    in place. ``tests/runtime/test_cast_once.py`` counts the copies and compares the gradients.

    Under FSDP2 (:func:`~autosplit.runtime.placement.replicate_stage`) the parameters autocast sees are
    FSDP2's unsharded ones, leaves kept for the step, so the cache applies as it does without it.
    FSDP2's own ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` would also cast once, but
    rounds every parameter (norms, embeddings, biases) to bf16, not only the matmuls' operands: the
    tensors crossing stages change dtype from what the static metadata, traced under autocast, say,
    and on a 2-layer GPT (M = 4, 3 AdamW steps) the gradients differ from autocast's by up to 2.2e-3
    and the weights by 4.2e-3, outside the mixed precisions' tolerance (rtol 1e-3, atol 1e-4;
    ``benchmarks/investigations/cast_once.py``). Stages compiled with ``compile=`` cast inside their
    graph, where the cache does not reach: they still make one copy per micro-batch. The cache is the
    thread's: on CUDA, where autograd runs the backward on its device thread, a block recomputed in
    the backward casts again there (a transient copy, freed with the block's backward, as before).

    Usage::

        with cast_once("bf16-mixed", "cuda"):
            pipe_schedule.step(...)
    """
    if ambient and is_mixed(precision):
        return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                              enabled=torch.is_autocast_enabled(device_type), cache_enabled=True)
    return step_scope(precision, device_type)


def hold(module: torch.nn.Module, precision: str) -> int:
    """For ``"bf16"``: ``module``'s floating parameters and buffers converted to bfloat16 in place
    (``tensor.data``, as ``module.to(torch.bfloat16)`` does), so ``Parameter`` objects stay valid.
    Returns how many tensors changed; nothing changes for other precisions."""
    if precision != "bf16":
        return 0
    changed = 0
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point() and t.dtype != torch.bfloat16:
                t.data = t.data.to(torch.bfloat16)
                changed += 1
    if changed:
        log.info("precision bf16: %d parameters and buffers converted to bfloat16 in place", changed)
    return changed


def cast_inputs(values: Any, precision: str) -> Any:
    """For ``"bf16"`` and ``"bf16-fsdp"`` (the parameters the inputs meet are bf16): every floating
    tensor in ``values`` cast to bfloat16; ``values`` unchanged otherwise."""
    return inputs_in(values, LOW_PRECISION[precision] if precision == "bf16" or precision in PARAM_CAST else None)


def stage_device_type(plan: Plan) -> str:
    """The device type (``"cpu"``, ``"cuda"``) the plan's stages run on, which fixes what autocast
    does to the tensors crossing them: a :class:`DistributedError` for a mixed precision over stages of
    several types (each rank would trace the crossings' dtypes under another autocast policy)."""
    kinds = sorted({torch.device(plan.devices[d].torch_device or "cpu").type for d in plan.stage_devices})
    if len(kinds) > 1 and is_mixed(plan.precision):
        raise DistributedError(advice(
            f"precision={plan.precision!r} over pipeline stages on devices of {len(kinds)} types ({kinds})",
            "autocast casts differently on each device type, and the stages' static metadata (the dtypes crossing "
            "them) are traced under one policy",
            "run every stage on one device type, or plan with precision='fp32' or 'bf16'",
        ))
    return kinds[0] if kinds else "cpu"


class AutocastStage(torch.nn.Module):
    """``stage`` run under ``torch.autocast(device_type, dtype)`` of a mixed ``precision`` (the local
    runtime's per-stage policy, inside the :func:`cast_once` of the whole call; the distributed stages
    enter it in their ``forward_one_chunk``)."""

    def __init__(self, stage: torch.nn.Module, precision: str, device_type: str):
        super().__init__()
        self.stage = stage
        self.precision = precision
        self.device_type = device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with autocast(self.precision, self.device_type):
            return self.stage(*args, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class LossScaler:
    """Dynamic loss scaling for an ``"fp16-mixed"`` pipeline: ``torch.amp.GradScaler``'s rule, defaults,
    state dict and kernels (``_amp_foreach_non_finite_check_and_unscale_``, ``_amp_update_scale_``),
    with "found inf" all-reduced over every rank before the step is kept or skipped.

    Written here rather than wrapping ``GradScaler`` because GradScaler keeps its inf checks per
    optimizer, privately, with no point at which ranks could agree on them, and the pipeline's step
    is not given the optimizer. A skipped step leaves every gradient of every rank ``None``, so the
    optimizer's next ``step()`` changes nothing (as ``GradScaler.step`` skips it), and the scale is
    multiplied by ``backoff_factor``; after ``growth_interval`` steps without inf it grows by ``growth_factor``.
    """

    def __init__(self, device: torch.device, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.device = device
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.skipped = 0
        """Steps skipped so far (an inf or NaN gradient on some rank)."""

    def get_scale(self) -> float:
        """The scale the next step's losses are multiplied by."""
        return float(self._scale.item())

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale.to(device=loss.device)

    def unscale_and_update(self, params: Iterable[torch.Tensor], group: Any = None) -> bool:
        """Divide the gradients of ``params`` by the scale in place, agree over ``group`` (default:
        every rank) whether any was inf or NaN, drop them all if so, and update the scale. Call it on
        every rank once per step; returns whether the step was skipped."""
        params = list(params)
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        inv_scale = self._scale.double().reciprocal().float()
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                g = _local(p.grad)
                by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), grads in by_kind.items():
            here = torch.zeros(1, dtype=torch.float32, device=device)
            compat.amp_unscale_(grads, here, inv_scale.to(device))
            found += here.to(self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        skipped = bool(found.item() > 0)
        if skipped:
            for p in params:
                p.grad = None
            self.skipped += 1
            log.info("fp16 loss scale %g gave an inf or NaN gradient: step skipped on every rank", self.get_scale())
        compat.amp_update_scale_(self._scale, self._growth_tracker, found, self.growth_factor, self.backoff_factor, self.growth_interval)
        return skipped

    def state_dict(self) -> dict[str, Any]:
        """As ``GradScaler.state_dict()`` names it, so either loads the other's."""
        return {"scale": self.get_scale(), "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": int(self._growth_tracker.item())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["_growth_tracker"]))
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
