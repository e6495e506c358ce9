"""Build: a cost table scaled into the solver's :class:`~autosplit.solver.problem.Problem`.

Time in integer nanoseconds and memory in integer KiB (rounded up), for one order of the
devices over the stages: each node's compute on each stage's device (the optimizer step
charged with it), each value's transfer over each boundary (per tensor latency, the cheaper of
sending or replicating a tied weight), what each stage holds at the schedule's in-flight count
(:func:`in_flight`; PipeDream's and XPipe's weight copies, :func:`weight_copies`; torch's
pipeline buffers, :func:`pipeline_buffers`), the user's constraints in stage terms, and the
blocks the solver may recompute.

Usage::

    problem = build_problem(table, micro_batches=4, schedule="1f1b", order=(0, 1, 2, 3))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from autosplit import schedules
from autosplit.engine_profiles import engine_of
from autosplit.solver.asynchronous import simulate, stashed_versions
from autosplit.solver.problem import KIB, NS, Arrays, Problem, Recompute, UserConstraint, int_rows

__all__ = ["build_problem", "in_flight", "pipeline_buffers", "tied_costs", "weight_copies"]


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at its peak (GPipe: all; 1F1B:
    S − s, at most M; asynchronous: S − s, from the next mini-batch too): the schedule's own rule
    (:meth:`autosplit.schedules.Schedule.in_flight`)."""
    return schedules.lookup(schedule).in_flight(stage, stages, micro_batches)


def weight_copies(schedule: str, stages: int, micro_batches: int) -> tuple[int, ...]:
    """Copies of its weights each stage keeps beside them: PipeDream's stashed versions still in
    flight, XPipe's weights kept aside while a forward runs on predicted ones (both read off one
    simulation of the schedule, long enough to reach its steady state); none otherwise."""
    weights = schedules.lookup(schedule).weights
    if weights == "current":
        return (0,) * stages
    sim = simulate(stages=stages, micro_batches=micro_batches, mini_batches=math.ceil(stages / micro_batches) + 2,
                   forward=[1.0] * stages, backward=[2.0] * stages)
    if weights == "stashed":
        return tuple(stashed_versions(sim, s) - 1 for s in range(stages))
    return tuple(int(any(sim.differences(s))) for s in range(stages))



def tied_costs(nbytes: float, bandwidth: float, latency: float, micro_batches: int) -> tuple[float, float]:
    """Seconds per step to share a parameter of ``nbytes`` between two stages across one link:
    (send it with every micro-batch and its gradient back, replicate it and all-reduce its gradient once)."""
    send = 2 * micro_batches * (latency + nbytes / bandwidth)
    replicate = nbytes / bandwidth + 2 * latency
    return send, replicate


def _array(rows: Sequence[Sequence[float]], n: int) -> np.ndarray:
    """``rows`` as an (n, width) array; a row object that repeats (the cost table shares equal
    rows) is converted once."""
    unique: dict[int, Sequence[float]] = {}  # id → row (``rows`` keeps every row alive)
    for r in rows:
        unique.setdefault(id(r), r)
    place = {key: i for i, key in enumerate(unique)}
    table = np.asarray(list(unique.values()), dtype=np.float64).reshape(len(unique), -1)
    return table[[place[id(r)] for r in rows]].reshape(n, -1)


def _kib(nbytes: float) -> int:
    """Bytes in KiB, rounded up (a plan that fits in KiB fits in bytes)."""
    return math.ceil(nbytes / KIB)


