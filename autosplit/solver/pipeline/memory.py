r"""Memory floors of the pipeline objective: the least any plan puts on its fullest device (DESIGN §4.2).

- :func:`memory_floor` — state and activations spread perfectly over the ranks, and no less than
  the largest unit that cannot be split;
- :func:`memory_chain_floor` — along the chain of most memory (:func:`~autosplit.solver.pipeline.chain.heaviest_chain`):
  its nodes fall into S consecutive, possibly empty, segments in stage order, so a bottleneck
  dynamic program over chain positions bounds the fullest stage, knowing that layers do not split
  and that a 1F1B stage s holds ``min(M, S − s)`` micro-batches' activations;
- :func:`memory_proof` — the chain floor, and where it stays under the cap, the largest cap no split
  of the chain meets once stages 0…s are also made to hold, together, everything that must lie
  before stage s ends (:func:`fits_under`): a proof that no plan fits, with its number.

Usage::

    floor = memory_proof(problem)      # KiB; above max(problem.capacity): no plan fits
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from autosplit.solver.pipeline.chain import chain_reach, heaviest_chain
from autosplit.solver.problem import Problem

__all__ = ["along_chain", "fits_under", "memory_chain_floor", "memory_floor", "memory_floors", "memory_proof", "memory_units"]

CHAIN_UPPER = 1.25
"""How far past the largest cap :func:`memory_floors` looks along the chain (its figure is then at least this)."""
PROOF_STEPS = 6
"""Bisection steps :func:`memory_proof` spends on the number it reports, once it has proven the cap."""
CHUNK = 1 << 16
"""Entries of a band computed at once (a few rows of ends): the block and its temporaries stay in cache."""


def memory_units(problem: Problem) -> list[tuple[tuple[int, ...], int]]:
    """Each unit that cannot be split (a colocated group, or a lone node) with the KiB it needs
    on any device: its state, its least activations, and the transient reserve."""
    need = [problem.state_mem[n] + min(problem.act_mem[n]) for n in range(len(problem.nodes))]
    groups = [*problem.colocate, *((n,) for n in range(len(problem.nodes)))]
    return [(tuple(g), problem.transient_mem + sum(need[n] for n in g)) for g in groups]


def memory_floor(problem: Problem) -> int:
    """KiB that any plan puts on its fullest device, at least: perfect spreading of state and
    activations (each node's least over the stages, a rank's stages' at the share of them its peak holds
    at least, :attr:`~autosplit.solver.problem.Problem.least_held`), and no less than the largest unit that cannot be split."""
    act = problem.arrays.act
    least = np.floor(act * np.asarray(problem.least_held)[None, :]).min(axis=1) if act.size else np.zeros(len(problem.nodes))
    total = sum(problem.state_mem) + int(least.sum())
    largest_unit = max(need for _, need in memory_units(problem))
    return max(problem.transient_mem + math.ceil(total / problem.ranks), largest_unit)  # a rank holds all its stages


@dataclass(frozen=True)
class _Along:
    """What the chain of most memory says every plan holds, as arrays over positions 0..L and stages."""

    chain: np.ndarray
    """[p, s] chain nodes h_1..h_p with their colocated groups, held on stage s."""
    read: np.ndarray
    """[p, s] … and what the units read by h_1..h_p that may lie anywhere before them leave there at least."""
    F: np.ndarray
    G: np.ndarray
    """[p, s] units pinned between two chain nodes: F(b) − G(a) of them lie inside (a, b] at least
    (reader arrays (0, 1): ``read`` for readers off the chain; 2, 3: the units alone)."""
    first: np.ndarray
    """[b, s] the least the fullest of stages 0…s holds when stage s ends at chain position b (averaged)."""
    last: np.ndarray
    """[a, s] the least the fullest of stages s…S−1 holds when stage s starts after position a."""
    early: np.ndarray
    """[b, s] off-chain units free before the chain that must come no later than h_b, each at its
    least over stages 0…s (the pinned ones count in the segment that holds them)."""
    loose: np.ndarray
    """[b] free units that need not come before h_b and whose first reader need not come after it
    (at their most over stages): they may lie before a stage that ends at b without crossing its boundary."""
    ratio: float
    """The least share of a free unit's memory that a stage receiving its output holds (received ÷ held)."""
    crossing: np.ndarray
    """[2, p, s] what a stage holds of the tensors that must cross a boundary at chain position p:
    received ([0], the stage after it) and held to send ([1], the stage before it)."""

    def segments(self, s: int, room: float, own: bool = False) -> tuple[int, Iterator[tuple[slice, np.ndarray, np.ndarray | None]]]:
        """Stage s's chain segments (a, b] that may hold at most ``room``: the band's width W, and by rows of ends b
        (``rows``), [b, j] the least stage s holds with start a = b − j (∞ past ``room`` or before position 0)
        and, with ``own``, the share of it that stage s's chain nodes (with the units pinned among them) hold. A band:
        past ``room`` of chain memory, no earlier start can do. The terms of a are read through sliding windows, and
        the rows come a few at a time so that each block of the band stays in cache: at 235B the chain is 4,600 nodes
        long and the band as wide (:func:`windows` gives a caller's own terms of a in the same form)."""
        L, S = len(self.chain) - 1, self.chain.shape[1]
        ends = np.arange(L + 1)
        column = self.chain[:, s]
        lo = np.searchsorted(column, column - room, side="left") if math.isfinite(room) else np.zeros(L + 1, dtype=int)
        width = int((ends - lo).max()) + 1
        last_j = ends - np.maximum(lo, 0)  # [b] the most j whose start a is in the band
        read, received = self.read[:, s], (windows(self.crossing[0][:, s], width) if s > 0 else None)
        read_a, G_a, last_a = windows(read, width), windows(self.G[0][:, s], width), windows(self.last[:, s], width)
        own_a = (windows(column, width), windows(self.G[1][:, s], width)) if own else None
        j, step = np.arange(width), max(1, CHUNK // width)

        def rows() -> Iterator[tuple[slice, np.ndarray, np.ndarray | None]]:
            for b0 in range(0, L + 1, step):
                b = slice(b0, min(L + 1, b0 + step))
                held = read[b, None] - read_a[b] + np.maximum(0.0, self.F[0][b, s, None] - G_a[b])
                if received is not None:  # what crosses in at its start and out at its end, summed in the order of the [b, s] form
                    held = held + received[b]
                if s < S - 1:
                    held = held + self.crossing[1][b, s, None]
                held = np.maximum(held, np.maximum(self.first[b, s, None], last_a[b]))
                held = np.where((j <= last_j[b, None]) & (held <= room), held, np.inf)
                mine = None if own_a is None else column[b, None] - own_a[0][b] + np.maximum(0.0, self.F[1][b, s, None] - own_a[1][b])
                yield b, held, mine

        return width, rows()


def windows(values: np.ndarray, width: int, fill: float = 0.0, nearest: int = 0) -> np.ndarray:
    """[b, j] = ``values[b − nearest − j]`` for j < ``width`` (``fill`` before position 0), a view: a term of a
    segment's start a = b − nearest − j at each end b, without gathering it (a band's terms of its starts)."""
    padded = np.concatenate([np.full(width - 1 + nearest, fill), values])
    return sliding_window_view(padded, width)[: len(values), ::-1]


def along_chain(problem: Problem, chain: list[int] | None = None) -> _Along:
    """What every plan holds along ``chain`` (by default the chain of most memory), as arrays over chain positions."""
    S = problem.num_stages
    mem = np.asarray(problem.state_mem, dtype=np.float64)[:, None] + np.asarray(problem.act_mem, dtype=np.float64)  # [n, s]
    chain = heaviest_chain(problem, mem.min(axis=1).tolist()) if chain is None else chain
    L = len(chain)
    before, after = chain_reach(problem, chain)
    on_chain, read, pinned, free_units, late = _memory_along(problem, chain, mem, before, after)
    early, free, loose, ratio = free_units
    F, G = (np.cumsum(pinned[0], axis=1)[:, : L + 1], np.cumsum(pinned[1], axis=1)[:, : L + 1])
    stages = np.arange(1, S + 1, dtype=np.float64)
    low_before = np.minimum.accumulate(np.vstack([on_chain, early]), axis=1)  # each row's least over stages 0…s
    low_after = np.minimum.accumulate(np.vstack([on_chain, late])[:, ::-1], axis=1)[:, ::-1]  # … over stages s…S−1
    units_before = np.cumsum(low_before[L:], axis=0)[: L + 1]
    held = np.vstack([np.zeros((1, S)), np.cumsum(low_before[:L], axis=0)]) + units_before
    rest = np.vstack([np.cumsum(low_after[:L][::-1], axis=0)[::-1], np.zeros((1, S))])  # chain positions after a
    rest += np.cumsum(low_after[L:][::-1], axis=0)[::-1][1: L + 2]  # units that must follow a position after a
    zero = np.zeros((1, S))
    free = np.minimum.accumulate(free, axis=1).cumsum(axis=0)[: L + 1]
    return _Along(np.vstack([zero, np.cumsum(on_chain, axis=0)]), np.vstack([zero, np.cumsum(on_chain + read, axis=0)]),
                  F, G, held / stages, rest / stages[::-1], free, np.cumsum(loose)[: L + 1], ratio,
                  _crossing(problem, L, before, after))


def _crossing(problem: Problem, L: int, before: list[int], after: list[int]) -> np.ndarray:
    """[2, p, s] received and sent memory of the tensors that cross every boundary at chain position p:
    u's output, made no later than h_before[u], read no earlier than h_last[u], crosses p for
    before[u] ≤ p < last[u] (relayed through every stage between)."""
    change = np.zeros((2, L + 2, problem.num_stages))
    arrays = problem.arrays
    for u, readers in enumerate(problem.consumers()):
        last = max((after[v] for v in readers), default=0)
        if before[u] < last:
            for k, table in enumerate((arrays.recv, arrays.send)):
                change[k, before[u]] += table[u]
                change[k, last] -= table[u]
    return np.cumsum(change, axis=1)[:, : L + 1]


def memory_chain_floor(problem: Problem, upper: float | None = None, along: _Along | None = None) -> int:
    """KiB that any plan puts on its fullest device, at least, seen along the chain of most memory.

    As for :func:`~autosplit.solver.pipeline.bounds.chain_bound`: the chain's nodes fall into S
    consecutive segments in stage order, and off-chain units pinned between two chain nodes lie in
    the segments between. So stage s holds at least its segment's state and activations (at stage
    s's in-flight count) plus the pinned units, plus the transient reserve; the least over splits of
    the fullest stage is a bottleneck DP. Unlike :func:`memory_floor` it knows that layers do not split.

    Units, not nodes: a colocated group (a parameter read through ``get_attr`` and its first reader)
    sits in one stage, so a group that meets the chain adds its other members to its chain node's
    stage. A unit that need not follow any chain node (a mixture of experts' weights, transposed
    before the layer reads them) may sit in any stage up to its reader's: that stage holds it, or
    receives its output (the least of the two counts there). Stages 0…s hold all of it when stage s
    ends at chain position b past its reader, so their fullest holds at least a (s + 1)-th of
    everything that must lie before b (each unit at its least over those stages); the same from the end.
    ``upper``: KiB past which a stage is not looked at (the answer is then at most ``upper``, and the
    dynamic program a band); by default twice the largest cap. ``along``: :func:`along_chain`'s, when the caller has it.
    """
    upper = 2 * max(problem.capacity) if upper is None else upper
    along = along or along_chain(problem)
    L = len(along.chain) - 1
    val = np.where(np.arange(L + 1) == 0, 0.0, np.inf)
    for s in range(problem.num_stages):
        width, rows = along.segments(s, upper - problem.transient_mem)
        before, val = windows(val, width, np.inf), np.empty(L + 1)
        for b, held, _ in rows:
            val[b] = np.maximum(before[b], held).min(axis=1)
    return int(problem.transient_mem + min(val[L], upper))


def fits_under(problem: Problem, cap: float, along: _Along | None = None) -> bool:
    """Whether some split of the chain keeps every stage's floor (:func:`memory_chain_floor`'s) within
    ``cap`` KiB and stages 0…s, for every s, within (s + 1)·``cap`` together: the chain segments they
    hold at each one's own in-flight count, plus every off-chain unit that must lie before stage s ends
    (at its least over them). False proves that no plan fits under ``cap``.

    Free units (a mixture of experts' weights) may lie in any stage before their reader's, but one that
    lies before a boundary its reader is past crosses it: the next stage holds its received output, at
    least :attr:`_Along.ratio` of it. A dynamic program over (stage, end position) keeping the most of
    the free units stages 0…s can hold (their room less their chain segments, and no more than what
    must or may lie there plus what the next stage can receive): the more, the better for the rest."""
    along = along or along_chain(problem)
    L, S = len(along.chain) - 1, problem.num_stages
    room = cap - problem.transient_mem
    placed = np.where(np.arange(L + 1) == 0, 0.0, -np.inf)  # the most of the free units stages 0…s can hold
    ratio = along.ratio if math.isfinite(along.ratio) else 0.0
    before = np.zeros(L + 1)  # what stages 0…s − 1 hold of the free units without crossing to stage s
    for s in range(S):
        width, rows = along.segments(s, room, own=True)
        placed_a, before_a, more = windows(placed, width, -np.inf), windows(before, width), np.empty(L + 1)
        for b, floor, own in rows:
            assert own is not None
            free_room = room - own
            carried, ahead = placed_a[b], before_a[b]
            if ratio >= 1:  # carrying more across costs stage s more than it brings: carry nothing extra
                carried = np.minimum(carried, ahead)
            elif ratio > 0:  # past what need not cross, the rest crosses into stage s: it holds ratio of it
                carried = np.minimum(carried, ahead + np.maximum(0.0, free_room) / ratio)
                free_room = np.where(free_room >= 0, np.maximum(0.0, free_room - ratio * np.maximum(0.0, carried - ahead)), free_room)
            more[b] = np.where(np.isfinite(floor) & (free_room >= 0), carried + free_room, -np.inf).max(axis=1)
        placed = np.where(more >= along.early[:, s], more, -np.inf)
        before = along.early[:, s] + along.loose
    return bool(np.isfinite(placed[L]))


def memory_proof(problem: Problem, along: _Along | None = None, floor: int | None = None) -> int:
    """The least KiB any plan puts on its fullest device, as proven here: :func:`memory_floor` and
    :func:`memory_chain_floor` (``floor``, when the caller has it), and when both stay within the largest cap but
    :func:`fits_under` refuses it, the largest cap it refuses (bisected over :data:`PROOF_STEPS` steps up to twice the cap)."""
    along = along or along_chain(problem)
    cap = max(problem.capacity)
    floor = max(memory_floor(problem), memory_chain_floor(problem, along=along)) if floor is None else floor
    if floor > cap or fits_under(problem, cap, along):
        return floor
    low, high = cap, 2 * cap  # refused at low
    for _ in range(PROOF_STEPS):
        middle = (low + high) // 2
        if fits_under(problem, middle, along):
            high = middle
        else:
            low = middle
    return low + 1


def memory_floors(problem: Problem) -> tuple[int, int, int]:
    """KiB of :func:`memory_floor`, :func:`memory_chain_floor` and :func:`memory_proof`, cheapest
    first: each is computed only where those before it stay within the largest cap (0 where not
    computed), the chain's once for both of the last two, and only up to :data:`CHAIN_UPPER` times the
    cap (past it, the proof holds: the narrower band costs less)."""
    largest = max(problem.capacity)
    spread = memory_floor(problem)
    if spread > largest:
        return spread, 0, 0
    along = along_chain(problem)
    chain = memory_chain_floor(problem, CHAIN_UPPER * largest, along)
    if chain > largest:
        return spread, chain, 0
    return spread, chain, memory_proof(problem, along, max(spread, chain))


def _memory_along(
    problem: Problem, chain: list[int], mem: np.ndarray, before: list[int], after: list[int]
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray, float], np.ndarray]:
    """[p, s] memory of chain node p with the rest of its colocated group; [p, s] the least the units
    free before the chain that it reads leave on its stage; (F, G) difference arrays [2, position, s]
    of the units pinned between two chain nodes by their last and first position ([0] with the share
    the free units leave on readers off the chain, [1] the pinned units alone); off-chain units'
    memory by the chain position they must precede ((every unit, the free ones), L + 1: none); and
    by the one they must follow (0: none)."""
    N, S, L = len(problem.nodes), problem.num_stages, len(chain)
    position = {h: p for p, h in enumerate(chain)}
    on_chain, read = mem[chain].copy(), np.zeros((L, S))
    forced_end, forced_start = np.zeros((2, L + 2, S)), np.zeros((2, L + 2, S))
    early, free, late = np.zeros((L + 2, S)), np.zeros((L + 2, S)), np.zeros((L + 2, S))
    loose, ratio = np.zeros(L + 2), math.inf
    members = {n for g in problem.colocate for n in g}
    consumers, recv = problem.consumers(), problem.arrays.recv
    for g in [*problem.colocate, *((n,) for n in range(N) if n not in members)]:
        held = [position[n] for n in g if n in position]
        rest = [n for n in g if n not in position]
        if not rest:
            continue
        need = mem[rest].sum(axis=0)
        if held:
            on_chain[held[0]] += need
            continue
        first, last = max(after[n] for n in g), min(before[n] for n in g)
        early[last] += need
        late[first] += need
        if first >= 1 and last <= L:
            for k in (0, 1):
                forced_end[k, last] += need
                forced_start[k, first] += need
        elif first < 1:
            free[last] += need
            found = _first_reader(g, consumers)
            # Before a boundary its first reader must follow, it crosses that boundary; else it need not.
            loose[after[found[0]] if found else 0] += need.max()
            loose[last] -= need.max()
            if found is None:
                continue
            # Free before the chain: on its reader's stage, or earlier, and the reader's stage receives it.
            reader, u = found
            ratio = min(ratio, float(recv[u].min()) / max(1.0, float(need.max())))
            share = np.minimum(need, recv[u])
            if reader in position:
                read[position[reader]] += share
            elif after[reader] >= 1 and before[reader] <= L:
                forced_end[0, before[reader]] += share
                forced_start[0, after[reader]] += share
    return on_chain, read, (forced_end, forced_start), (early, free, loose, ratio), late


def _first_reader(group: Sequence[int], consumers: list[list[int]]) -> tuple[int, int] | None:
    """(the first node outside ``group`` that reads one of its outputs, the member it reads), or None."""
    inside = set(group)
    return min(((v, u) for u in group for v in consumers[u] if v not in inside), default=None)
