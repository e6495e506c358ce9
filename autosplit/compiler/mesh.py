"""Step *mesh*: the data-parallel degrees chosen with the split (DESIGN §4.9).

``world`` devices form the mesh ``pp × dp_replicate × dp_shard × tp`` (pp outermost, tp innermost,
as torchtitan builds it). For every tensor-parallel degree ``tp`` that divides the devices and fits
a node (or the one pinned, ``tensor_parallel=``; the graph's rules refuse one its head counts do not
allow, :mod:`autosplit.passes.tensor_parallel`), every data-parallel degree ``dp`` that divides the
rest and the global batch (or the one the user pinned,
``data_parallel=``), and every way its copies keep in step (``replicate="replicate"``: whole copies,
the mesh's dp_replicate; ``"fully_shard"``: sharded, its dp_shard; or the one pinned), one
pipeline of ``pp = world / (dp · tp)`` stages is planned for ``1/dp`` of the batch by the whole planner —
split, schedule, stages per rank, micro-batches, recomputation, precision — with the layout in
its costs (:mod:`autosplit.passes.sharding`). The global batch is fixed, so the fastest step is
the fastest training; the plan returned lists every configuration tried
(:attr:`~autosplit.plans.Plan.alternatives`), and its bound is the least any configuration can
reach, so its gap covers the degrees too.

Stage ``s`` of a configuration runs on rank ``s · dp · tp`` (its tp group and copies the ranks after
it), so a tp group stays inside a node, a data-parallel group too while ``dp · tp`` fits one, and the
pipeline crosses nodes.

Usage::

    plan = mesh_plan(traced, specs, options.replace(data_parallel="auto", replicate="auto"))
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence

from autosplit import progress
from autosplit.compiler.costs import cost_table
from autosplit.compiler.mesh_bounds import Degrees, memory_proven, state_fits, step_floor
from autosplit.compiler.steps import compile_plan
from autosplit.compiler.trace import Traced
from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.errors import AutosplitError, ConstraintError, InfeasiblePlanError, SolverError, advice
from autosplit.options import AUTO, REPLICATES, PlanOptions
from autosplit.passes.cp_costs import sequence_length
from autosplit.passes.experts import check_experts
from autosplit.passes.sharding import laid_out
from autosplit.passes.tensor_parallel import check_degree
from autosplit.plans import Alternative, Plan

__all__ = ["Degrees", "degrees_to_try", "mesh_plan", "stage_ranks"]

log = logging.getLogger(__name__)


def degrees_to_try(
    world: int, batch: int | None, options: PlanOptions, island: int | None = None, kind: str = "", experts: Sequence[int] = (),
    sequence: int | None = None,
) -> list[Degrees]:
    """Every configuration of ``world`` devices the options leave open, for a global batch of ``batch``
    rows, tensor parallelism inside an ``island`` of devices (a node; None: any), and expert parallelism
    over the ``experts`` of each MoE layer (their counts; none: a dense model, ep 1 unless pinned); refuses
    a pinned degree that does not divide the devices or the batch, a tp wider than a node (of ``kind``, the
    devices' name, as the message says it), or an ep no configuration's ``dp_shard × tp`` holds. Context parallelism:
    the pinned cp, or under ``"auto"`` every cp that the devices left by tp and the attention's ``sequence`` (2 · cp · tp
    dividing it; None: no attention, cp 1) allow."""
    tps = _tensor_parallel_degrees(world, island, options, kind)
    pairs = [(tp, cp) for tp in tps for cp in _context_degrees(world // tp, tp, options, sequence)]
    if not pairs:  # a pinned cp that the devices left by every tp leave no room for
        raise ConstraintError(advice(f"context_parallel={options.cp} does not divide the devices left by tp {tps}",
                                     "world size = pp × dp_replicate × dp_shard × cp × tp",
                                     f"pass context_parallel= one of {_divisors(world // tps[0])}, or 'auto'"))
    pinned = None if options.data_parallel == AUTO else options.replicas
    room = world // (tps[0] * options.cp) if len(tps) == 1 and options.context_parallel != AUTO else world
    if pinned is not None and (room % pinned or (batch is not None and batch % pinned)):
        raise ConstraintError(advice(
            f"data_parallel={pinned} does not divide the {room} devices" + f" left by tp {tps[0]}" * (room != world)
            if room % pinned else f"data_parallel={pinned} does not divide the global batch of {batch} rows",
            "world size = pp × dp_replicate × dp_shard × tp, and every data-parallel copy takes an equal share of the batch",
            f"pass data_parallel= one of {[d for d in range(1, room + 1) if room % d == 0 and (batch or d) % d == 0]}, "
            "or 'auto'",
        ))
    layouts = REPLICATES if options.replicate == AUTO else (options.replicate,)
    dense = [
        Degrees(world // (d * tp * cp), d, layout, tp, cp=cp) for tp, cp in pairs
        for d in ([pinned] if pinned is not None else _divisors(world // (tp * cp)))
        if (world // (tp * cp)) % d == 0 and (batch is None or batch % d == 0)
        for layout in (layouts if d > 1 else REPLICATES[:1])
    ]
    with_ep = [dataclasses.replace(c, ep=ep) for c in dense for ep in _expert_degrees(c, options, experts)]
    if options.expert_parallel != AUTO and options.ep > 1 and not with_ep:
        raise ConstraintError(advice(
            f"expert_parallel={options.ep} divides no configuration's dp_shard × tp over {world} devices "
            f"(they hold {sorted({c.dp_shard * c.tp for c in dense})})",
            "the experts' ranks are borrowed from the dense mesh's dp_shard × tp, as torchtitan borrows them",
            "pass replicate='fully_shard' with a data_parallel (or tensor_parallel) that ep divides, or expert_parallel='auto'",
        ))
    return with_ep


def _context_degrees(room: int, tp: int, options: PlanOptions, sequence: int | None) -> list[int]:
    """The cp degrees to try beside ``tp``: the pinned one where it divides the ``room`` tp leaves, or every divisor of
    the room whose ``2 · cp · tp`` divides the attention's sequence (1 alone without attention)."""
    if options.context_parallel != AUTO:
        return [] if room % options.cp else [options.cp]
    return [c for c in _divisors(room) if c == 1 or (sequence is not None and sequence % (2 * c * tp) == 0)]


