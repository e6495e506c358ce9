"""What the mesh search knows of a configuration before planning it: its proofs, from the global batch's table.

The mesh search (:mod:`autosplit.compiler.mesh`) costs the whole model once, at the global batch on one
device, without recomputation (``whole``). From that table alone, before a configuration's share of the
batch is captured and split:

- :func:`state_fits` refuses one whose model state cannot fit its devices however it is split;
- :func:`step_floor` bounds from below the step of every plan of it — the configurations are planned
  cheapest floor first, and one whose floor leaves no room below the best step found is not planned:
  it cannot win. Its floor stands in the plan's bound, so the gap still covers it.

The floor is the largest of four, each proven for any split of the share, any recomputation (which
only adds work) and any micro-batch count the options leave open:

- **work**: every device's share of the forward and backward of its copy's rows (tensor parallelism's
  compute and collectives as :func:`~autosplit.passes.tp_costs.tp_laid_out` costs them) and of the
  optimizer step, spread evenly over the ``pp`` ranks;
- **the heaviest node**: a node runs whole on one rank of each copy, every micro-batch of it;
- **the pipeline's fill and drain** (one stage per rank, a whole backward: GPipe, 1F1B): rank ``r``
  starts only when the first micro-batch's forward has passed the stages before it, and the step ends
  only when the last micro-batch's backward has passed them again, so with ``M`` micro-batches and
  stage ``s`` doing ``w_s`` in all, the step is at least ``max_r (Σ_{s<r} w_s / M + w_r)`` — over every
  split, at least ``W / (M (1 − (1 − 1/M)^pp))`` for a copy's work ``W`` (equalising the terms gives
  it), which tends to ``W / pp`` as ``M`` grows.

A share's table is at least the global one over ``dp`` node by node: the roofline's FLOPs and bytes
grow no slower than the rows, and each micro-batch pays the launch again. The floor holds for the
analytic costs of a mesh of one kind of device; otherwise it is 0 (no configuration is passed over).

Usage::

    state_fits(laid_out(whole, dp_shard=4), ranks, degrees)
    floor = step_floor(whole, traced, degrees, options, specs)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from autosplit.compiler.costs import cp_table, ep_table, tp_table
from autosplit.compiler.prediction import fill_and_drain, fills
from autosplit.compiler.search import configurations, stage_problem
from autosplit.compiler.trace import Traced
from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.errors import InfeasiblePlanError, advice
from autosplit.options import PlanOptions
from autosplit.passes.sharding import laid_out, sharded_alone
from autosplit.solver.pipeline.strategy import prove_over_caps
from autosplit.units import format_bytes

__all__ = ["Degrees", "memory_proven", "state_fits", "step_floor"]


@dataclasses.dataclass(frozen=True)
class Degrees:
    """One configuration of the mesh: ``pp`` pipeline ranks × ``data_parallel`` copies kept in step as ``replicate`` says."""

    pp: int
    data_parallel: int
    replicate: str
    tp: int = 1
    ep: int = 1
    """Of ``dp_shard × tp``, the ranks each MoE layer's experts are spread over."""
    cp: int = 1
    """Devices each sequence is split over (between dp_shard and tp)."""

    def __str__(self) -> str:
        dim = "dp_shard" if self.replicate == "fully_shard" else "dp_replicate"
        return (f"pp {self.pp}" + f" × {dim} {self.data_parallel}" * (self.data_parallel > 1) + f" × cp {self.cp}" * (self.cp > 1)
                + f" × tp {self.tp}" * (self.tp > 1) + f" (ep {self.ep})" * (self.ep > 1))

    @property
    def dp_shard(self) -> int:
        return self.data_parallel if self.replicate == "fully_shard" else 1


