"""Coarsen: group nodes into blocks so the solver plans hundreds of units, not tens of thousands.

Blocks are runs of one topological order (so every block is convex: contracting it
cannot create a cycle), cut along the module hierarchy:

1. *module hierarchy*: start from the top-level modules; a run whose cost exceeds
   ``max_cost`` is split into its sub-modules' runs, recursively, down to single nodes;
2. *chain contraction*: neighbouring runs are merged back while the merged block stays
   within ``max_cost`` (a chain of small ops becomes one block);
3. *repeated layers*: sibling modules whose nodes have identical costs and structure (a
   transformer's layers) are found as one repeated group (:func:`repeated_layers`), as
   RaNNC and AutoParallel's region clustering do; the planner's log names them.

Costs come from the plain :class:`~autosplit.solver.problem.Problem`, whose labels are the
module paths fx recorded, so this works on graphs from symbolic tracing and from
``torch.export`` alike, and needs no torch.

Usage::

    c = coarsen(problem, topological_order(problem), max_cost=total / (16 * S))
    coarse = coarse_problem(problem, c)         # solve this, then c.to_nodes(coarse_stage_of)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from autosplit.solver.pipeline.dp import forbidden_cuts
from autosplit.solver.problem import Problem, UserConstraint

__all__ = ["Coarsening", "coarsen", "coarse_problem", "repeated_layers"]


@dataclass(frozen=True)
class Coarsening:
    """Blocks as runs of ``order``: block ``i`` holds ``order[bounds[i]:bounds[i + 1]]``."""

    order: tuple[int, ...]
    bounds: tuple[int, ...]
    labels: tuple[str, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.bounds) - 1

    def members(self, block: int) -> tuple[int, ...]:
        return self.order[self.bounds[block] : self.bounds[block + 1]]

    def to_nodes(self, block_stage: Sequence[int]) -> tuple[int, ...]:
        """Map a block-level assignment back to every node."""
        stage_of = [0] * len(self.order)
        for b, s in enumerate(block_stage):
            for n in self.members(b):
                stage_of[n] = s
        return tuple(stage_of)


def _prefix(label: str, depth: int) -> str:
    return ".".join(label.split(".")[:depth]) if label else ""


def coarsen(problem: Problem, order: Sequence[int], *, max_cost: float) -> Coarsening:
    """Blocks of at most ``max_cost`` compute (unless one node alone is larger); a block the problem
    may recompute (:attr:`Problem.recompute`) starts and ends at block boundaries."""
    cost = [sum(row) / len(row) for row in problem.compute]
    labels = [problem.labels[n] for n in order]
    prefix_cost = [0.0]
    for n in order:
        prefix_cost.append(prefix_cost[-1] + cost[n])

    def span_cost(lo: int, hi: int) -> float:
        return prefix_cost[hi] - prefix_cost[lo]

    def runs(lo: int, hi: int, depth: int) -> list[tuple[int, int]]:
        out, start = [], lo
        for p in range(lo + 1, hi + 1):
            if p == hi or _prefix(labels[p], depth) != _prefix(labels[start], depth):
                out.append((start, p))
                start = p
        return out

    max_depth = max((label.count(".") + 1 for label in labels if label), default=1)

    def split(lo: int, hi: int, depth: int) -> list[tuple[int, int]]:
        if span_cost(lo, hi) <= max_cost or hi - lo == 1:
            return [(lo, hi)]
        if depth > max_depth:  # inside one leaf module: single nodes
            return [(p, p + 1) for p in range(lo, hi)]
        return [piece for a, b in runs(lo, hi, depth) for piece in split(a, b, depth + 1)]

    position = {n: p for p, n in enumerate(order)}
    breaks = {edge for block in problem.recompute for edge in (
        min(position[n] for n in block.members), max(position[n] for n in block.members) + 1)}
    ends = {hi for lo, hi in split(0, len(order), 1)} | {b for b in breaks if 0 < b < len(order)}
    forbidden = forbidden_cuts(problem, order)  # colocated (or kept-together) nodes never straddle a block
    pieces = itertools.pairwise([0, *sorted(p for p in ends if not forbidden[p] or p == len(order))])
    merged: list[tuple[int, int]] = []
    for lo, hi in pieces:  # chain contraction along the order, at the cuts allowed
        if merged and span_cost(merged[-1][0], hi) <= max_cost and lo not in breaks:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    cut_at = [0, *(hi for _, hi in merged)]
    bounds = tuple(cut_at)
    block_labels = tuple(_common_label(labels[lo:hi]) for lo, hi in merged)
    return Coarsening(tuple(order), bounds, block_labels)


def repeated_layers(problem: Problem, order: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    """Groups of sibling modules (same parent) whose nodes match one for one: same relative
    module path, same compute, memory and output size, some of it work (modules of views and
    assertions alone, which cost nothing, are not layers). Shallowest level that has any."""
    max_depth = max((problem.labels[n].count(".") + 1 for n in order if problem.labels[n]), default=0)
    for depth in range(1, max_depth + 1):
        members: dict[str, list[int]] = defaultdict(list)
        for n in order:
            label = problem.labels[n]
            if label.count(".") + 1 >= depth:
                members[_prefix(label, depth)].append(n)
        groups: dict[tuple, list[str]] = defaultdict(list)
        for module, nodes in members.items():
            if not module or not any(any(problem.compute[n]) for n in nodes):  # outside any module, or no work
                continue
            parent = _prefix(module, depth - 1)
            shape = tuple(
                (problem.labels[n][len(module):], problem.compute[n], problem.state_mem[n], problem.transfer[n])
                for n in nodes
            )
            groups[(parent, shape)].append(module)
        found = sorted((tuple(g) for g in groups.values() if len(g) > 1), key=len, reverse=True)
        if found:
            return tuple(found)
    return ()


def _common_label(labels: Sequence[str]) -> str:
    parts = [label.split(".") for label in labels if label]
    if not parts:
        return ""
    common = []
    for atoms in zip(*parts):
        if len(set(atoms)) > 1:
            break
        common.append(atoms[0])
    return ".".join(common) or f"{labels[0]} … {labels[-1]}"


def coarse_problem(problem: Problem, c: Coarsening) -> Problem:
    """The problem over blocks: costs summed, edges and transfers between blocks."""
    block_of = [0] * len(problem.nodes)
    for b in range(c.num_blocks):
        for n in c.members(b):
            block_of[n] = b
    B, S = c.num_blocks, problem.num_stages

    def total(rows: Sequence[Sequence[int]], members: Sequence[int], width: int) -> tuple[int, ...]:
        return tuple(sum(rows[n][k] for n in members) for k in range(width))

    sends: list[set[int]] = [set() for _ in range(B)]  # members whose output leaves the block
    edges: set[tuple[int, int]] = set()
    for u, v in problem.edges:
        if block_of[u] != block_of[v]:
            edges.add((block_of[u], block_of[v]))
            sends[block_of[u]].add(u)
    order_edges = {(block_of[u], block_of[v]) for u, v in problem.order_edges if block_of[u] != block_of[v]} - edges
    blocks = [c.members(b) for b in range(B)]
    return Problem(
        nodes=tuple(f"block{b}" for b in range(B)),
        labels=c.labels,
        devices=problem.devices,
        compute=tuple(total(problem.compute, m, S) for m in blocks),
        forward=tuple(total(problem.forward, m, S) for m in blocks) if problem.forward else (),
        edges=tuple(sorted(edges)),
        order_edges=tuple(sorted(order_edges)),
        transfer=tuple(total(problem.transfer, sorted(sends[b]), S - 1) for b in range(B)),
        boundary_latency=problem.boundary_latency,
        state_mem=tuple(sum(problem.state_mem[n] for n in m) for m in blocks),
        act_mem=tuple(total(problem.act_mem, m, S) for m in blocks),
        recv_mem=tuple(total(problem.recv_mem, sorted(sends[b]), S) for b in range(B)),
        send_mem=tuple(total(problem.send_mem, sorted(sends[b]), S) for b in range(B)) if problem.send_mem else (),
        buffer_mem=tuple(sum(problem.buffer_mem[n] for n in sends[b]) for b in range(B)) if problem.buffer_mem else (),
        rank_of=problem.rank_of,  # a rank's stages, their moments and the schedule's steady state, as the nodes' problem has them
        peaks=problem.peaks,
        steady=problem.steady,
        capacity=problem.capacity,
        colocate=(),  # coarsen() never lets a colocated group straddle two blocks
        micro_batches=problem.micro_batches,
        transient_mem=problem.transient_mem,
        recompute=tuple(
            dataclasses.replace(block, members=tuple(sorted({block_of[n] for n in block.members}))) for block in problem.recompute
        ),
        constraints=tuple(
            UserConstraint(
                c.text,
                tuple(sorted({(block_of[n], s) for n, s in c.forbid})),
                tuple(sorted({block_of[n] for n in c.together})),
            )
            for c in problem.constraints
        ),
    )