def _expert_degrees(degrees: Degrees, options: PlanOptions, experts: Sequence[int]) -> list[int]:
    """The ep degrees to try on a configuration: the pinned one where its ``dp_shard × tp`` holds it, else every
    divisor of that which divides each layer's experts (1 alone for a dense model)."""
    room = degrees.dp_shard * degrees.tp
    if options.expert_parallel != AUTO:
        return [options.ep] if room % options.ep == 0 else []
    return [e for e in _divisors(room) if all(n % e == 0 for n in experts)] if experts else [1]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tensor_parallel_degrees(world: int, island: int | None, options: PlanOptions, kind: str = "") -> list[int]:
    """The tp degrees to try: the pinned one, or every divisor of the devices that fits a node."""
    node = island or world
    if options.tensor_parallel == AUTO:
        return [t for t in _divisors(world) if t <= node]
    tp = options.tp
    if tp > node or world % tp:
        raise ConstraintError(advice(
            f"tp {tp} exceeds the {node} {kind + ' ' if kind else ''}devices of a node" if tp > node
            else f"tensor_parallel={tp} does not divide the {world} devices",
            "a tensor-parallel group exchanges activations at every layer, so it stays inside a node's fast links"
            if tp > node else "world size = pp × dp_replicate × dp_shard × tp",
            f"pass tensor_parallel= one of {[t for t in _divisors(world) if t <= node]}, or 'auto'",
        ))
    return [tp]