def step_floor(
    whole: CostTable, traced: Traced, degrees: Degrees, options: PlanOptions, specs: Sequence[DeviceSpec],
    memo: dict[tuple, CostTable] | None = None,
) -> float:
    """Seconds no plan of ``degrees`` (with ``options`` as the configuration is planned) can step in
    (the module docstring); 0 where the floor is not proven for these costs or devices. ``memo``: the laid-out
    tables of a search by their degrees (configurations differing in dp alone share one)."""
    if options.costs != "analytic" or options.cost_overrides or len({(s.name, s.memory) for s in specs}) > 1:
        return 0.0
    table = _floor_table(whole, traced, degrees, options, {} if memo is None else memo)
    dp, pp = degrees.data_parallel, degrees.pp
    per_node = [(f + b - (table.split_cost[n][0] if table.split_cost else 0.0)) / dp
                for n, (f, b) in enumerate(zip((r[0] for r in table.fwd_time), (r[0] for r in table.bwd_time)))]
    work, optimizer = sum(per_node), sum(row[0] for row in table.optimizer_time) if table.optimizer_time else 0.0
    rows = (traced.batch or dp) // dp
    open_ = configurations(options, pp, rows) if options.searches else [options.replace(micro_batches=options.micro_batches_for(pp, rows))]
    fill = min((fill_and_drain(work, pp, int(c.micro_batches or 1)) if fills(c.schedule, c.rank_stages) else work / pp
                for c in open_), default=work / pp)
    return max((work + optimizer) / pp, max(per_node, default=0.0), fill)


def _floor_table(whole: CostTable, traced: Traced, degrees: Degrees, options: PlanOptions, memo: dict[tuple, CostTable]) -> CostTable:
    """``whole`` laid out as one device of ``degrees`` holds it (tp, cp, ep, FSDP alone over dp_shard × cp); ``memo``:
    the tables made before, by the degrees they depend on (the tp, cp and ep layout, then its FSDP over dp_shard)."""
    laid = (degrees.tp, degrees.cp, degrees.ep, options.dp_shard)
    if laid in memo:
        return memo[laid]
    split = memo.get(laid[:3])
    if split is None:
        split = whole
        if degrees.tp > 1:
            split = tp_table(whole, traced, options, tp=degrees.tp, micro_batches=1)
        if degrees.cp > 1:  # every node's work over the sequence's shards (the ring only adds)
            split = cp_table(split, traced, options, micro_batches=1)
        if degrees.ep > 1:  # the experts' compute split over a tp group's ranks (their all-to-all only adds)
            split = ep_table(split, traced, options, micro_batches=1)
        memo[laid[:3]] = split
    memo[laid] = split
    if options.dp_shard * options.cp > 1:
        memo[laid] = laid_out(split, dp_shard=options.dp_shard * options.cp, alone=True, precision=options.precision)
    return memo[laid]


def state_fits(table: CostTable, ranks: tuple[DeviceSpec, ...], degrees: Degrees, row: float = 0.0) -> None:
    """Refuse, before capturing at the share's batch, a configuration whose model state (``table``'s,
    laid out as the configuration holds it; it does not depend on the batch) and ``row`` bytes of
    activations, spread perfectly over its pp devices, exceed their memory.

    ``row``: one row's saved activations where nothing recomputes — the global batch's over its rows.
    Every stage holds at least one micro-batch of at least one row at its peak, and a tensor's bytes
    grow at most in proportion to the batch (``a · rows + c``, ``c ≥ 0``), so this bounds any share.
    Tensor parallelism holds no less than ``1/tp`` of either (:mod:`autosplit.passes.tp_costs`)."""
    need, cap = (sum(table.state_bytes) + row) / (degrees.pp * degrees.tp), sum(d.memory for d in ranks) / degrees.pp  # cp: laid out
    if need > cap:
        what = "the model state alone needs" if not row else "the model state and one row's saved activations need"
        raise InfeasiblePlanError(advice(
            f"{degrees}: {what} {format_bytes(need)} per device spread perfectly over {degrees.pp * degrees.tp} "
            f"(proven), more than the {format_bytes(cap)} each holds",
            "parameters, gradients and optimizer state do not shrink with the batch" + ("" if not row else
            ", and without recomputation every stage holds at least one row's activations"),
            "more pipeline stages, replicate='fully_shard', checkpointing='auto', or a precision that holds less",
        ))


