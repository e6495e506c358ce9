"""The local runtime: a module that behaves like the original model and runs its stages on their devices, in one process.

:class:`SplitModule` registers the *original* module tree (same children, same
``Parameter`` objects, moved to their devices), so ``state_dict()``,
``named_parameters()`` and ``load_state_dict()`` use the model's own names and
checkpoints load into either. The generated stage modules share those objects but are
kept out of the module tree, so nothing is listed twice. ``DistributedDataParallel``
(``device_ids=None``) can replicate it for hybrid data + model parallelism.

Each stage runs in the plan's precision (:mod:`autosplit.runtime.precision`): ``"bf16-mixed"`` /
``"fp16-mixed"`` run every stage's forward under ``torch.autocast`` on its device type (parameters
stay fp32; compute the loss under the same autocast, and for fp16 scale it with
``torch.amp.GradScaler`` as for any model). The local runtime does not cut the batch into
micro-batches: a call is one forward, in which each weight is cast once and the copy shared by
every stage that reads it (:func:`~autosplit.runtime.precision.cast_once`); a user who accumulates
several calls before the optimizer step gets one copy per call, as with the unsplit model.
``"bf16"`` holds the model in bfloat16: building the
split converts its floating parameters and buffers in place, as ``model.to(torch.bfloat16)`` would
(the split shares them, as it shares their device), and floating inputs are cast where they enter.

Usage::

    split = autosplit.autosplit(model, ["cpu"] * 4, example_inputs=(x,))
    loss_fn(split(x), y).backward()
    print(split.code)            # the generated Python of every stage

    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(x,), precision="fp16-mixed")
    opt, scaler = torch.optim.Adam(split.parameters()), torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):   # the loss under the stages' autocast
        loss = loss_fn(split(x), y)
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from autosplit.passes.capture import Captured, flat_inputs
from autosplit.passes.codegen import Program
from autosplit.plans import Plan
from autosplit.runtime.compiled import CompileOptions, compile_stages
from autosplit.runtime.precision import AutocastStage, cast_inputs, cast_once, hold, is_mixed

__all__ = ["SplitModule"]


class SplitModule(torch.nn.Module):
    """A model partitioned over devices by a :class:`Plan`.

    With ``compile`` (:class:`~autosplit.runtime.compiled.CompileOptions`), every stage module is
    compiled in place with ``torch.compile`` (:func:`~autosplit.runtime.compiled.compile_stages`);
    ``.compiled`` then holds each stage's status (``"compiled"`` or ``"eager: <cause>"``).
    """

    _program: Program
    _captured: Captured
    plan: Plan

    def __init__(
        self, model: torch.nn.Module, captured: Captured, program: Program, plan: Plan, *, compile: CompileOptions | None = None,
    ):
        super().__init__()
        # Every name, aliases included (one module or parameter under two names), as the model has them.
        for name, child in model._modules.items():
            self.add_module(name, child)
        for name, p in model._parameters.items():
            self.register_parameter(name, p)
        for name, b in model._buffers.items():
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
        # Plain attributes, not submodules: the stages reuse the tree registered above.
        object.__setattr__(self, "_program", program)
        object.__setattr__(self, "_captured", captured)
        object.__setattr__(self, "plan", plan)
        self.training = model.training
        hold(self, plan.precision)
        # Each stage compiled in place (before the autocast wrapper, which then calls the compiled stage).
        self.compiled: dict[int, str] = {} if compile is None else compile_stages(
            dict(enumerate(program.stages)), **dataclasses.asdict(compile))
        if is_mixed(plan.precision):  # the program calls each stage through its autocast
            for s, device in enumerate(program.devices):
                setattr(program.program, f"stage{s}", AutocastStage(program.stages[s], plan.precision, torch.device(device).type))

    @property
    def stages(self) -> tuple[fx.GraphModule, ...]:
        """The generated module of each stage, in execution order."""
        return self._program.stages

    @property
    def devices(self) -> tuple[str, ...]:
        return self._program.devices

    @property
    def code(self) -> str:
        """Readable Python of the program and of every stage."""
        parts = [f"# program: runs the stages in order\n{self._program.program.code.strip()}"]
        for s, (stage, device) in enumerate(zip(self.stages, self.devices)):
            parts.append(f"# stage {s} on {device}\n{stage.code.strip()}")
        return "\n\n".join(parts)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        captured = self._captured
        args, kwargs = cast_inputs((args, kwargs), self.plan.precision)
        # One cast of each weight per call, shared by every stage that reads it (the caller's autocast state kept).
        with cast_once(self.plan.precision, torch.device(self.devices[0]).type, ambient=True):
            if captured.method == "export":  # the program flattens (args, kwargs) by the exported spec itself
                out = self._program.program(*args, **{**captured.fixed_kwargs, **kwargs})
            else:
                out = self._program.program(*flat_inputs(captured, args, kwargs))
        return captured.restore_output(out)

    def extra_repr(self) -> str:
        return f"stages={len(self.stages)}, devices={list(self.devices)}"