def mesh_plan(traced: Traced, specs: Sequence[DeviceSpec], options: PlanOptions) -> Plan:
    """The fastest plan over every configuration of ``specs`` (the mesh's ranks in order) that
    :func:`degrees_to_try` gives, each planned by :func:`compile_plan`; an
    :class:`InfeasiblePlanError` naming every configuration's reason when none fits."""
    timings: dict[str, float] = {}
    with progress.timed_pass("mesh", timings):
        tried = _search(traced, specs, options)
    plans = [(d, p) for d, p in tried if isinstance(p, Plan)]
    if not plans:
        raise _none_fits(len(specs), tried)
    _, best = min(plans, key=lambda dp: dp[1].step_time)
    return dataclasses.replace(
        best, alternatives=_alternatives(tried), solver=dataclasses.replace(best.solver, step_bound=_bound(tried)),
        timings={**best.timings, **timings},
    )


@dataclasses.dataclass(frozen=True)
class Unplanned:
    """A configuration the search did not plan: no plan of it steps in less than ``floor`` seconds."""

    floor: float
    why: str


Outcome = Plan | AutosplitError | Unplanned


def _search(traced: Traced, specs: Sequence[DeviceSpec], options: PlanOptions) -> list[tuple[Degrees, Outcome]]:
    """Every configuration's outcome, in two rounds. First, cheapest floor first
    (:func:`~autosplit.compiler.mesh_bounds.step_floor`), the split DP's plan of each (exact over one
    order; CP-SAT left out) — but not of one whose floor leaves no room below the best step found
    (beyond the options' gap: it cannot win), nor, once a plan is found, of any after the options'
    ``time_limit``. Then, while the search has used less than ``time_limit``, the whole solver for each
    configuration whose bound leaves room below the best step, most room first."""
    start = time.perf_counter()
    first = options.replace(limits=dataclasses.replace(options.limits, cpsat_vars=1))
    plain = options.replace(data_parallel=1, replicate="replicate", tensor_parallel=1, expert_parallel=1, context_parallel=1,
                            cost_overrides=None, costs="analytic")
    # the model state, whatever the batch, as one unsharded device holds it (each configuration lays it out);
    # the global batch's costs and the blocks a plan may recompute
    whole, _ = cost_table(traced, tuple(specs[:1]), plain, micro_batches=1, laid=False)
    tried: dict[Degrees, Outcome] = {}
    floors: dict[Degrees, float] = {}
    memo: dict[tuple, CostTable] = {}  # the floors' tables (mesh_bounds._floor_table) and least states (_proven) by what they hold
    groups = traced.expert_groups(options.precision, specs[0].device_type) if options.expert_parallel != 1 else ()
    check_experts(groups, options.ep)  # a pinned ep the layers' experts do not divide, in their terms
    experts = [g.experts for g in groups] if options.expert_parallel == AUTO else []
    sequence = sequence_length(traced.annotated(options.precision, specs[0].device_type)) if options.context_parallel == AUTO else None
    for degrees in degrees_to_try(len(specs), traced.batch, options, specs[0].island_size, specs[0].name, experts, sequence):
        try:
            floors[degrees] = _proven(traced, specs, options, degrees, whole, memo)
        except AutosplitError as e:
            log.info("%s: %s", degrees, e)
            tried[degrees] = e
    best = math.inf
    for degrees in sorted(floors, key=lambda d: (floors[d], d.replicate != "fully_shard")):  # sharded twins first
        floor, twin = floors[degrees], tried.get(dataclasses.replace(degrees, replicate="fully_shard"))
        if degrees.replicate == "replicate" and isinstance(twin, InfeasiblePlanError):
            tried[degrees] = InfeasiblePlanError(advice(
                f"{degrees} holds all that {dataclasses.replace(degrees, replicate='fully_shard')} holds and more (whole copies of "
                "the parameters, gradients and optimizer state), and that is proven not to fit", _first_sentence(twin),
                "replicate='fully_shard' with more pipeline stages or tp"))
        elif degrees.replicate == "replicate" and isinstance(twin, SolverError):  # not proven: no split of it found either
            tried[degrees] = SolverError(advice(
                f"not planned: {degrees} holds all that {dataclasses.replace(degrees, replicate='fully_shard')} holds and more, "
                "and no split of that was found that fits", _first_sentence(twin),
                "replicate='fully_shard' with more pipeline stages or tp"))
        elif floor >= best * (1 - options.gap):
            tried[degrees] = Unplanned(floor, f"not planned: none of its plans steps in less than {floor:.4g} s, "
                                              f"and the best found takes {best:.4g} s")
        elif best < math.inf and time.perf_counter() - start >= options.time_limit:
            tried[degrees] = Unplanned(floor, f"not planned within the time_limit of {options.time_limit:g} s (its floor: {floor:.4g} s)")
        else:
            tried[degrees] = made = _attempt(traced, specs, first, degrees, whole)
            best = min(best, made.step_time if isinstance(made, Plan) else math.inf)
    for degrees, p in sorted(tried.items(), key=lambda dp: _bound_of(dp[1])):
        room = isinstance(p, SolverError) or (isinstance(p, Plan) and _bound_of(p) < best * (1 - options.gap))
        if room and time.perf_counter() - start >= options.time_limit:
            log.info("the mesh search used its time_limit of %gs: %s keeps its first round's plan", options.time_limit, degrees)
            continue
        if room and options.limits.cpsat_vars > 1:
            again = _attempt(traced, specs, options, degrees)
            if isinstance(again, Plan) and (not isinstance(p, Plan) or again.step_time < p.step_time):
                tried[degrees] = again
                best = min(best, again.step_time)
    return list(tried.items())


