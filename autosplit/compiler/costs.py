"""Step *estimate*: the cost table ``PlanOptions.costs`` asks for — analytic, measured, or given — with overrides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autosplit import progress, schedules
from autosplit.compiler.constraints import user_constraints
from autosplit.compiler.recompute import candidate_blocks
from autosplit.compiler.trace import Traced
from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec, uncalibrated
from autosplit.engine_profiles import engine_of
from autosplit.errors import ConstraintError, CostModelError, advice
from autosplit.options import AUTO, PlanOptions, ProfileOptions
from autosplit.passes.annotations import node_info
from autosplit.passes.costs import LossCost, estimate, with_overrides
from autosplit.passes.cp_costs import check_heads, cp_laid_out, exposed_ring, sequence_length
from autosplit.passes.ep_costs import ep_laid_out
from autosplit.passes.experts import check_experts
from autosplit.passes.fusion import Fusion, norm_paths
from autosplit.passes.loss import cost_loss, output_like
from autosplit.passes.profile import Profile, profile
from autosplit.passes.sharding import laid_out, sharded_alone
from autosplit.passes.tensor_parallel import check_degree
from autosplit.passes.tp_costs import tp_laid_out
from autosplit.plans import LOSS_COSTED, PartialRecompute
from autosplit.shapes import is_meta
from autosplit.solver.problem import UserConstraint
from autosplit.timers import pinned

__all__ = ["check_sequence", "cost_table", "cp_table", "ep_table", "estimated", "float8_fields", "sequence_parallel", "tp_fields",
           "tp_table"]


KEPT_TABLES = 8
"""Analytic cost tables a trace keeps (the last made): a search costs a configuration, then plans it."""


def cost_table(
    traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, *, micro_batches: int, recompute: tuple[str, ...] = (),
    partial: tuple[PartialRecompute, ...] = (), selective: bool | None = None, laid: bool = True,
) -> tuple[CostTable, str]:
    """The cost table ``options.costs`` asks for (with overrides), and a line saying where it came from.
    It describes the blocks a plan may recompute (``options.checkpointing``, ``options.recompute``),
    and its costs are those of recomputing the blocks labelled in ``recompute`` (of them, ``partial``
    keep some micro-batches; ``selective``, if given, overrides ``options.selective``: a saved plan
    recomputes as it was made). ``laid=False``: the model state as one unsharded device holds it,
    before :func:`~autosplit.passes.sharding.laid_out` (which ``"bf16-fsdp"`` applies at every degree),
    for callers that lay it out themselves. Analytic tables are kept on ``traced`` by all that decides them."""
    selective = options.selective is True if selective is None else selective
    if options.costs != "analytic" or options.cost_overrides:
        return _cost_table(traced, specs, options, micro_batches=micro_batches, recompute=recompute, partial=partial,
                           selective=selective, laid=laid)
    key = (specs, micro_batches, tuple(recompute), tuple(partial), options.precision, options.float8, options.float8_exclude,
           options.optimizer, options.checkpointing, tuple(options.recompute or ()), selective, options.tp, options.sequence_parallel,
           options.async_tp, options.dp_shard, options.ep, options.ep_overlap, options.cp, options.cp_comm, laid)
    kept = traced._tables
    if key not in kept:
        kept[key] = _cost_table(traced, specs, options, micro_batches=micro_batches, recompute=recompute, partial=partial,
                                selective=selective, laid=laid)
        while len(kept) > KEPT_TABLES:
            kept.pop(next(iter(kept)))
    return kept[key]


def _cost_table(
    traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, *, micro_batches: int, recompute: tuple[str, ...],
    partial: tuple[PartialRecompute, ...], selective: bool, laid: bool = True,
) -> tuple[CostTable, str]:
    costs, gm = options.costs, traced.annotated(options.precision, specs[0].device_type)
    if isinstance(costs, (CostTable, Path)) or (isinstance(costs, str) and costs not in ("analytic", "measured")):
        table = _given_table(traced, specs, costs)
        source = f"given table ({costs if isinstance(costs, (str, Path)) else 'object'})"
        if (options.checkpointing != "none" or options.recompute or recompute) and not table.blocks:
            raise CostModelError(advice(
                f"checkpointing={options.checkpointing!r} needs the blocks a plan may recompute, and the given cost table has none",
                "a given table holds the costs of one way to run the model", "plan with costs='analytic' or 'measured'",
            ))
    else:
        profiling = None if costs == "analytic" else ProfileOptions() if costs == "measured" else costs
        if profiling is None:
            profiles: list[Profile | None] = [None] * len(specs)
            present = sorted({str(s.torch_device) for s in specs if uncalibrated(s)})
            source = "analytic" + (f" (uncalibrated for {', '.join(present)})" if present else "")
        else:  # profiled once; both tables below are made from the same profiles
            assert isinstance(profiling, ProfileOptions)
            profiles, source = _measured(traced, specs, profiling, options, micro_batches)
        loss = _loss(traced, specs, options, micro_batches, profiling)
        if loss is not None:
            source += f"; {LOSS_COSTED}"
        fuses = engine.fuses if (engine := engine_of(specs)) is not None else ()
        estimated = functools.partial(estimate, gm, specs, optimizer=options.optimizer, micro_batches=micro_batches,
                                      profiles=profiles, loss=loss, selective=selective, float8=options.float8,
                                      float8_exclude=options.float8_exclude,
                                      fusion=Fusion(norms=norm_paths(traced.model) if "norm" in fuses else frozenset(),
                                                    gated="gated" in fuses, fp8_inputs="fp8-inputs" in fuses,
                                                    fp8_weights="fp8-weights" in fuses and options.float8 in ("tensorwise", "auto"),
                                                    fp8_experts="fp8-experts" in fuses,
                                                    torchao_weights="fp8-weights" not in fuses and options.precision == "bf16-mixed",
                                                    attention=specs[0].device_type == "cuda"))
        # the blocks depend on the graph and the devices, not the batch: decided once, on the first table
        # (measured layers need not time alike: there each table decides)
        key = (traced.fingerprint, options.precision, options.float8, options.float8_exclude, specs, options.checkpointing,
               tuple(options.recompute or ()), tuple(recompute))
        first = None
        if key not in traced._blocks or profiling is not None:
            first = estimated()
            traced._blocks[key] = candidate_blocks(first, options, recompute)
        blocks = traced._blocks[key]
        table = estimated(blocks=blocks, recompute=recompute, partial=partial) if blocks or first is None else first
    if options.cost_overrides:
        n = len(options.cost_overrides)
        table = with_overrides(table, options.cost_overrides)
        source += f" + {n} override{'s' * (n > 1)}"
    if options.tp > 1:
        check_degree(traced.tp_rules(), options.tp)
        table = tp_table(table, traced, options, tp=options.tp, micro_batches=micro_batches)
        source += f"; tensors split over tp {options.tp}"
    if options.cp > 1:
        gm = traced.annotated(options.precision, table.devices[0].device_type)
        exposed = exposed_ring(table, gm, cp=options.cp, tp=options.tp, micro_batches=micro_batches, comm=options.cp_comm)
        table = cp_table(table, traced, options, micro_batches=micro_batches)
        ms = f"{exposed * 1e3:.3g} ms per step"
        source += f"; sequence split over cp {options.cp} (" + (
            f"all-to-alls of Q, K, V and the output: {ms})" if options.cp_comm == "a2a" else
            "its K/V ring hidden behind attention)" if exposed == 0 else f"its K/V ring exposed {ms} beyond attention)")
    if options.ep > 1:
        table = ep_table(table, traced, options, micro_batches=micro_batches)
        source += f"; experts over ep {options.ep}"
    if not laid:
        return table, source
    shards = options.dp_shard * options.cp  # FSDP shards over dp_shard × cp, as torchtitan does
    table = laid_out(table, dp_shard=shards, alone=sharded_alone(len(specs), micro_batches, shards, specs), precision=options.precision)
    if shards > 1:
        source += f"; sharded over dp_shard {options.dp_shard}" + f" × cp {options.cp}" * (options.cp > 1)
    return table, source


def tp_table(table: CostTable, traced: Traced, options: PlanOptions, *, tp: int, micro_batches: int) -> CostTable:
    """``table`` as one device of a tp group of ``tp`` runs it under ``options`` (:func:`tp_laid_out`). An FP8
    linear's operands are gathered in FP8 where its engine casts them first, fused into the norm before:
    Transformer Engine. torchao's are costed as gathered in bf16 and cast whole on every rank, what autosplit's
    runtime would do and what torchtitan's published TP rows bear out (docs/float8.md)."""
    engine = engine_of(table.devices)
    gathered = engine is not None and "fp8-inputs" in engine.fuses
    return tp_laid_out(table, traced.annotated(options.precision, table.devices[0].device_type), traced.tp_rules(), tp=tp,
                       micro_batches=micro_batches, numel=traced.param_numel(), sequence_parallel=sequence_parallel(traced, options),
                       precision=options.precision, async_tp=options.async_tp, float8_gathered=gathered)


