"""Step *mesh*: the data-parallel degrees chosen with the split (DESIGN §4.9).

``world`` devices form the mesh ``pp × dp_replicate × dp_shard × tp`` (pp outermost, tp innermost,
as torchtitan builds it; tp = 1 until tensor parallelism is planned). For every data-parallel
degree ``dp`` that divides the devices and the global batch (or the one the user pinned,
``data_parallel=``), and every way its copies keep in step (``replicate="replicate"``: whole copies,
the mesh's dp_replicate; ``"fully_shard"``: sharded, its dp_shard; or the one pinned), one
pipeline of ``pp = world / dp`` stages is planned for ``1/dp`` of the batch by the whole planner —
split, schedule, stages per rank, micro-batches, recomputation, precision — with the layout in
its costs (:mod:`autosplit.passes.sharding`). The global batch is fixed, so the fastest step is
the fastest training; the plan returned lists every configuration tried
(:attr:`~autosplit.plans.Plan.alternatives`), and its bound is the least any configuration can
reach, so its gap covers the degrees too.

Stage ``s`` of a configuration runs on rank ``s · dp`` (its copies the ranks after it), so a
data-parallel group stays inside a node while ``dp`` fits one, and the pipeline crosses nodes.

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
from autosplit.compiler.steps import compile_plan
from autosplit.compiler.trace import Traced
from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.errors import AutosplitError, ConstraintError, InfeasiblePlanError, SolverError, advice
from autosplit.options import AUTO, REPLICATES, PlanOptions
from autosplit.passes.sharding import laid_out
from autosplit.plans import Alternative, Plan
from autosplit.units import format_bytes

__all__ = ["Degrees", "degrees_to_try", "mesh_plan"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Degrees:
    """One configuration of the mesh: ``pp`` pipeline ranks × ``data_parallel`` copies kept in step as ``replicate`` says."""

    pp: int
    data_parallel: int
    replicate: str

    def __str__(self) -> str:
        dim = "dp_shard" if self.replicate == "fully_shard" else "dp_replicate"
        return f"pp {self.pp} × {dim} {self.data_parallel}" if self.data_parallel > 1 else f"pp {self.pp}"


def degrees_to_try(world: int, batch: int | None, options: PlanOptions) -> list[Degrees]:
    """Every configuration of ``world`` devices the options leave open, for a global batch of ``batch``
    rows; refuses a pinned degree that does not divide the devices or the batch."""
    pinned = None if options.data_parallel == AUTO else options.replicas
    if pinned is not None and (world % pinned or (batch is not None and batch % pinned)):
        raise ConstraintError(advice(
            f"data_parallel={pinned} does not divide the {world} devices" if world % pinned else
            f"data_parallel={pinned} does not divide the global batch of {batch} rows",
            "world size = pp × dp_replicate × dp_shard × tp, and every data-parallel copy takes an equal share of the batch",
            f"pass data_parallel= one of {[d for d in range(1, world + 1) if world % d == 0 and (batch or d) % d == 0]}, "
            "or 'auto'",
        ))
    degrees = [pinned] if pinned is not None else [d for d in range(1, world + 1) if world % d == 0 and (batch is None or batch % d == 0)]
    layouts = REPLICATES if options.replicate == AUTO else (options.replicate,)
    return [Degrees(world // d, d, layout) for d in degrees for layout in (layouts if d > 1 else REPLICATES[:1])]


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


def _search(traced: Traced, specs: Sequence[DeviceSpec], options: PlanOptions) -> list[tuple[Degrees, Plan | AutosplitError]]:
    """Every configuration's plan, in two rounds: first the split DP's plan of each (exact over one
    order, in milliseconds; CP-SAT left out), then — while the search has used less than the options'
    ``time_limit`` — the whole solver for each configuration whose bound leaves room below the best
    step found (beyond the options' gap), most room first: the others cannot win."""
    start = time.perf_counter()
    first = options.replace(limits=dataclasses.replace(options.limits, cpsat_vars=1))
    plain = options.replace(data_parallel=1, replicate="replicate", checkpointing="none", recompute=None, cost_overrides=None,
                            costs="analytic")
    whole, _ = cost_table(traced, tuple(specs[:1]), plain, micro_batches=1)  # the model state, whatever the batch
    tried: dict[Degrees, Plan | AutosplitError] = {}
    for degrees in degrees_to_try(len(specs), traced.batch, options):
        tried[degrees] = _attempt(traced, specs, first, degrees, whole)
    best = min((p.step_time for p in tried.values() if isinstance(p, Plan)), default=math.inf)
    for degrees, p in sorted(tried.items(), key=lambda dp: _bound_of(dp[1])):
        room = isinstance(p, SolverError) or (isinstance(p, Plan) and _bound_of(p) < best * (1 - options.gap))
        if room and time.perf_counter() - start >= options.time_limit:
            log.info("the mesh search used its time_limit of %gs: %s keeps its first round's plan", options.time_limit, degrees)
            continue
        if room and options.limits.cpsat_vars > 1:
            again = _attempt(traced, specs, options, degrees, whole)
            if isinstance(again, Plan) and (not isinstance(p, Plan) or again.step_time < p.step_time):
                tried[degrees] = again
                best = min(best, again.step_time)
    return list(tried.items())


def _bound_of(p: Plan | AutosplitError) -> float:
    """The least step a configuration's splits can reach: its replay's bound; where the solver's
    closed form stands for the replay (one stage per rank, a whole backward), its step less the
    solver's gap; 0 where unknown (no plan, not proven infeasible), ∞ where there is none."""
    if isinstance(p, Plan):
        return p.solver.step_bound if p.solver.step_bound is not None else p.step_time * (1 - p.solver.gap)
    return 0.0 if isinstance(p, SolverError) else math.inf


def _attempt(
    traced: Traced, specs: Sequence[DeviceSpec], options: PlanOptions, degrees: Degrees, whole: CostTable,
) -> Plan | AutosplitError:
    """One configuration's plan — the first rank of each stage's group, ``1/dp`` of the batch — or why there is none."""
    ranks = tuple(specs[s * degrees.data_parallel] for s in range(degrees.pp))
    chosen = options.replace(data_parallel=degrees.data_parallel, replicate=degrees.replicate,
                             # the micro-batches chosen with the degrees unless the user fixed them
                             micro_batches="auto" if options.micro_batches is None else options.micro_batches)
    try:
        # the least state the configuration can hold: one stage may shard unit by unit (FSDP alone)
        row = 0.0 if options.checkpoints else sum(whole.saved_bytes) / (traced.batch or math.inf)
        _state_fits(laid_out(whole, dp_shard=chosen.dp_shard, alone=degrees.pp == 1), ranks, degrees, row)
        share = traced.at_batch(degrees.data_parallel)
        chosen.micro_batches_for(None if chosen.searches else degrees.pp, share.batch)
        return compile_plan(share, ranks, chosen)
    except AutosplitError as e:
        log.info("%s: %s", degrees, e)
        return e


def _state_fits(table: CostTable, ranks: tuple[DeviceSpec, ...], degrees: Degrees, row: float = 0.0) -> None:
    """Refuse, before capturing at the share's batch, a configuration whose model state (``table``'s,
    laid out as the configuration holds it; it does not depend on the batch) and ``row`` bytes of
    activations, spread perfectly over its pp devices, exceed their memory.

    ``row``: one row's saved activations where nothing recomputes — the global batch's over its rows.
    Every stage holds at least one micro-batch of at least one row at its peak, and a tensor's bytes
    grow at most in proportion to the batch (``a · rows + c``, ``c ≥ 0``), so this bounds any share."""
    need, cap = (sum(table.state_bytes) + row) / degrees.pp, sum(d.memory for d in ranks) / degrees.pp
    if need > cap:
        what = "the model state alone needs" if not row else "the model state and one row's saved activations need"
        raise InfeasiblePlanError(advice(
            f"{degrees}: {what} {format_bytes(need)} per device spread perfectly over {degrees.pp} "
            f"(proven), more than the {format_bytes(cap)} each holds",
            "parameters, gradients and optimizer state do not shrink with the batch" + ("" if not row else
            ", and without recomputation every stage holds at least one row's activations"),
            "more pipeline stages, replicate='fully_shard', checkpointing='auto', or a precision that holds less",
        ))


def _none_fits(world: int, tried: Sequence[tuple[Degrees, Plan | AutosplitError]]) -> AutosplitError:
    """No configuration gives a plan: an :class:`InfeasiblePlanError` where each is proven not to fit
    (or cannot run), a :class:`SolverError` where some ended without a plan or a proof."""
    if all(isinstance(e, (InfeasiblePlanError, ConstraintError)) for _, e in tried):
        return InfeasiblePlanError(_none_fits_message(world, tried))
    return SolverError(_none_fits_message(world, tried))


def _none_fits_message(world: int, tried: Sequence[tuple[Degrees, Plan | AutosplitError]]) -> str:
    return advice(
        f"no configuration of the mesh over {world} devices gives a plan",
        "; ".join(f"{d}: {_first_sentence(e)}" for d, e in tried if isinstance(e, AutosplitError)),
        "pin data_parallel= and replicate='fully_shard' to shard the model state, allow checkpointing='auto', "
        "use precision='bf16-mixed', or more devices",
    )


def _first_sentence(error: AutosplitError) -> str:
    return f"{type(error).__name__}: {str(error).split('. ')[0]}"


def _alternatives(tried: Sequence[tuple[Degrees, Plan | AutosplitError]]) -> tuple[Alternative, ...]:
    rows = []
    for d, p in tried:
        shard = d.data_parallel if d.replicate == "fully_shard" else 1
        rows.append(
            Alternative(p.schedule, p.stages_per_rank, p.micro_batches, p.step_time, p.rank_memory or tuple(s.memory for s in p.stages),
                        data_parallel=d.data_parallel, dp_shard=shard, bound=_bound_of(p)) if isinstance(p, Plan)
            else Alternative("", 1, 0, math.inf, note=_first_sentence(p), data_parallel=d.data_parallel, dp_shard=shard)
        )
    return tuple(sorted(rows, key=lambda a: a.step_time))


def _bound(tried: Sequence[tuple[Degrees, Plan | AutosplitError]]) -> float | None:
    """The least step any configuration can reach: each plan's bound; a configuration proven
    infeasible (or that cannot run) reaches none; one that ended unproven leaves it unknown (None)."""
    bounds = [_bound_of(p) for _, p in tried]
    return None if 0.0 in bounds else min(bounds)