def _bound_of(p: Outcome) -> float:
    """The least step a configuration's splits can reach: its replay's bound; where the solver's
    closed form stands for the replay (one stage per rank, a whole backward), its step less the
    solver's gap; its floor where it was not planned; 0 where unknown (no plan, not proven
    infeasible), ∞ where there is none."""
    if isinstance(p, Unplanned):
        return p.floor
    if isinstance(p, Plan):
        return p.solver.step_bound if p.solver.step_bound is not None else p.step_time * (1 - p.solver.gap)
    return 0.0 if isinstance(p, SolverError) else math.inf


def _proven(
    traced: Traced, specs: Sequence[DeviceSpec], options: PlanOptions, degrees: Degrees, whole: CostTable, memo: dict[tuple, CostTable],
) -> float:
    """A configuration's floor (:func:`~autosplit.compiler.mesh_bounds.step_floor`), after the refusals
    that need no capture: a model state that cannot fit, a tp degree the head counts do not allow."""
    chosen = _chosen(options, degrees)
    row = 0.0 if options.checkpoints else sum(whole.saved_bytes) / (traced.batch or math.inf) / degrees.cp  # its tokens over cp
    key = ("least", degrees.pp > 1, chosen.dp_shard * degrees.cp)  # what the least state depends on, kept beside the floors' tables
    if key not in memo:
        # the least state the configuration can hold: FSDP alone may make every module a unit of its own
        least = whole if degrees.pp > 1 else dataclasses.replace(whole, unit_params=(True,) * len(whole.nodes))
        memo[key] = laid_out(least, dp_shard=chosen.dp_shard * degrees.cp, alone=degrees.pp == 1, precision=options.precision)
    least = memo[key]
    state_fits(least, stage_ranks(specs, degrees), degrees, row)
    if degrees.tp > 1:  # head counts and split sizes the degree must divide, before capturing the share
        check_degree(traced.tp_rules(), degrees.tp)
    return step_floor(whole, traced, degrees, chosen, specs, memo)


def _chosen(options: PlanOptions, degrees: Degrees) -> PlanOptions:
    return options.replace(data_parallel=degrees.data_parallel, replicate=degrees.replicate, tensor_parallel=degrees.tp,
                           expert_parallel=degrees.ep, context_parallel=degrees.cp,
                           # the micro-batches chosen with the degrees unless the user fixed them
                           micro_batches="auto" if options.micro_batches is None else options.micro_batches)