def cp_table(table: CostTable, traced: Traced, options: PlanOptions, *, micro_batches: int) -> CostTable:
    """``table`` (laid out over tp) as one device of a context-parallel group of ``options.cp`` runs it
    (:func:`~autosplit.passes.cp_costs.cp_laid_out`); refused where the sequence does not divide ``2 · cp · tp``, or, for the
    all-to-all form, where cp does not divide a tp rank's heads."""
    gm = traced.annotated(options.precision, table.devices[0].device_type)
    check_sequence(sequence_length(gm), options.cp, options.tp)
    if options.cp_comm == "a2a":
        check_heads(gm, options.cp, options.tp)
    return cp_laid_out(table, gm, cp=options.cp, tp=options.tp, micro_batches=micro_batches, comm=options.cp_comm)


def check_sequence(sequence: int | None, cp: int, tp: int) -> None:
    """Refuse a cp the graph's attention cannot be split by: none, or a sequence that ``2 · cp · tp`` does not divide
    (each rank holds a head and a tail chunk of ``s / (2·cp)`` tokens, which tp splits again under sequence parallelism)."""
    if cp <= 1:
        return
    if sequence is None:
        raise ConstraintError(advice(f"context_parallel={cp}, and this graph runs no scaled-dot-product attention",
                                     "context parallelism splits attention's sequence over a ring of devices",
                                     "plan with context_parallel=1"))
    if sequence % (2 * cp * tp):
        fits = [c for c in range(1, sequence + 1) if sequence % (2 * c * tp) == 0 and c <= 64]
        raise ConstraintError(advice(
            f"the sequence of {sequence} tokens does not divide 2 · cp {cp} · tp {tp} = {2 * cp * tp}",
            "each cp rank holds a head and a tail chunk of the sequence (causal attention's work balanced), split again over tp",
            f"pass context_parallel= one of {fits}, or 'auto'",
        ))


