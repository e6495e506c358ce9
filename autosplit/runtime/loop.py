"""What a training loop does around :meth:`~autosplit.runtime.distributed.DistributedModel.step`:
modes, forward-only runs (inference and evaluation), and clipping by the whole model's norm.

- ``pipe.train(mode=True)`` / ``pipe.eval()`` mean what they mean on ``nn.Module``: every stage
  module of this rank switches (dropout, BatchNorm statistics), and they return the pipeline. A
  stage graph that fixed a mode when it was captured (``torch.export`` writes dropout as an ATen
  op with its ``train`` flag baked in) cannot switch: asking it to is refused, naming the node.
- ``pipe(*inputs, **kwargs)`` returns the model's output in its own type on the last stage's ranks
  (``None`` elsewhere); ``pipe.eval_step(*inputs, target=...)`` the batch's mean loss there. Both
  run torch's forward-only schedule (``eval()`` of the plan's schedule class; ``ScheduleGPipe``
  for an asynchronous plan, between its runs) under ``torch.no_grad()``, on stages of their own
  (so a training schedule's buffers are never re-initialised by a switch), and leave every
  ``.grad`` as it was: accumulated gradients survive an evaluation.
- ``pipe.clip_grad_norm_(max_norm)`` clips by the norm over every stage, replica and shard
  (:mod:`autosplit.runtime.gradients`), equal to ``torch.nn.utils.clip_grad_norm_`` on the unsplit
  model. Gradients are unscaled when ``step`` returns under ``"fp16-mixed"``, so no unscaling is
  left to do.

Usage (every rank)::

    pipe.eval()
    val_loss = pipe.eval_step(tokens, target=targets)   # None off the last stage
    pipe.train()
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from autosplit.compat import OpOverload
from autosplit.errors import DistributedError, advice
from autosplit.runtime.gradients import clip_by_global_norm, counted_here, global_grad_norm

__all__ = ["TrainingLoop", "mode_fixed_nodes"]

# Ops whose training flag a capture fixes as a constant: name → index of that flag. The ATen ops
# (torch.export) and torch.nn.functional's (symbolic tracing) put it at the same place.
_MODE_ARGUMENT = {"dropout": 2, "native_dropout": 2, "feature_dropout": 2, "alpha_dropout": 2, "feature_alpha_dropout": 2,
                  "dropout1d": 2, "dropout2d": 2, "dropout3d": 2,
                  "batch_norm": 5, "native_batch_norm": 5, "_native_batch_norm_legit": 5}


def _running_mean(node: torch.fx.Node) -> Any:
    """A batch norm node's running mean: ATen's ops take it fourth, ``F.batch_norm`` second."""
    index = 3 if isinstance(node.target, OpOverload) else 1
    return node.kwargs.get("running_mean", node.args[index] if len(node.args) > index else None)


def mode_fixed_nodes(module: torch.nn.Module, training: bool) -> list[str]:
    """Nodes of a stage graph whose behaviour a capture fixed to the mode other than ``training``, as
    ``name (op, training=flag)``: a dropout with a probability above 0, a batch norm with running
    statistics (without them it normalises by the batch in either mode; an instance norm's
    ``use_input_stats`` is no mode either)."""
    graph = getattr(module, "graph", None)
    found = []
    for node in graph.nodes if graph is not None else ():
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        index = _MODE_ARGUMENT.get(name)
        if index is None:
            continue
        flag = node.kwargs.get("train", node.kwargs.get("training"))
        if flag is None and len(node.args) > index:
            flag = node.args[index]
        if not isinstance(flag, bool) or flag == training:
            continue
        if "dropout" in name:
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
            if isinstance(p, (int, float)) and p == 0:
                continue
        elif _running_mean(node) is None:
            continue
        found.append(f"{node.name} ({name}, training={flag})")
    return found


class TrainingLoop:
    """The training-loop verbs of :class:`~autosplit.runtime.distributed.DistributedModel`."""

    stage_modules: dict[int, torch.nn.Module]
    module: torch.nn.Module
    layout: Any
    chain: Any
    device: torch.device
    training: bool
    micro_batches: int
    _rows: int | None
    _step_losses: list[torch.Tensor]
    _param_names: dict[str, str]
    _tied: list[tuple[str, Any]]

    if TYPE_CHECKING:  # DistributedModel's

        @property
        def is_last(self) -> bool: ...

        def _usable(self) -> None: ...

        def _forward_only(self, inputs: Sequence[Any], kwargs: Mapping[str, Any], *, target: Any) -> Any: ...

        def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    # -- modes -------------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Any:
        """Set every stage module of this rank to training (``mode=True``) or evaluation mode, as
        ``nn.Module.train`` does; returns the pipeline. Asynchronous training is
        :meth:`~autosplit.runtime.distributed.DistributedModel.run`."""
        if not isinstance(mode, bool):
            raise DistributedError(advice(
                f"train(mode) takes True or False, not {type(mode).__name__}",
                "train() sets the mode, as on nn.Module; asynchronous training has its own verb",
                "call pipe.run(batches, optimizer=opt) to train an asynchronous pipeline",
            ))
        # Every stage's graph (the chain holds them all on every rank), so every rank refuses alike.
        fixed = {s: mode_fixed_nodes(m, mode) for s, m in enumerate(self.chain.stages)}
        fixed = {s: nodes for s, nodes in fixed.items() if nodes}
        if fixed:
            s, nodes = next(iter(fixed.items()))
            raise DistributedError(advice(
                f"stage {s} cannot switch to {'training' if mode else 'evaluation'} mode: its graph fixed "
                f"{len(nodes)} op(s) to the other mode when the model was captured (first: {nodes[0]})",
                "torch.export writes dropout and batch norm with their training flag as a constant",
                "distribute the model in the mode you need (model.eval() before distribute for evaluation), "
                "or set the dropout probability to 0",
            ))
        for m in self.stage_modules.values():
            m.train(mode)
        self.training = mode
        return self

    def eval(self) -> Any:
        """``train(False)``: evaluation mode on every stage of this rank; returns the pipeline."""
        return self.train(False)

    # -- forward only --------------------------------------------------------------------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """The model's output for this batch (forward only, no autograd graph, no gradient touched):
        in the model's own type on the last stage's ranks, ``None`` elsewhere. Call on every rank."""
        self._check_outputs_merge()
        merged = self._forward_only(inputs, kwargs, target=None)
        if merged is None:
            return None
        return self.chain.output(list(merged) if isinstance(merged, (tuple, list)) else [merged])

    def eval_step(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor | None:
        """The batch's mean loss, forward only (the mean of the micro-batches' losses, as
        :meth:`~autosplit.runtime.distributed.DistributedModel.step` returns it) on the last stage's
        ranks, ``None`` elsewhere; no gradient is touched."""
        if target is None:
            raise DistributedError(advice(
                "eval_step() was given no target", "the loss is loss_fn(output, target)",
                "pass target=, or call pipe(*inputs) for the output",
            ))
        self._forward_only(inputs, kwargs, target=target)
        if not self.is_last:
            return None
        return torch.stack(self._step_losses).mean()

    def _check_outputs_merge(self) -> None:
        """Every output the last stage returns is cut by the batch (dimension 0), so the micro-batches'
        outputs concatenate into the batch's; refused on every rank alike before anything runs."""
        planned = (self._rows or 0) // self.micro_batches
        outputs = self.chain.outputs_meta[self.layout.stages - 1]
        unbatched = [i for i, t in enumerate(outputs) if t.dim() == 0 or t.shape[0] != planned]
        if unbatched:
            t = outputs[unbatched[0]]
            raise DistributedError(advice(
                f"the model's output {unbatched[0]} has shape {tuple(t.shape)}, not cut by the batch "
                f"({planned} rows a micro-batch)",
                "pipe() concatenates the micro-batches' outputs along dimension 0; a value computed over a whole "
                "micro-batch (a loss inside forward) has no such merge",
                "compute that value with eval_step() and loss_fn, or return it per row",
            ))

    # -- clipping --------------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients of every stage, replica and shard by their total norm (tied weights
        counted once) and return that norm, the same on every rank: ``torch.nn.utils.clip_grad_norm_``
        of the unsplit model. Call it on every rank after :meth:`~autosplit.runtime.distributed.DistributedModel.step`."""
        self._usable()
        own = dict(self.module.named_parameters(remove_duplicate=False))
        tied = dict(self._tied)
        counted = []
        for local in dict.fromkeys(self._param_names.values()):  # one copy per rank; a tied weight's other copies are aliases
            p = own[local]
            group = tied.get(local)
            if p.grad is None or (group is not None and torch.distributed.get_rank(group) != 0):
                continue  # a tied weight several ranks hold: its first rank counts it
            part = counted_here(p.grad, replica=self.layout.replica)
            if part is not None:
                counted.append(part)
        total = global_grad_norm(counted, norm_type=norm_type, device=self.device)
        clip_by_global_norm(self.parameters(), total, max_norm=max_norm, error_if_nonfinite=error_if_nonfinite)
        return total