def _compute_ns(table: Any, columns: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """[node, stage] the forward's seconds and the whole compute's ns on each stage's device (``columns``:
    the device of each stage).

    The optimizer steps each stage's parameters once per step, after its last backward; charged
    with the stage's compute, the schedule formula counts it about once (for S ≪ M), and the
    solver balances it with the rest.
    """
    # Vectorised (numpy), with the scalar formulas' order of operations, so values match them exactly.
    N = len(table.nodes)
    opt = table.optimizer_time or ((0.0,) * len(table.devices),) * N
    fwd = _array(table.fwd_time, N)[:, columns]
    seconds = np.add(np.add(fwd, _array(table.bwd_time, N)[:, columns]), _array(opt, N)[:, columns])
    return fwd, np.rint(seconds * NS).astype(np.int64)


def _transfer_ns(table: Any, devices: Sequence[Any], micro_batches: int, schedule: str, fwd: np.ndarray) -> np.ndarray:
    """[node, k − 1] ns to move each node's output over boundary k (stages k−1 and k) and its gradient back.

    Each micro-batch sends every crossing tensor forward and its gradient back:
    2·(M·latency + bytes/bandwidth) for a tensor of the whole batch's bytes, the latency once per
    tensor of the value (none for a Python value: it crosses as a constant). A parameter read on a
    later stage (a tied weight) has the same bytes in every micro-batch: sent, it costs
    2·M·(latency + bytes/bandwidth); replicated, one all-reduce of its gradient per step (two
    holders, ring: bytes/bandwidth + 2·latency) — the cheaper is charged, and the runtime makes the
    same choice (tied_policy). Asynchronous stages cannot replicate: they send.
    """
    M, N = micro_batches, len(table.nodes)
    links = [devices[k - 1].link_to(devices[k]) for k in range(1, len(devices))]
    reads = table.param_reads or ("",) * len(table.nodes)
    tensors = table.output_tensors or (1,) * len(table.nodes)
    nbytes, counts = np.asarray(table.output_bytes, dtype=np.float64), np.asarray(tensors, dtype=np.float64)
    sent = np.empty((N, len(links)))
    for k, (bw, lat) in enumerate(links):
        sent[:, k] = np.rint(2 * (M * lat * counts + nbytes / bw) * NS)
    asynchronous = schedules.lookup(schedule).asynchronous
    shared = (lambda costs: costs[0]) if asynchronous else min
    for n in (n for n, read in enumerate(reads) if read):
        sent[n] = [round(shared(tied_costs(table.output_bytes[n], bw, lat, M)) * NS) for bw, lat in links]
    for n, made in _made_again(table, fwd).items():  # an input-free value: stage k makes it instead
        sent[n] = np.rint(made[1:] * NS)
    return sent


def _made_again(table: Any, fwd: np.ndarray) -> dict[int, np.ndarray]:
    """[input-free node] [stage] forward seconds of the node and every node it is made from
    (:mod:`autosplit.passes.input_free`): what a stage pays to make the value itself, once per
    micro-batch, in place of receiving it — charged at each boundary it would have crossed, as a
    received value is, so a stage that only relays it pays too (a bound: torch's stage makes it
    only where it is read)."""
    free = table.input_free or ()
    made_from: dict[int, set[int]] = {n: {n} for n, is_free in enumerate(free) if is_free}
    for u, v in sorted(table.edges):  # by producer: what a node is made from is complete before it is read
        if v in made_from and u in made_from:
            made_from[v] |= made_from[u]
    return {n: fwd[sorted(members)].sum(axis=0) for n, members in made_from.items()}


def _held_kib(
    table: Any, schedule: str, stages: int, micro_batches: int, ranks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """[node, stage] KiB each stage holds at its peak: (saved activations at the schedule's in-flight
    count, with the weight copies the schedule keeps; received outputs; outputs it sends on, None
    when the table records none; [node] the pipeline buffers among the last two, see
    :func:`pipeline_buffers`)."""
    S, M = stages, micro_batches
    entry = schedules.lookup(schedule)
    in_flight_share = np.asarray([entry.in_flight(s, S, M, ranks) for s in range(S)], dtype=np.float64)

    def per_stage(values: Sequence[int]) -> np.ndarray:  # kib(b · inflight[s] / M)
        return np.ceil(np.asarray(values, dtype=np.float64)[:, None] * in_flight_share[None, :] / M / KIB).astype(np.int64)

    saved = table.saved_bytes
    if entry.split_backward and table.wgrad_bytes:  # gradients kept from the input pass (I) to the weight pass (W)
        saved = [a + b for a, b in zip(saved, table.wgrad_bytes)]
    act = per_stage(saved)
    copies = np.asarray(weight_copies(schedule, S, M), dtype=np.int64)
    if copies.any() and table.param_bytes:  # weight copies a schedule keeps: held with the activations
        act += np.ceil(np.asarray(table.param_bytes, dtype=np.float64) / KIB).astype(np.int64)[:, None] * copies[None, :]
    send = per_stage(table.sent_bytes) if table.sent_bytes else None
    buffers = pipeline_buffers(table, schedule, M)
    if buffers is None:  # a runtime of its own: what it receives is held while in flight
        recv = per_stage(table.output_bytes)
        engine = engine_of(table.devices)
        if engine is not None and engine.frees_sent_outputs and table.sent_bytes:
            # Megatron's sender frees what it sent: a tensor a later node saves, charged to its producer (sent_bytes 0),
            # is held once, there, not again as received
            recv[np.asarray([sent == 0 and out > 0 for sent, out in zip(table.sent_bytes, table.output_bytes)])] = 0
    else:
        recv = np.repeat(2 * buffers[:, None], S, axis=1)
        send = np.repeat(buffers[:, None], S, axis=1) + (send if send is not None else 0)
        for n, read in enumerate(table.param_reads or ()):
            if read:  # a tied weight read on a later stage is replicated there (see _transfer_ns): its copy's state
                recv[n], send[n] = _kib(table.state_bytes[n]), 0
    for n, is_free in enumerate(table.input_free or ()):
        if is_free:  # made by the stage that reads it: its own copy, held as its maker's stage holds it; nothing sent
            recv[n] = act[n]
            if send is not None:
                send[n] = 0
    return act, recv, send, buffers


def pipeline_buffers(table: Any, schedule: str, micro_batches: int) -> np.ndarray | None:
    """[node] KiB torch's pipeline stages hold for the node's output if it crosses a boundary: one
    buffer per micro-batch (``PipelineStage`` makes them once, for every micro-batch of the step),
    so the whole batch's bytes; none for an input-free value (each reader makes its own), nor for a
    parameter read on a later stage (a tied weight: a replica there holds its state instead). None
    for schedules torch does not run, and for an engine whose pipeline allocates a buffer per send (Megatron's,
    :attr:`~autosplit.engine_profiles.EngineProfile.buffers_in_flight`): their runtime holds what is in flight only."""
    entry = schedules.lookup(schedule)
    engine = engine_of(table.devices)
    if not entry.flushes or entry.torch_class is None or (engine is not None and engine.buffers_in_flight):
        return None
    reads = table.param_reads or ("",) * len(table.output_bytes)
    free = table.input_free or (False,) * len(table.output_bytes)
    whole = [0 if read or is_free else b for b, read, is_free in zip(table.output_bytes, reads, free)]
    return np.ceil(np.asarray(whole, dtype=np.float64) / KIB).astype(np.int64)


def _first_stage_only(table: Any, schedule: str, stages: int) -> tuple[UserConstraint, ...]:
    """A split backward (zero bubble) computes a stage's weight gradients from what its input pass
    reached; torch's stages past the first reach no parameter whose inputs need no gradient (an
    embedding of token ids), and would leave its gradient None. Such nodes stay on stage 0, which
    torch runs as one whole backward."""
    if not schedules.lookup(schedule).split_backward or not table.wgrad_share or stages < 2:
        return ()
    only = [n for n, share in enumerate(table.wgrad_share) if share >= 1.0 and table.param_counts[n] + _read_param(table, n)]
    return tuple(
        UserConstraint(f"'{table.module_paths[n] or table.nodes[n]}' (node {table.nodes[n]}) has only a weight gradient "
                       f"(its inputs need none), which {schedule}'s split backward computes on stage 0 only",
                       tuple((n, s) for s in range(1, stages)))
        for n in only
    )


def _read_param(table: Any, n: int) -> int:
    """Whether node ``n`` reads a parameter through an attribute node (its weight is not its own)."""
    reads = table.param_reads or ()
    return int(any(reads[u] for u, v in table.edges if v == n))


def _rerun(table: Any, fwd: np.ndarray, columns: list[int]) -> np.ndarray:
    """[node, stage] seconds a node runs again when its block recomputes: the table's ``rerun_time``, else
    its forward (none for a selective checkpoint's kept matmuls and attention)."""
    if table.rerun_time:
        return _array(table.rerun_time, len(table.nodes))[:, columns]
    rerun = fwd.copy()
    rerun[list(table.recompute_keeps)] = 0.0
    return rerun


def _recompute(
    table: Any, offered: Mapping[str, bool | None], rerun: np.ndarray, schedule: str, stages: int, micro_batches: int, ranks: int,
    transient: int = 0,
) -> tuple[Recompute, ...]:
    """The table's blocks that ``offered`` names, as the solver's :class:`Recompute` choices (``rerun``:
    [node, stage] seconds each node runs again when its block recomputes). A block's
    reserve is what a recomputing node peaks at beyond ``transient`` (KiB, the graph's largest, which
    every stage keeps room for already): as the cost table charges it
    (:func:`~autosplit.passes.costs.estimate`), its own transient before the FSDP layout
    (:attr:`~autosplit.costtable.CostTable.block_transient`) with the block's activations of one
    micro-batch again, or what the layout's unit gathers hold, whichever is more."""
    entry = schedules.lookup(schedule)
    in_flight = [entry.in_flight(s, stages, micro_batches, ranks) for s in range(stages)]
    share = np.asarray(in_flight, dtype=np.float64) / micro_batches
    # torch's stages tell the generated code each forward's micro-batch (runtime.stage), in order per stage
    windows = tuple(in_flight) if entry.flushes and entry.torch_class is not None else ()
    out = []
    inside = {i for label in offered for i in table.block_members[table.blocks.index(label)]}
    # what a block's node holds at its peak as laid out (FSDP's unit gathers too), and before the layout
    peaks = table.peaks
    laid = max((peaks[i] for i in inside), default=0) if peaks else 0
    own = table.block_transient if table.block_transient else laid
    for label, forced in offered.items():
        b = table.blocks.index(label)
        members = table.block_members[b]
        # room for the inputs it shares with blocks that may not recompute (its saves charge 1/k of them)
        shared = _kib(table.block_shared[b] * max(share, default=0.0)) if table.block_shared else 0
        out.append(Recompute(
            label, members, tuple(np.rint(rerun[list(members)].sum(axis=0) * NS).astype(np.int64).tolist()),
            tuple(int(x) for x in np.floor(table.block_saves[b] * share / KIB)),
            max(0, _kib(max(table.block_activations[b] / micro_batches + own, laid)) - transient), forced, windows, shared,
        ))
    return tuple(out)


def build_problem(
    table,
    *,
    micro_batches: int = 1,
    schedule: str = "gpipe",
    order: Sequence[int] | None = None,
    constraints: Sequence[UserConstraint] = (),
    rank_of: Sequence[int] = (),
    recompute: Mapping[str, bool | None] | None = None,
) -> Problem:
    """Scale a cost table (``passes.costs.CostTable``) into integer units for one device order.

    Stage ``s`` runs on device ``order[s]`` (identity by default); with several stages per rank,
    on rank ``rank_of[s]`` (a rank's stages name its device in ``order``). ``constraints`` name
    *devices* in their ``forbid`` pairs; they are turned into stages here. ``recompute``: the table's
    blocks the solver may recompute, by label, each with the user's decision (True, False) or None.
    """
    order = tuple(range(len(table.devices))) if order is None else tuple(order)
    devices = [table.devices[d] for d in order]
    stages_of_device: dict[int, list[int]] = {}
    for s, d in enumerate(order):
        stages_of_device.setdefault(d, []).append(s)
    N, S, M = len(table.nodes), len(devices), micro_batches
    fwd, compute = _compute_ns(table, list(order))
    sent = _transfer_ns(table, devices, M, schedule, fwd)
    act, recv, send, buffers = _held_kib(table, schedule, S, M, max(rank_of) + 1 if rank_of else S)
    for k in range(1, S if rank_of else 0):  # two stages of one rank pass their tensors in memory
        if rank_of[k - 1] == rank_of[k]:
            sent[:, k - 1] = 0
    state = tuple(_kib(b) for b in table.state_bytes)
    transient = _kib(max(table.peaks, default=0)) if table.peaks else _kib(max(table.output_bytes, default=0) / M)
    problem = Problem(
        nodes=table.nodes,
        labels=table.module_paths,
        devices=tuple(d.torch_device or d.name for d in devices),
        compute=int_rows(compute),
        edges=table.edges,
        order_edges=table.order_edges,
        transfer=int_rows(sent),
        boundary_latency=(0,) * sent.shape[1],  # latency is paid per tensor, in ``sent``
        state_mem=state,
        act_mem=int_rows(act),
        recv_mem=int_rows(recv),
        send_mem=int_rows(send) if send is not None else (),
        forward=int_rows(np.minimum(np.rint(fwd * NS).astype(np.int64), compute)),
        capacity=tuple(d.memory // KIB for d in devices),
        colocate=table.colocate,
        micro_batches=M,
        transient_mem=transient,
        constraints=tuple(
            UserConstraint(c.text, tuple((n, s) for n, d in c.forbid for s in stages_of_device.get(d, ())), c.together)
            for c in constraints
        ) + _first_stage_only(table, schedule, S),
        rank_of=tuple(rank_of),
        peaks=schedules.lookup(schedule).peak_counts(S, M, max(rank_of) + 1) if rank_of else (),
        recompute=_recompute(table, recompute or {}, _rerun(table, fwd, list(order)), schedule, S, M, max(rank_of) + 1 if rank_of else S,
                             transient),
        buffer_mem=tuple(buffers.tolist()) if buffers is not None else (),
        steady=schedules.lookup(schedule).asynchronous,
    )
    # The arrays the solver reads are at hand: cache them rather than convert the tuples back.
    edges = np.asarray(table.edges, dtype=np.int64).reshape(-1, 2)
    problem.__dict__["arrays"] = Arrays(
        compute=compute, transfer=sent.astype(np.int64), state=np.asarray(state, dtype=np.int64), act=act, recv=recv,
        send=send if send is not None else np.zeros((N, S), dtype=np.int64), producer=edges[:, 0], consumer=edges[:, 1],
    )
    return problem