def ep_table(table: CostTable, traced: Traced, options: PlanOptions, *, micro_batches: int) -> CostTable:
    """``table`` (laid out over tp) as one device of an expert-parallel group of ``options.ep`` runs it
    (:func:`~autosplit.passes.ep_costs.ep_laid_out`); refused where the graph has no experts, or where ``ep``
    does not divide every layer's."""
    device_type = table.devices[0].device_type
    groups = traced.expert_groups(options.precision, device_type)
    check_experts(groups, options.ep)
    gm = traced.annotated(options.precision, device_type)
    owners = {n.name: node_info(n).params for n in gm.graph.nodes if "autosplit" in n.meta}
    return ep_laid_out(table, groups, ep=options.ep, tp=options.tp, micro_batches=micro_batches, numel=traced.param_numel(),
                       owners=owners, tokens_cut=options.tp > 1 and sequence_parallel(traced, options), cp=options.cp,
                       overlap=options.ep_overlap)


def tp_fields(traced: Traced, options: PlanOptions) -> dict[str, Any]:
    """The :class:`~autosplit.plans.Plan` fields of the options' tensor and expert parallelism (none for tp 1, ep 1)."""
    experts = {"expert_parallel": options.ep, "ep_overlap": options.ep_overlap} if options.ep > 1 else {}
    experts |= {"context_parallel": options.cp, "cp_comm": options.cp_comm} if options.cp > 1 else {}
    if options.tp <= 1:
        return experts
    rules = traced.tp_rules()
    return {**experts, "tensor_parallel": options.tp, "tp_shards": _every_name(traced, rules.shards), "tp_whole": dict(rules.replicated),
            "sequence_parallel": sequence_parallel(traced, options), "async_tp": options.async_tp}


def float8_fields(table: CostTable) -> dict[str, Any]:
    """The :class:`~autosplit.plans.Plan` fields of the linears ``table`` costs in FP8 (``"auto"`` resolved)."""
    return {"float8": table.float8_recipe, "float8_linears": table.float8_linears, "float8_kept": table.float8_kept}


def sequence_parallel(traced: Traced, options: PlanOptions) -> bool:
    """``options.sequence_parallel`` under tp > 1: ``"auto"`` where no linear stays whole; ``True``
    refused where one does (its input would be split along the sequence and its output not)."""
    whole = sorted(traced.tp_rules().whole_linears)
    if options.sequence_parallel == AUTO:
        return options.tp > 1 and not whole
    if options.sequence_parallel and whole:
        raise ConstraintError(advice(
            f"sequence_parallel=True, and the tensor-parallel rules leave {len(whole)} linear(s) whole: {whole[:3]}",
            "sequence parallelism splits the activations between split layers, which every linear must then read split",
            "plan with sequence_parallel=False",
        ))
    return bool(options.sequence_parallel)


def _every_name(traced: Traced, shards: Mapping[str, int]) -> dict[str, int]:
    """``shards`` (a tied parameter under its first name) under every name of each tied parameter: the
    runtime places one tensor whatever name a stage reads it by."""
    out = dict(shards)
    names: dict[int, list[str]] = {}
    for name, p in (traced.model.named_parameters(remove_duplicate=False) if traced.model is not None else ()):
        names.setdefault(id(p), []).append(name)
    for group in names.values():
        split = [shards[n] for n in group if n in shards]
        if split:
            out.update(dict.fromkeys(group, split[0]))
    return out


