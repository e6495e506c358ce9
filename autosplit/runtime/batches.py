"""Batches of other shapes than the example's, for :mod:`autosplit.runtime.distributed`.

Every step the ranks compare a signature of their batch (:func:`shapes`, :func:`digest`,
:func:`check_batches`); a batch of other rows runs on stages whose static metadata is generated at
its micro-batch shape from a copy of the model on the meta device (:class:`ChainsByRows`), when
the stages' code is the same at both shapes (:func:`code_change`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

import torch

from autosplit import schedules
from autosplit.compat import pytree
from autosplit.errors import DistributedError, advice
from autosplit.microbatch import batch_size, is_batched
from autosplit.passes.autocast_reads import refuse_under_autocast
from autosplit.passes.capture import Captured, capture, fingerprint, flat_inputs, with_defaults
from autosplit.passes.chain import Chain, generate_chain
from autosplit.passes.param_dtype import capture_dtype
from autosplit.plans import Plan
from autosplit.runtime.precision import stage_device_type

__all__ = ["ChainsByRows", "capture_chain", "keep_only", "check_batches", "code_change", "describe", "digest", "meta_copy", "shapes"]


def shapes(values: Sequence[Any]) -> list[Any]:
    """Each value's ``(shape, dtype)``, or its type's name if it is not a tensor."""
    return [(tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values]


def describe(sig: Any) -> str:
    return f"{sig[1].removeprefix('torch.')} {list(sig[0])}" if isinstance(sig, tuple) else f"a {sig}"


def digest(value: Any) -> int:
    """56 bits of a hash of ``repr(value)``, equal in every process (Python's ``hash`` is not)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "big")


def check_batches(seen: Sequence[Sequence[int]], last: Sequence[int]) -> None:
    """Raise :class:`DistributedError` unless the ranks agree: ``seen[rank]`` is that rank's
    ``[rows, input shapes digest, target rows, target shape digest]`` (-1: none); ``last`` are
    the last stage's ranks, which cut the target with the inputs."""
    rows = [s[0] for s in seen]
    same = "give every rank a batch of the same shape (the same batch_size and drop_last=True on every rank's DataLoader)"
    if len(set(rows)) > 1:
        raise DistributedError(advice(
            "the ranks were given batches of different sizes: "
            + ", ".join(f"rank {r}: " + (f"{n} rows" if n >= 0 else "no batched tensor") for r, n in enumerate(rows)),
            "a stage receives micro-batches of the shape its neighbour sends, so every rank of the pipeline "
            "(and every replica) must run the same batch size in a step",
            same,
        ))
    differ = [r for r, s in enumerate(seen) if s[1] != seen[0][1]]
    if differ:
        raise DistributedError(advice(
            f"ranks {differ} were given inputs of other shapes or dtypes than rank 0 (all have {rows[0]} rows)",
            "every stage's code and receive buffers are fixed to one shape per step",
            same,
        ))
    wrong = [r for r in last if seen[r][2] != rows[0]] if rows[0] >= 0 else []
    if wrong:
        given = ", ".join(f"rank {r}: " + (f"{seen[r][2]} rows" if seen[r][2] >= 0 else "none") for r in wrong)
        raise DistributedError(advice(
            f"the last stage needs a target with the batch's {rows[0]} rows in dimension 0; {given}",
            "the last stage cuts the target into micro-batches with the inputs and computes each one's loss",
            "pass target= to step() on the last stage's ranks, one row per input row",
        ))
    if len({seen[r][3] for r in last}) > 1:
        raise DistributedError(advice(
            f"the last stage's replicas (ranks {list(last)}) were given targets of different shapes",
            "every replica computes the same loss over its own rows",
            same,
        ))


def code_change(base: Chain, other: Chain) -> str | None:
    """The first line of stage code that differs between two chains of one plan (None: same code)."""
    for s, (a, b) in enumerate(zip(base.stages, other.stages)):
        if a.code != b.code:
            old, new = next((x, y) for x, y in zip([*a.code.splitlines(), ""], [*b.code.splitlines(), ""]) if x != y)
            return (f"stage {s}'s code fixes the micro-batch rows ({old.strip()[:120]!r} "
                    f"becomes {new.strip()[:120]!r}; torch.export, or a shape passed between stages)")
    return None


_M = TypeVar("_M", bound=torch.nn.Module)


def meta_copy(model: _M) -> _M:
    """A copy of ``model`` with every parameter and buffer on the meta device, at its whole
    (global) shape — a replicated or sharded DTensor's too. No memory for weights."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
    return copy.deepcopy(model, memo)


class ChainsByRows:
    """The plan's chain for micro-batches of any number of rows (and the example's other
    dimensions), each captured from ``meta_model`` — the model's copy on the meta device — on
    first use. Only their code, static metadata and input signature are read: the stages run
    their own modules, so nothing here holds memory for weights."""

    def __init__(
        self, meta_model: torch.nn.Module, captured: Captured, example: tuple[tuple, Mapping[str, Any]], plan: Plan, stages: int, *,
        method: str, replicate: set[str],
    ) -> None:
        self._batch = batch_size(*example)
        example = with_defaults(captured, *example)
        self._example = pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, example)
        self._model, self._plan, self._stages, self._method, self._replicate = meta_model, plan, stages, method, replicate
        self._made: dict[int, tuple[Chain, Captured]] = {}

    def __call__(self, rows: int) -> Chain:
        return self.at(rows)[0]

    def at(self, rows: int) -> tuple[Chain, Captured]:
        """The chain at micro-batches of ``rows`` rows, and the capture it was cut from."""
        if rows not in self._made:
            self._made[rows] = self._cut(self._model, rows)
        return self._made[rows]

    def to_materialise(self, rows: int) -> tuple[Chain, Captured, torch.nn.Module]:
        """A chain at ``rows`` cut from a meta copy of its own (returned with it): its stages share
        modules with that copy, so materialising one changes the copy, never the chains above."""
        model = meta_copy(self._model)
        return (*self._cut(model, rows), model)

    def _cut(self, model: torch.nn.Module, rows: int) -> tuple[Chain, Captured]:
        def resize(v: Any) -> Any:
            return torch.empty((rows, *v.shape[1:]), dtype=v.dtype, device="meta") if is_batched(v, self._batch) else v

        args, kwargs = pytree.tree_map(resize, self._example)
        chain, captured = capture_chain(model, self._plan, self._stages, args, kwargs, method=self._method, replicate=self._replicate)
        regions = [n for gm in captured.gm.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes
                   if n.target is torch.ops.higher_order.wrap_with_autocast]
        if regions:
            raise DistributedError(advice(
                f"the model has {len(regions)} autocast region(s) ({regions[0].name}), and its stages' static metadata would be "
                "traced on the meta device, where autocast does not cast: the dtypes crossing stages would be wrong",
                "a model built on the meta device, or a batch of other rows than the example's (its stages are re-cut on meta)",
                "build the model real and keep every batch the example's size, or move the autocast region out of forward",
            ))
        return chain, captured


def keep_only(chain: Chain, captured: Captured, held: Collection[int]) -> tuple[Chain, Captured]:
    """``chain`` and ``captured`` holding no tensor of the model but the ``held`` stages': the other stages
    and the whole graph become copies on the meta device (their code and metadata stay), so a rank
    keeps nothing of the model alive beyond its stage."""
    light = dataclasses.replace(captured, gm=meta_copy(captured.gm))
    args, slots, codegen, _ = chain._output
    nodes = {n.name: n for n in light.gm.graph.nodes}  # the output's nodes, in the copy's graph
    args = torch.fx.node.map_arg(args, lambda n: nodes[n.name])
    slots = tuple(torch.fx.node.map_arg(slot, lambda n: nodes[n.name]) for slot in slots)
    stages = tuple(m if s in held else meta_copy(m) for s, m in enumerate(chain.stages))
    return dataclasses.replace(chain, stages=stages, _output=(args, slots, codegen, light)), light


def capture_chain(
    model: torch.nn.Module, plan: Plan, stages: int, args: tuple, kwargs: dict[str, Any], *, method: str, replicate: set[str]
) -> tuple[Chain, Captured]:
    """The plan's chain from a capture of ``model`` at one micro-batch ``args``/``kwargs``."""
    captured = capture(model, args, kwargs, method=method, param_dtype=capture_dtype(plan.precision))
    refuse_under_autocast(captured.reads_autocast, plan.precision)
    if fingerprint(captured.gm) != plan.fingerprint:
        raise DistributedError(
            advice(
                f"the model captures as another graph at a micro-batch of {batch_size(args, kwargs)} rows than the plan's graph",
                "Python control flow or torch.export specialisation that depends on the batch size",
                "make forward independent of the batch size, or plan with micro_batches=1",
            )
        )
    flat = flat_inputs(captured, args, kwargs)
    own = schedules.lookup(plan.schedule).split_backward
    precision = (plan.precision, stage_device_type(plan))
    return generate_chain(captured, plan.stage_of, stages, flat, replicate=replicate, own_outputs=own, precision=precision,
                          recompute=plan.recompute, partial=plan.recompute_partial,
                          selective=plan.recompute_selective), captured