def _attempt(
    traced: Traced, specs: Sequence[DeviceSpec], options: PlanOptions, degrees: Degrees, whole: CostTable | None = None,
) -> Plan | AutosplitError:
    """One configuration's plan — the first rank of each stage's group, ``1/dp`` of the batch — or why there
    is none; with ``whole``, its memory proven over the caps first where it is (no share captured)."""
    chosen = _chosen(options, degrees)
    try:
        if whole is not None:
            memory_proven(whole, traced, degrees, chosen, stage_ranks(specs, degrees))
        share = traced.at_batch(degrees.data_parallel)
        chosen.micro_batches_for(None if chosen.searches else degrees.pp, share.batch)
        return compile_plan(share, stage_ranks(specs, degrees), chosen)
    except AutosplitError as e:
        log.info("%s: %s", degrees, e)
        return e


def stage_ranks(specs: Sequence[DeviceSpec], degrees: Degrees) -> tuple[DeviceSpec, ...]:
    """The device each stage of ``degrees`` is planned on: its first rank, ``s · dp · cp · tp`` (tp innermost,
    then cp, then the data-parallel copies), as it sees its data-parallel peers — an island of ``island_size``
    devices holds ``island_size / (cp · tp)`` of each data-parallel group (its ``island_stride``, cp · tp)."""
    group = degrees.data_parallel * degrees.cp * degrees.tp
    ranks = tuple(specs[s * group] for s in range(degrees.pp))
    inner = degrees.tp * degrees.cp  # the ranks between two of a data-parallel group's
    if inner <= 1:
        return ranks
    return tuple(dataclasses.replace(d, island_stride=inner) for d in ranks)


def _none_fits(world: int, tried: Sequence[tuple[Degrees, Outcome]]) -> AutosplitError:
    """No configuration gives a plan: an :class:`InfeasiblePlanError` where each is proven not to fit
    (or cannot run), a :class:`SolverError` where some ended without a plan or a proof."""
    if all(isinstance(e, (InfeasiblePlanError, ConstraintError)) for _, e in tried):
        return InfeasiblePlanError(_none_fits_message(world, tried))
    return SolverError(_none_fits_message(world, tried))


def _none_fits_message(world: int, tried: Sequence[tuple[Degrees, Outcome]]) -> str:
    return advice(
        f"no configuration of the mesh over {world} devices gives a plan",
        "; ".join(f"{d}: {_first_sentence(e)}" for d, e in tried if isinstance(e, AutosplitError)),
        "pin data_parallel= and replicate='fully_shard' to shard the model state, allow checkpointing='auto', "
        "use precision='bf16-mixed', or more devices",
    )


def _first_sentence(error: AutosplitError) -> str:
    return f"{type(error).__name__}: {str(error).split('. ')[0]}"


def _alternatives(tried: Sequence[tuple[Degrees, Outcome]]) -> tuple[Alternative, ...]:
    rows = []
    for d, p in tried:
        shard = d.data_parallel if d.replicate == "fully_shard" else 1
        rows.append(
            Alternative(p.schedule, p.stages_per_rank, p.micro_batches, p.step_time, p.rank_memory or tuple(s.memory for s in p.stages),
                        data_parallel=d.data_parallel, dp_shard=shard, tensor_parallel=d.tp, expert_parallel=d.ep, context_parallel=d.cp,
                        bound=_bound_of(p),
                        selective=p.recompute_selective) if isinstance(p, Plan)
            else Alternative("", 1, 0, math.inf, note=p.why if isinstance(p, Unplanned) else _first_sentence(p),
                             data_parallel=d.data_parallel, dp_shard=shard, tensor_parallel=d.tp, expert_parallel=d.ep,
                             context_parallel=d.cp,
                             bound=p.floor if isinstance(p, Unplanned) else None)
        )
    return tuple(sorted(rows, key=lambda a: a.step_time))


def _bound(tried: Sequence[tuple[Degrees, Outcome]]) -> float | None:
    """The least step any configuration can reach: each plan's bound; a configuration proven
    infeasible (or that cannot run) reaches none; one not planned, its floor; one that ended unproven
    leaves it unknown (None)."""
    bounds = [_bound_of(p) for _, p in tried]
    return None if 0.0 in bounds else min(bounds)