def _loss(traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions, micro_batches: int,
          profiling: ProfileOptions | None) -> LossCost | None:
    """One micro-batch's loss on every device (measured where ``profiling``), or None without a loss;
    made once per (micro-batches, precision, devices, profiling) and kept on ``traced``."""
    if traced.loss is None:
        return None
    key = (micro_batches, options.precision, specs, profiling)
    if key not in traced._losses:
        captured, micro = traced.at_micro_batch(micro_batches)
        output = output_like(captured, micro, options.precision, specs[0].device_type)
        with pinned(profiling.threads, profiling.cores) if profiling is not None else contextlib.nullcontext():
            traced._losses[key] = cost_loss(traced.loss, output, micro_batches, specs, measure=profiling is not None,
                                            precision=options.precision)
    return traced._losses[key]


def _measured(
    traced: Traced, specs: tuple[DeviceSpec, ...], profiling: Any, options: PlanOptions, micro_batches: int,
) -> tuple[list[Profile | None], str]:
    """Each device's profile (None for a plan-only preset), and a line saying where the costs came from."""
    if traced.model is not None and is_meta(traced.model):
        raise CostModelError(advice(
            "costs='measured' times the model's nodes on real weights, and this model is on the meta device",
            "planning a meta model allocates nothing for its weights",
            "plan it with costs='analytic' (calibrated device specs: autosplit.calibrate on a small real model), "
            "or measure a real copy of it",
        ))
    present = sorted({s.torch_device for s in specs if s.torch_device is not None})
    if not present:
        raise CostModelError(
            advice(
                f"costs='measured' needs a device to measure on, but {[s.name for s in specs]} are all plan-only presets",
                "presets have no hardware here to profile on",
                "pass torch devices (e.g. 'cpu', 'cuda:0'), or costs='analytic' with calibrated specs (autosplit.calibrate)",
            )
        )
    captured, micro = traced.at_micro_batch(micro_batches)
    entry = schedules.lookup(options.schedule)
    profiles = {
        dev: profile(captured, micro, dev, fingerprint=traced.fingerprint, options=profiling, micro_batches=micro_batches,
                     forwards_first=entry.forwards_first, optimizer=options.optimizer,
                     split_backward=entry.split_backward,  # a zero-bubble schedule's I and W, timed apart
                     precision=options.precision)
        for dev in present
    }
    hits = sum(p.cached for p in profiles.values())
    analytic = [s.name for s in specs if s.torch_device is None]
    return [profiles.get(s.torch_device) if s.torch_device else None for s in specs], (
        f"measured on {', '.join(present)}" + (f" (cache: {hits} of {len(profiles)})" if hits else "")
        + (f"; analytic for {', '.join(dict.fromkeys(analytic))}" if analytic else "")
    )


def _given_table(traced: Traced, specs: tuple[DeviceSpec, ...], costs: CostTable | str | Path) -> CostTable:
    table = costs if isinstance(costs, CostTable) else CostTable.load(costs)
    nodes = tuple(n.name for n in traced.captured.gm.graph.nodes if n.op not in ("placeholder", "output"))
    if table.nodes != nodes:
        missing = sorted(set(nodes) - set(table.nodes))
        raise CostModelError(
            advice(
                f"the given cost table has {len(table.nodes)} nodes, the captured graph {len(nodes)} "
                f"(first missing: {missing[:3]})",
                "the table belongs to another model or input shape",
                "save a table from this model (CostTable.save) and edit it, or use cost_overrides=",
            )
        )
    if len(table.devices) != len(specs):
        raise CostModelError(
            advice(
                f"the given cost table has times for {len(table.devices)} devices, but {len(specs)} devices were given",
                "the table was made for other devices",
                "plan with the devices the table was made for, or save a table for these devices",
            )
        )
    return dataclasses.replace(table, devices=specs)


def estimated(
    traced: Traced, specs: tuple[DeviceSpec, ...], options: PlanOptions
) -> tuple[dict[str, float], int, CostTable, str, list[UserConstraint]]:
    """Step *estimate*, timed: the step's timings so far, the micro-batches, the cost table, where
    its figures came from, and the user's constraints over its nodes."""
    timings = dict(traced.timings)
    M = options.micro_batches_for(len(specs), traced.batch)
    with progress.timed_pass("estimate", timings):
        table, source = cost_table(traced, specs, options, micro_batches=M)
    return timings, M, table, source, user_constraints(table, options)
