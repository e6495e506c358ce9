"""Steps *capture* and *annotate*: the model as an annotated fx graph, done once per model and
input shape (:class:`~autosplit.api.planner.Planner` keeps the result).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch

from autosplit import progress
from autosplit.compat import pytree
from autosplit.errors import CaptureError, CodegenError, ConstraintError, advice
from autosplit.microbatch import batch_size, split_batch, split_target
from autosplit.passes.annotate import annotate
from autosplit.passes.autocast_reads import refuse_under_autocast
from autosplit.passes.capture import Captured, capture, fingerprint, flat_inputs
from autosplit.passes.experts import ExpertGroup, expert_groups
from autosplit.passes.loss import Loss
from autosplit.passes.param_dtype import PARAM_CAST, capture_dtype
from autosplit.passes.respecialise import respecialised
from autosplit.passes.tensor_parallel import TensorParallelRules, tensor_parallel_rules

__all__ = ["trace", "Traced", "versions"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Traced:
    """A captured, annotated model: what every plan of it starts from."""

    captured: Captured
    inputs: tuple[Any, ...]
    """The example values of the graph's placeholders, in order."""
    fingerprint: str
    timings: Mapping[str, float] = field(default_factory=dict)
    model: torch.nn.Module | None = None
    example: tuple[tuple, Mapping[str, Any]] = ((), {})
    """The example call ``(args, kwargs)`` it was captured with."""
    loss: Loss | None = None
    """The training loss the plans are costed with (None: not costed)."""
    _exports: dict[int, Captured] = field(default_factory=dict, compare=False, repr=False)
    """Real captures by rows (torch.export's graphs), shared by a trace and its shares."""
    _precisions: dict[tuple[str, str], torch.fx.GraphModule] = field(default_factory=dict, compare=False, repr=False)
    _shares: dict[int, Traced] = field(default_factory=dict, compare=False, repr=False)
    _losses: dict[tuple, Any] = field(default_factory=dict, compare=False, repr=False)
    """The loss's cost per (micro-batches, precision, devices, profiling): costed once per plan search."""
    _rules: list[TensorParallelRules] = field(default_factory=list, compare=False, repr=False)
    _experts: dict[tuple[str, str], tuple[ExpertGroup, ...]] = field(default_factory=dict, compare=False, repr=False)
    _tables: dict[tuple, Any] = field(default_factory=dict, compare=False, repr=False)
    """Analytic cost tables made for this trace, by what decides them (:func:`~autosplit.compiler.costs.cost_table`)."""
    _blocks: dict[tuple, tuple] = field(default_factory=dict, compare=False, repr=False)
    """The blocks a plan may recompute, by what decides them (:func:`~autosplit.compiler.costs.cost_table`),
    shared by a trace and its shares (the same nodes)."""

    def tp_rules(self) -> TensorParallelRules:
        """What tensor parallelism can split in this graph (:func:`~autosplit.passes.tensor_parallel.tensor_parallel_rules`;
        head counts named by the model's ``config`` where it has one), made once and kept."""
        if not self._rules:
            self._rules.append(tensor_parallel_rules(self.captured, getattr(self.model, "config", None)))
        return self._rules[0]

    def expert_groups(self, precision: str = "fp32", device_type: str = "cpu") -> tuple[ExpertGroup, ...]:
        """The mixture-of-experts layers of this graph as ``precision`` runs it (:func:`~autosplit.passes.experts.expert_groups`;
        none for a dense model), found once and kept."""
        key = (precision, device_type)
        if key not in self._experts:
            self._experts[key] = expert_groups(self.annotated(precision, device_type), self.model, self.captured.module_paths)
        return self._experts[key]

    def param_numel(self) -> dict[str, int]:
        """Parameter name (each name of a tied one) → its elements."""
        module = self.model if self.model is not None else self.captured.gm
        return {name: p.numel() for name, p in module.named_parameters(remove_duplicate=False)}

    def annotated(self, precision: str, device_type: str) -> torch.fx.GraphModule:
        """The graph annotated as ``precision`` runs it on a ``device_type`` target (``"cpu"``, ``"cuda"``):
        the captured graph itself in the precision it is annotated in (:func:`_annotated_in`), else a copy
        of it (same nodes and names, same module) annotated anew, made once and kept."""
        refuse_under_autocast(self.captured.reads_autocast, precision)
        held, wanted = self.captured.param_dtype, capture_dtype(precision)
        if self.captured.method == "export" and held != wanted:
            raise ConstraintError(advice(
                f"precision={precision!r} computes with the parameters in {wanted or 'their own dtype'}, and this model was "
                f"exported with them in {held or 'their own dtype'}",
                "torch.export bakes the dtypes it traced into the graph (autosplit.passes.param_dtype)",
                f"plan with a Planner made with precision={precision!r}: it captures the model as that precision computes",
            ))
        if precision == _annotated_in(self.captured):
            return self.captured.gm
        key = (precision, "cpu" if device_type == "cpu" else "cuda")
        if precision == "bf16" and self.captured.method == "export":
            raise ConstraintError(advice(
                "precision='bf16' converts the model to bfloat16, and this model was captured by torch.export, which "
                "bakes the dtypes it traced into the graph (a cast back to float32 would stay one)",
                "symbolic tracing failed for this model, so its graph is the exported one",
                "convert the model first (model.to(torch.bfloat16); on the meta device it costs nothing) and plan it with "
                "precision='fp32' (the model's own dtype), or use precision='bf16-mixed'",
            ))
        if key not in self._precisions:
            copy = _graph_copy(self.captured.gm, "annotate it in another precision", "plan with precision='fp32'")
            annotate(dataclasses.replace(self.captured, gm=copy), list(self.inputs), precision=precision, device_type=key[1])
            self._precisions[key] = copy
        return self._precisions[key]

    def at_batch(self, parts: int) -> Traced:
        """This trace at ``1/parts`` of its batch — a data-parallel copy's share of the global batch —
        annotated anew (the same nodes; an exported graph, specialised to its shapes, at the share's:
        :meth:`_planning_capture`), made once and kept. ``parts = 1``: itself."""
        if parts == 1:
            return self
        if parts not in self._shares:
            args, kwargs = split_batch(self.example[0], self.example[1], parts)[0]
            if self.captured.method == "export":  # specialised to its shapes: the share's graph
                captured, inputs = self._planning_capture(args, kwargs)
            else:
                _, inputs = self.at_micro_batch(parts)  # a traced graph runs any batch: the share of its inputs
                captured = dataclasses.replace(self.captured, gm=_graph_copy(
                    self.captured.gm, "annotate it at a data-parallel share of the batch", "plan with data_parallel=1"))
                annotate(captured, list(inputs), precision=_annotated_in(captured))
            loss = None if self.loss is None else Loss(self.loss.fn, split_target(self.loss.target, parts)[0])
            self._shares[parts] = Traced(captured, tuple(inputs), fingerprint(captured.gm), dict(self.timings), model=self.model,
                                         example=(args, kwargs), loss=loss, _exports=self._kept_exports(),
                                         _blocks=self._blocks)
        return self._shares[parts]

    def _planning_capture(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple[Captured, list[Any]]:
        """The exported graph at this call's rows, annotated, to plan with: once two real captures of
        this graph at two batches of at least two rows are kept, the first of them respecialised to these
        rows (:func:`~autosplit.passes.respecialise.respecialised`: seconds saved per share of a large
        model), else — or where that graph does not annotate — a real capture (at one row, torch.export
        may specialise another graph: the share's own, as each copy will capture it)."""
        rows = batch_size(args, kwargs) or 0
        real = sorted(((c, r) for r, c in self._kept_exports().items() if r >= 2 and fingerprint(c.gm) == self.fingerprint),
                      key=lambda cr: -cr[1])
        guess = respecialised(*real[0], *real[1], rows) if len(real) >= 2 and rows not in self._exports else None
        if guess is not None:
            inputs = flat_inputs(guess, args, kwargs)
            try:
                annotate(guess, list(inputs), precision=_annotated_in(guess))
                return guess, inputs
            except Exception as e:  # noqa: BLE001 — any failure: the real capture decides
                log.info("the graph respecialised to %d rows does not annotate (%s): capturing it", rows, e)
        captured = self._exported(args, kwargs)
        inputs = flat_inputs(captured, args, kwargs)
        annotate(captured, list(inputs), precision=_annotated_in(captured))
        return captured, inputs

    def _kept_exports(self) -> dict[int, Captured]:
        """The real captures by rows, this trace's own among them (an exported trace's first)."""
        if not self._exports and self.captured.method == "export":
            self._exports[batch_size(*self.example) or 0] = self.captured
        return self._exports

    def _exported(self, args: tuple, kwargs: Mapping[str, Any]) -> Captured:
        """The model exported at this call's rows, kept (whatever graph it gives: the caller compares)."""
        rows = batch_size(args, kwargs) or 0
        kept = self._kept_exports()
        if rows not in kept:
            if self.model is None:
                raise CodegenError(advice(
                    f"this exported graph is specialised to its batch and cannot run {rows} rows",
                    "the trace was made without its model, so it cannot be captured again at another shape",
                    "trace with autosplit.compiler.trace.trace(model, ...)",
                ))
            kept[rows] = capture(self.model, args, dict(kwargs), method="export", param_dtype=self.captured.param_dtype)
        return kept[rows]

    @property
    def node_names(self) -> set[str]:
        return {n.name for n in self.captured.gm.graph.nodes if n.op not in ("placeholder", "output")}

    @property
    def batch(self) -> int | None:
        """Rows of the example batch (dimension 0 of its first tensor), the micro-batches cut."""
        return batch_size(self.inputs)

    def at_micro_batch(self, micro_batches: int) -> tuple[Captured, list[Any]]:
        """The capture to run one of ``micro_batches`` micro-batches with, and its placeholder values.

        torch.export specialises a graph to its example shapes (guards, view sizes), so an
        exported model is captured again at the micro-batch's shape (a real capture, never a
        respecialised one: this graph runs) — it must give the same graph, or it is refused. A
        symbolically traced graph runs any batch as it is.
        """
        if micro_batches == 1 or self.captured.method != "export":  # defaults included, cut like the inputs
            return self.captured, list(split_batch(self.inputs, None, micro_batches)[0][0])
        args, kwargs = split_batch(self.example[0], self.example[1], micro_batches)[0]
        captured = self._exported(args, kwargs)
        if fingerprint(captured.gm) != self.fingerprint:
            raise CodegenError(advice(
                f"the model captures as another graph at the micro-batch's shape ({batch_size(args, kwargs)} rows) "
                f"than at the batch's ({batch_size(*self.example)} rows)",
                "Python control flow or torch.export specialisation that depends on the batch size",
                "make forward independent of the batch size, or plan with micro_batches=1",
            ))
        return captured, flat_inputs(captured, args, kwargs)


def _annotated_in(captured: Captured) -> str:
    """The precision a capture's own graph is annotated in: the one it was exported for (its dtypes
    baked in: :mod:`autosplit.passes.param_dtype`), else fp32; other precisions annotate a copy."""
    return next((p for p, dtype in PARAM_CAST.items() if dtype == captured.param_dtype), "fp32")


def _graph_copy(gm: torch.fx.GraphModule, purpose: str, fix: str) -> torch.fx.GraphModule:
    """A copy of ``gm`` (same nodes and names, same module) to annotate anew."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = torch.fx.GraphModule(gm, graph)
    if [n.name for n in copy.graph.nodes] != [n.name for n in gm.graph.nodes]:
        raise CodegenError(advice(
            f"copying the captured graph to {purpose} renamed its nodes",
            "an fx graph whose node names collide with its own namespace", fix,
        ))
    return copy


def trace(
    model: torch.nn.Module, example_inputs: tuple, example_kwargs: Mapping[str, Any] | None, *, method: str, loss: Loss | None = None,
    precision: str = "fp32",
) -> Traced:
    """Steps *capture* and *annotate*: captured as ``precision`` computes (its parameters cast for
    ``"bf16-fsdp"``: :mod:`autosplit.passes.param_dtype`), annotated in fp32, or in the precision an
    exported graph was captured for (:func:`_annotated_in`; others: :meth:`Traced.annotated`)."""
    timings: dict[str, float] = {}
    example_inputs, kwargs = _reconciled(model, tuple(example_inputs), dict(example_kwargs or {}))
    with progress.timed_pass("capture", timings):
        captured = capture(model, example_inputs, kwargs, method=method, param_dtype=capture_dtype(precision))
        graph_id = fingerprint(captured.gm)
    inputs = flat_inputs(captured, example_inputs, kwargs)
    with progress.timed_pass("annotate", timings):
        annotate(captured, inputs, precision=_annotated_in(captured))
    return Traced(captured, tuple(inputs), graph_id, timings, model=model, example=(tuple(example_inputs), kwargs), loss=loss)


def versions() -> dict[str, str]:
    out = {"torch": str(torch.__version__)}
    for pkg in ("autosplit", "ortools"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def _reconciled(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The example where the weights are: planning reads shapes only, so a model on the meta device
    is traced on meta inputs, and a real model given meta inputs (or shapes) on zeros of them."""
    state = [*model.parameters(), *model.buffers()]
    on_meta = {t.is_meta for t in state}
    if len(on_meta) > 1:
        where = sorted({f"{name} ({'meta' if t.is_meta else t.device})" for name, t in
                        [*model.named_parameters(), *model.named_buffers()]}, key=lambda n: "meta" not in n)
        raise CaptureError(advice(
            f"the model is partly on the meta device and partly real (e.g. {where[:1] + where[-1:]})",
            "autosplit plans a model either from its shapes (all on meta) or from its real weights",
            "build the whole model under `with torch.device('meta'):`, or materialise it fully (to_empty + init) first",
        ))
    if on_meta == {True}:
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    device = state[0].device if state else torch.device("cpu")
    return pytree.tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device) if t.is_meta else t,
                                (args, kwargs))
