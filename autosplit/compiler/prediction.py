"""The predicted step and the per-stage figures of a plan, from its assignment under a cost table.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence

from autosplit import schedules
from autosplit.costtable import CostTable
from autosplit.devices import DeviceSpec
from autosplit.engine_profiles import engine_of
from autosplit.options import PlanOptions
from autosplit.passes.sharding import data_parallel_time, gathered_share, gradient_share, sharded_alone
from autosplit.plans import SharedParam, StageReport, StepTerms
from autosplit.solver.build import tied_costs
from autosplit.solver.evaluation import evaluate
from autosplit.solver.hybrid import ring_allreduce
from autosplit.solver.problem import KIB, NS, Problem
from autosplit.solver.replay import Replay, StageWork, peaks, replay

__all__ = [
    "backward_passes", "fill_and_drain", "fills", "module_stages", "numbered_layer", "predict_step", "rank_peaks",
    "replayed_step", "sharing_problem", "stage_modules", "stage_reports", "step_bound", "work_bound",
]


def predict_step(
    problem: Problem, table: CostTable, stage_of: Sequence[int], order: Sequence[int], options: PlanOptions
) -> tuple[StepTerms, tuple[SharedParam, ...]]:
    """The step the runtime will take (DESIGN §4.1): the schedule over stage times, plus what runs
    around it — the runtime's per-micro-batch overhead, the optimizer step, tied-parameter
    gradient sync and the exposed data-parallel all-reduce — and how each tied parameter is shared.
    """
    S, M = problem.num_stages, problem.micro_batches
    devices = [table.devices[d] for d in order]
    links = [devices[k - 1].link_to(devices[k]) for k in range(1, S)]
    reads = table.param_reads or ("",) * len(table.nodes)
    consumers = problem.consumers()
    param_bytes = [0.0] * S
    for n, s in enumerate(stage_of):
        param_bytes[s] += table.param_bytes[n] if table.param_bytes else 0
    shared, tied_sync = [], 0.0
    memory = evaluate(problem, stage_of).memory  # KiB per stage
    replicas = [0] * S  # bytes of the tied weights' replicas each stage holds (parameter, gradient, optimizer state)
    for u, read in enumerate(reads):
        holders = sorted({stage_of[u], *(stage_of[v] for v in consumers[u])})
        if not read or len(holders) < 2:
            continue
        nbytes = table.output_bytes[u]
        hops = links[holders[0] : holders[-1]]
        send = sum(tied_costs(nbytes, bw, lat, M)[0] for bw, lat in hops)
        # One all-reduce member per rank: a rank's own copies (a V's two arms) are summed in place.
        members = sorted({problem.rank(s): s for s in holders}.values())
        ring = [devices[a].allreduce_link(devices[b]) for a, b in itertools.pairwise(members)]
        replicate = ring_allreduce(nbytes, len(members), min(bw for bw, _ in ring), max(lat for _, lat in ring)) if ring else 0.0
        # Asynchronous stages update at different times: a replicated copy would drift, so it is sent.
        # A replica also holds the weight's gradient and optimizer state: it must fit beside the stage.
        copies = [s for s in holders if s != stage_of[u]]
        # Under torch's schedules the problem already charges each copy's state where it is read.
        extra = 0 if problem.buffer_mem else table.state_bytes[u]
        fits = all(memory[s] * KIB + replicas[s] + extra <= problem.capacity[s] * KIB for s in copies)
        policy = "replicate" if replicate < send and fits and not schedules.lookup(options.schedule).asynchronous else "send"
        if policy == "replicate" and not problem.buffer_mem:
            for s in copies:
                replicas[s] += table.state_bytes[u]
        if policy == "replicate":
            tied_sync += replicate
            for s in holders[1:]:  # every holder keeps its own copy, and all-reduces its gradient over replicas
                param_bytes[s] += nbytes
        shared.append(SharedParam(read, tuple(holders), policy, send, replicate))
    # The solver's stage times include each stage's optimizer step (build_problem); report it apart.
    sharing = sharing_problem(problem, table, order, shared)
    overheads = [d.microbatch_overhead for d in devices]
    asynchronous = schedules.lookup(options.schedule).asynchronous  # no flush: the steady state, M micro-batches through the slowest stage

    def step(problem: Problem) -> float:
        ev = evaluate(problem, stage_of)
        return max(ev.time) / NS if asynchronous else ev.objective / M / NS

    entry = schedules.lookup(options.schedule)
    if entry.flushes and entry.torch_class is not None:  # torch runs it: replay its action lists
        pipeline, optimizer, overhead = replayed_step(sharing, table, stage_of, order, options.schedule)
    else:
        opt = table.optimizer_time or tuple((0.0,) * len(table.devices) for _ in table.nodes)
        without = tuple(tuple(c - round(o[order[s]] * NS) for s, c in enumerate(row)) for row, o in zip(problem.compute, opt))
        total, pipeline = step(sharing), step(dataclasses.replace(sharing, compute=without))
        overhead = M * max(overheads) if asynchronous else sum(overheads) + (M - 1) * max(overheads)
        optimizer = total - pipeline
    data_parallel = _data_parallel(table, stage_of, order, param_bytes, devices, options, M)
    terms = StepTerms(pipeline, overhead, optimizer, tied_sync, data_parallel)
    return terms, tuple(shared)


def _data_parallel(
    table: CostTable, stage_of: Sequence[int], order: Sequence[int], param_bytes: Sequence[float],
    devices: Sequence[DeviceSpec], options: PlanOptions, M: int,
) -> float:
    """Seconds the data-parallel collectives add to the step (:func:`~autosplit.passes.sharding.data_parallel_time`):
    a stage's all-gather hides while it waits for its first input, its gradients' reduction while
    the stages before it finish their last backward (whole copies: while its own last backward runs,
    DDP's bucketed overlap)."""
    if options.replicas * options.cp <= 1:
        return 0.0
    S = len(devices)
    fwd, bwd = [0.0] * S, [0.0] * S
    for n, s in enumerate(stage_of):
        fwd[s] += table.fwd_time[n][order[s]] / M
        bwd[s] += table.bwd_time[n][order[s]] / M
    entry = schedules.lookup(options.schedule)
    in_line = entry.flushes and entry.placement == "linear" and S == len(set(order))
    waits = list(itertools.accumulate([0.0, *fwd[:-1]])) if in_line else [0.0] * S
    shards = options.dp_shard * options.cp  # FSDP shards over dp_shard × cp, as torchtitan does
    drains = bwd if shards == 1 else list(itertools.accumulate([0.0, *bwd[:-1]])) if in_line else [0.0] * S
    units = [0.0] * S
    engine = engine_of(devices)
    if sharded_alone(S, M, shards, devices) and table.unit_params:
        for n, s in enumerate(stage_of):
            units[s] += table.param_bytes[n] if table.unit_params[n] else 0
    return data_parallel_time(param_bytes, devices, replicas=options.replicas // options.dp_shard, shards=shards, waits=waits,
                              drains=drains,
                              units=units, compute=[M * (f + b) for f, b in zip(fwd, bwd)],
                              gathered=gathered_share(table, devices, options.precision, shards, options.tp),
                              reduced=gradient_share(devices, options.precision),
                              passes=M if engine is not None and engine.units_per_micro_batch else 1)


def sharing_problem(problem: Problem, table: CostTable, order: Sequence[int], shared: Sequence[SharedParam]) -> Problem:
    """``problem`` with each shared parameter's crossings costed as its policy says: nothing when
    replicated (each holder reads its own copy, whose gradient sync is a term of its own, and no
    stage receives it), sent once per micro-batch otherwise."""
    if not shared:
        return problem
    devices = [table.devices[d] for d in order]
    links = [devices[k - 1].link_to(devices[k]) for k in range(1, problem.num_stages)]
    node = {read: u for u, read in enumerate(table.param_reads) if read}
    transfer, recv = [list(row) for row in problem.transfer], [list(row) for row in problem.recv_mem]
    send = [list(row) for row in problem.send_mem]
    buffers = list(problem.buffer_mem)
    for p in shared:
        u = node[p.name]
        for k, (bw, lat) in enumerate(links):
            sent = tied_costs(table.output_bytes[u], bw, lat, problem.micro_batches)[0]
            transfer[u][k] = 0 if p.policy == "replicate" else round(sent * NS)
        if p.policy == "replicate":
            recv[u] = [0] * problem.num_stages
            if send:
                send[u] = [0] * problem.num_stages
            if buffers:
                buffers[u] = 0
    rows = lambda table: tuple(map(tuple, table))  # noqa: E731
    return dataclasses.replace(problem, transfer=rows(transfer), recv_mem=rows(recv), send_mem=rows(send), buffer_mem=tuple(buffers))


def _stage_work(
    problem: Problem, table: CostTable, stage_of: Sequence[int], order: Sequence[int], entry: schedules.Schedule,
    overhead: bool,
) -> tuple[list[StageWork], list[float]]:
    """Per stage, one micro-batch's forward, input-gradient and weight-gradient seconds under
    ``entry``'s schedule (its transfers charged half to the forward, half to the backward, as the
    closed form charges them; with ``overhead``, the runtime's cost per action too: half the
    per-micro-batch overhead on each forward and backward, and on each weight pass where the
    backward is split, which the runtime runs as an action of its own); and per stage the
    optimizer step's seconds."""
    S, M = problem.num_stages, problem.micro_batches
    ev = evaluate(problem, stage_of)
    opt_rows = table.optimizer_time or tuple((0.0,) * len(table.devices) for _ in table.nodes)
    fwd, opt = [0.0] * S, [0.0] * S
    for n, s in enumerate(stage_of):
        d = order[s]
        fwd[s] += table.fwd_time[n][d]
        opt[s] += opt_rows[n][d]
    work = []
    for s, (i, w) in enumerate(backward_passes(table, stage_of, order, entry)):
        action = table.devices[order[s]].microbatch_overhead * M / 2 if overhead else 0.0
        extra = ev.transfer[s] / NS / 2 + action
        work.append(StageWork((fwd[s] + extra) / M, (i + extra) / M, (w + (action if entry.split_backward else 0.0)) / M))
    return work, opt


def backward_passes(
    table: CostTable, stage_of: Sequence[int], order: Sequence[int], entry: schedules.Schedule
) -> list[tuple[float, float]]:
    """[stage] (input pass I, weight pass W) seconds of its backward over the whole batch under
    ``entry``'s schedule: each node's backward divided by its weight share (:attr:`CostTable.wgrad_share`);
    where torch runs the stage's backward whole in W (:meth:`~autosplit.schedules.Schedule.backward_in_weight_pass`),
    all of it there, less what splitting it would cost (:attr:`CostTable.split_cost`)."""
    S = len(order)
    share = table.wgrad_share or (0.0,) * len(table.nodes)
    whole, weight, split = [0.0] * S, [0.0] * S, [0.0] * S
    for n, s in enumerate(stage_of):
        b = table.bwd_time[n][order[s]]
        whole[s] += b
        weight[s] += b * share[n]
        split[s] += table.split_cost[n][order[s]] if table.split_cost else 0.0
    return [(0.0, whole[s] - split[s]) if entry.backward_in_weight_pass(s) else (whole[s] - weight[s], weight[s]) for s in range(S)]


def _replay(problem: Problem, table: CostTable, stage_of: Sequence[int], order: Sequence[int], schedule: str,
            overhead: bool) -> tuple[Replay, list[float]]:
    entry = schedules.lookup(schedule)
    rank_of = [problem.rank(s) for s in range(problem.num_stages)]
    work, opt = _stage_work(problem, table, stage_of, order, entry, overhead)
    actions = entry.actions(problem.ranks, problem.micro_batches, problem.stages_per_rank)
    run = replay(actions, rank_of=rank_of, durations=work)
    return run, [sum(opt[s] for s in range(problem.num_stages) if rank_of[s] == r) for r in range(problem.ranks)]


def replayed_step(
    problem: Problem, table: CostTable, stage_of: Sequence[int], order: Sequence[int], schedule: str
) -> tuple[float, float, float]:
    """(pipeline, optimizer, runtime overhead) seconds of one step, by replaying the schedule's own
    action lists (:mod:`autosplit.solver.replay`): the pipeline is when the last rank ends its last
    backward; each rank then steps its optimizer; the overhead is what the runtime's per-micro-batch
    cost adds to the replay."""
    run, opt = _replay(problem, table, stage_of, order, schedule, overhead=False)
    with_overhead, _ = _replay(problem, table, stage_of, order, schedule, overhead=True)
    total = max(end + o for end, o in zip(run.ends, opt))
    return run.step, total - run.step, with_overhead.step - run.step


def step_bound(table: CostTable, ranks: int, micro_batches: int, schedule: str, stages_per_rank: int) -> float | None:
    """A proven lower bound on the replayed step (:func:`replayed_step`, its three terms summed) of
    every split of ``table``'s nodes under this schedule, ranks, micro-batches and stages per rank;
    None where the solver's own bound covers the step (one stage per rank, whole backward: its
    closed form is the replay) or torch does not run the schedule.

    Each rank runs its stages' actions one after another, so the replay ends no earlier than the
    busiest rank's work, and the optimizer step follows it on that rank: the step is at least the
    work and optimizer steps of all nodes spread evenly over the ranks. Each node is counted at its
    cheapest device; transfers, which any split adds, at nothing; a split backward's cost of
    splitting as if every node were on the first stage, which does not pay it. The runtime's
    overhead per micro-batch and stage (on the cheapest device) does not depend on the split, but
    its replay may hide some of it in the schedule's idle time where the optimizer's does not, so
    it counts in a second bound, without the optimizer's share."""
    if not schedules.lookup(schedule).replayed(stages_per_rank):
        return None
    return work_bound(table, ranks, micro_batches, schedule, stages_per_rank)


def work_bound(table: CostTable, ranks: int, micro_batches: int, schedule: str, stages_per_rank: int) -> float:
    """The bound of :func:`step_bound` for any schedule: no rank finishes its work, nor the optimizer
    step after it, before its share of all of it (every rank runs its actions one after another)."""
    entry = schedules.lookup(schedule)
    split = table.split_cost if table.split_cost and entry.backward_in_weight_pass(0) else None
    work = sum(min(f + b - (split[n][d] if split else 0.0) for d, (f, b) in enumerate(zip(fr, br)))
               for n, (fr, br) in enumerate(zip(table.fwd_time, table.bwd_time)))
    optimizer = sum(min(row) for row in table.optimizer_time) if table.optimizer_time else 0.0
    actions = 1.5 if entry.split_backward else 1.0  # a weight pass is a third action, at half the per-micro-batch overhead
    overhead = actions * stages_per_rank * micro_batches * min(d.microbatch_overhead for d in table.devices)
    fill = fill_and_drain(work, ranks, micro_batches) if fills(schedule, stages_per_rank) else 0.0
    return max((work + optimizer) / ranks, work / ranks + overhead, fill)


def fills(schedule: str, stages_per_rank: int) -> bool:
    """The schedule has a fill and a drain of a whole backward over one stage per rank (GPipe, 1F1B)."""
    entry = schedules.lookup(schedule)
    return stages_per_rank == 1 and not entry.split_backward and entry.flushes and entry.micro_batched


def fill_and_drain(work: float, pp: int, micro_batches: int) -> float:
    """The least step of ``pp`` stages of ``work`` seconds in all (every micro-batch's forward and
    backward), in ``micro_batches``, one stage per rank with a whole backward (:func:`fills`): rank r
    starts only once the first micro-batch's forward has passed the stages before it, and the step ends
    only once the last one's backward has passed them again, so with stage s doing ``w_s`` in all it is
    at least ``max_r (Σ_{s<r} w_s / M + w_r)``; over every split, at least ``work / (M (1 − (1 − 1/M)^pp))``
    (equalising the terms gives it), which tends to ``work / pp`` as ``M`` grows."""
    m = max(1, micro_batches)
    return work / (m * (1 - (1 - 1 / m) ** pp)) if m > 1 else work


def rank_peaks(problem: Problem, schedule: str, reports: Sequence[StageReport]) -> tuple[int, ...]:
    """[rank] peak bytes of its stages together: their state, their pipeline buffers (received
    tensors and gradients, one per micro-batch), one transient reserve, and the activations and sent
    outputs in flight as the schedule's action lists hold them (a split backward keeps a micro-batch's
    until its weight pass, as torch's does); empty for a schedule torch does not run (sequential, asynchronous)."""
    entry = schedules.lookup(schedule)
    if not entry.flushes or entry.torch_class is None:
        return ()
    S, M, R = problem.num_stages, problem.micro_batches, problem.ranks
    per_micro = []
    for s, st in enumerate(reports):
        held = st.memory_activations + st.memory_sent
        per_micro.append(held / max(1, entry.in_flight(s, S, M, R)))
    actions = entry.actions(R, M, problem.stages_per_rank)
    peak = peaks(actions, saved=per_micro, weight_held=per_micro)
    out = list(peak)
    reserve = [0] * len(out)
    for s, st in enumerate(reports):  # what a stage holds all step: its state and its pipeline buffers
        out[problem.rank(s)] += st.memory_state + st.memory_received + st.memory_buffers
        reserve[problem.rank(s)] = max(reserve[problem.rank(s)], st.memory_transient)
    out = [o + r for o, r in zip(out, reserve)]
    return tuple(int(b) for b in out)


def stage_reports(
    problem: Problem, table: CostTable, stage_of: Sequence[int], order: Sequence[int], shared: Sequence[SharedParam] = (),
    schedule: str = "gpipe",
) -> tuple[StageReport, ...]:
    """Each stage's predicted figures; a stage holding a replica of a tied weight (``shared``) also
    holds its gradient and optimizer state, and sends it nowhere. The blocks the table recomputes
    are named on their stage, with the activations they save at its peak (``schedule``'s in-flight
    micro-batches)."""
    ev = evaluate(sharing_problem(problem, table, order, shared), stage_of)
    replicas = [0] * len(order)
    owner = {read: u for u, read in enumerate(table.param_reads) if read}
    # Each stage's own transient reserve: the most one of its ops (or its optimizer step, over a tied
    # weight's replica too) needs above what is live. The solver keeps the graph's largest on every
    # stage, a bound; the report gives each stage its own.
    transient = [0] * len(order)
    for n, s in enumerate(stage_of):
        transient[s] = max(transient[s], table.peaks[n] if table.peaks else ev.transient_mem * KIB)
    for p in shared:
        if p.policy == "replicate" and p.name in owner:
            for s in p.stages:
                if s != stage_of[owner[p.name]]:
                    replicas[s] += table.state_bytes[owner[p.name]]
                    if table.peaks:
                        transient[s] = max(transient[s], table.peaks[owner[p.name]])
    reports = []
    entry, M, S = schedules.lookup(schedule), problem.micro_batches, problem.num_stages
    recomputed = [(label, table.blocks.index(label)) for label in table.recomputed]
    kept = {label: k / w for label, (k, w) in zip(table.recomputed, table.recompute_kept)}  # share of its micro-batches a block keeps
    # The buffers a sender keeps for gradients coming back (the receiver's, twice its received bytes, are all of them).
    sent_buffers = [b - r for b, r in zip(ev.buffer_mem, ev.recv_mem)] if problem.buffer_mem else [0] * len(order)
    backward = backward_passes(table, stage_of, order, entry)
    for s, device in enumerate(table.devices[d] for d in order):
        members = [n for n, st in enumerate(stage_of) if st == s]
        mine = [(label, b) for label, b in recomputed if stage_of[table.block_members[b][0]] == s]
        in_flight = entry.in_flight(s, S, M, problem.ranks) / M
        sparse, rows = table.row_sparse(members)
        i, w = backward[s]
        unsplit = sum(table.bwd_time[n][order[s]] for n in members) - i - w  # what a whole backward saves (the first stage)
        reports.append(
            StageReport(
                device=device.torch_device or device.name,
                nodes=len(members),
                params=sum(table.param_counts[n] for n in members),
                modules=stage_modules(table, members),
                compute=ev.compute[s] / NS - unsplit,
                forward=sum(table.fwd_time[n][order[s]] for n in members),
                backward=i + w,
                backward_weight=w,
                param_bytes=sum(table.param_bytes[n] for n in members) if table.param_bytes else 0,
                sparse_param_bytes=sparse,
                row_grad_bytes=rows,
                transfer=ev.transfer[s] / NS,
                time=ev.time[s] / NS - unsplit,
                memory_state=ev.state_mem[s] * KIB + replicas[s],
                memory_activations=ev.act_mem[s] * KIB,
                memory_received=ev.recv_mem[s] * KIB,
                memory_sent=(ev.send_mem[s] - sent_buffers[s]) * KIB,
                memory_buffers=sent_buffers[s] * KIB,
                memory_transient=min(transient[s], ev.transient_mem * KIB),
                capacity=device.memory,
                recompute=tuple(label for label, _ in mine),
                recompute_saves=round(sum(table.block_saves[b] * (1 - kept.get(label, 0.0)) for label, b in mine) * in_flight),
            )
        )
    return tuple(reports)


_ARTEFACT = re.compile(r"(^|\.)(_guards_fn|submod_\d+)(\.|$)")
"""Modules torch.export adds (its shape guards, higher-order ops' bodies): not the user's."""


def numbered_layer(path: str) -> str | None:
    """The repeated layer a module ``path`` is in: the path down to its first numbered part
    (``model.layers.3``), or None outside every numbered layer."""
    parts = path.split(".")
    numbered = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return None if numbered is None else ".".join(parts[: numbered + 1])


def _unit(path: str) -> str:
    """The module a report names for ``path``: its numbered layer (:func:`numbered_layer`), else two levels."""
    return numbered_layer(path) or ".".join(path.split(".")[:2]) or "(root)"


def _ranges(names: Sequence[str]) -> list[str]:
    """Runs of consecutive numbered layers as one name: ``model.layers.0–4``."""
    out: list[tuple[str, int, int] | str] = []
    for name in names:
        prefix, _, last = name.rpartition(".")
        run = out[-1] if out else None
        if last.isdigit() and isinstance(run, tuple) and run[0] == prefix and run[2] + 1 == int(last):
            out[-1] = (prefix, run[1], int(last))
        else:
            out.append((prefix, int(last), int(last)) if last.isdigit() and prefix else name)
    return [r if isinstance(r, str) else f"{r[0]}.{r[1]}" + (f"–{r[2]}" if r[2] > r[1] else "") for r in out]


def stage_modules(table: CostTable, members: Sequence[int]) -> tuple[str, ...]:
    """A stage named by the modules whose parameters it holds (numbered layers as ranges): the FQN
    lists of manual splits, in short."""
    owners = [n for n in members if table.param_counts[n]] or members
    names = [u for u in dict.fromkeys(_unit(table.module_paths[n]) for n in owners) if not _ARTEFACT.search(u)]
    return tuple(_ranges(names)) or ("(root)",)


def module_stages(table: CostTable, stage_of: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Every module path, at every level (in the order the graph first runs it), and the stages its nodes run on."""
    stages: dict[str, set[int]] = {}
    for path, s in zip(table.module_paths, stage_of):
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            stages.setdefault(".".join(parts[:depth]), set()).add(s)
    return {path: tuple(sorted(found)) for path, found in stages.items()}