BATCH_BYTES = ("saved_bytes", "output_bytes", "sent_bytes", "wgrad_bytes", "block_saves", "block_shared", "block_activations")
"""The :class:`~autosplit.costtable.CostTable` fields of bytes that grow with the batch, over the whole batch
(:attr:`~autosplit.costtable.CostTable.transient_bytes` grows with it too, over one micro-batch)."""


def memory_proven(whole: CostTable, traced: Traced, degrees: Degrees, options: PlanOptions, ranks: Sequence[DeviceSpec]) -> None:
    """Refuse, before its share of the batch is captured, a configuration that no split fits under
    any schedule, stages per rank and micro-batch count the options leave open, each proven over the
    caps by the memory floors (:func:`~autosplit.solver.pipeline.strategy.prove_over_caps`, every block
    the options allow recomputed) on a table that holds no more than the share's: ``whole`` (the global
    batch's, describing the blocks a plan may recompute) with every byte that grows with the batch over
    ``dp`` — a tensor's bytes grow at most in proportion to the rows (:func:`state_fits`), and the state
    not at all — laid out over tp and dp_shard as the share's table is. The largest micro-batch count
    first: it holds the least in flight, so the first count not proven ends the proof soonest.

    Proven for the analytic costs of a mesh of one kind of device (otherwise nothing is refused), and
    without the user's constraints (which only take splits away)."""
    if options.costs != "analytic" or options.cost_overrides or len({(d.name, d.memory) for d in ranks}) > 1:
        return
    dp, pp = degrees.data_parallel, degrees.pp
    over_dp: dict[str, Any] = {f: tuple(v // dp for v in getattr(whole, f)) for f in (*BATCH_BYTES, "transient_bytes")}
    on_ranks: dict[str, Any] = {f: tuple(row * pp for row in getattr(whole, f))
                                for f in ("fwd_time", "bwd_time", "optimizer_time", "split_cost")}
    share = dataclasses.replace(whole, devices=tuple(ranks), **over_dp, **on_ranks, block_transient=whole.block_transient // dp)
    if degrees.tp > 1:
        share = tp_table(share, traced, options, tp=degrees.tp, micro_batches=1)
    if degrees.cp > 1:  # the activations of 1/cp of the tokens
        share = cp_table(share, traced, options, micro_batches=1)
    if degrees.ep > 1:  # the experts' state: each rank holds E / ep of them
        share = ep_table(share, traced, options, micro_batches=1)
    rows = (traced.batch or dp) // dp
    open_ = configurations(options, pp, rows) if options.searches else [options.replace(micro_batches=options.micro_batches_for(pp, rows))]
    proofs = []
    for c in sorted(open_, key=lambda c: -int(c.micro_batches or 1)):
        M = int(c.micro_batches or 1)
        table = laid_out(dataclasses.replace(share, transient_bytes=tuple(v // M for v in share.transient_bytes),
                                             block_transient=share.block_transient // M),
                         dp_shard=c.dp_shard * c.cp, alone=sharded_alone(pp, M, c.dp_shard * c.cp, ranks), precision=c.precision)
        try:
            prove_over_caps(stage_problem(table, pp, c, M, [])[1])
        except InfeasiblePlanError as e:
            proofs.append(f"{c.schedule} × {c.rank_stages} × M={M}: {str(e).split('. Likely cause')[0]}")
            continue
        return
    raise InfeasiblePlanError(advice(
        f"{degrees}: no split fits the memory caps under any of the {len(proofs)} schedule(s) and micro-batch counts the options "
        f"leave open (proven before capturing its share, on a table holding no more than the share's): {proofs[0] if proofs else ''}",
        "model state and the activations in flight exceed the caps, recomputing every block the options allow",
        "more pipeline stages or tp, replicate='fully_shard', checkpointing='auto', or a precision that holds less",
    ))
