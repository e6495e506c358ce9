"""The heaviest dependency chain of a problem and what any plan must pay along it.

:func:`chain_of` finds the chain h_1 → … → h_L of most compute, which off-chain nodes each
plan must place between two of its nodes, and x(p): what a stage boundary between h_p and
h_{p+1} must carry (the tensors that cross it, plus the least cut through the free nodes
beside the chain, by max flow). The bounds of :mod:`~autosplit.solver.pipeline.bounds` are
dynamic programs over these positions.

Usage::

    chain = chain_of(problem)
    chain.x[p]          # the least a boundary between h_p and h_{p+1} carries
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autosplit.options import SolverLimits
from autosplit.solver.problem import Problem

__all__ = ["Chain", "chain_of", "chain_reach", "heaviest_chain"]


def heaviest_chain(problem: Problem, cost: Sequence[float] | None = None) -> list[int]:
    """The dependency chain of largest total ``cost`` (longest path; default: compute at its fastest)."""
    cost = problem.fastest if cost is None else cost
    preds: list[list[int]] = [[] for _ in problem.nodes]
    for u, v in (*problem.edges, *problem.order_edges):
        preds[v].append(u)
    # Node indices are a topological order (Problem.nodes is), so one pass suffices.
    best = [0.0] * len(cost)
    back = [-1] * len(cost)
    for v in range(len(cost)):
        if preds[v]:
            u = max(preds[v], key=lambda p: best[p])
            best[v], back[v] = best[u] + cost[v], u
        else:
            best[v] = cost[v]
    chain, v = [], max(range(len(cost)), key=lambda n: best[n], default=-1)
    while v >= 0:
        chain.append(v)
        v = back[v]
    return chain[::-1]


@dataclass(frozen=True)
class Chain:
    """The heaviest chain and what any plan must pay along it (arrays over positions 0..L)."""

    nodes: list[int]
    prefix: np.ndarray
    """Compute of h_1..h_p at their fastest."""
    x: np.ndarray
    """Transfers a boundary between h_p and h_{p+1} must carry (0 at p = 0 and p = L)."""
    forced_end: np.ndarray
    """F(b): compute of off-chain nodes that must come no later than h_b (and after some chain node)."""
    forced_start: np.ndarray
    """G(a): compute of off-chain nodes that may come as early as h_a (and before some chain node)."""
    room: np.ndarray
    """How many boundaries may sit at each position: one between two chain nodes, plus one per
    off-chain unit (colocated group or lone node) that may lie there and fill a stage of its own
    (stages are never empty); at p = 0 and p = L only such units count."""


def chain_reach(problem: Problem, chain: list[int]) -> tuple[list[int], list[int]]:
    """For every node u: (the first chain position it precedes, the last chain position that
    precedes it), positions 1..L; L + 1 and 0 when there is none.

    In any plan the chain's nodes are in non-decreasing stages, and u sits no later than
    ``h[before[u]]`` and no earlier than ``h[after[u]]`` (precedence is transitive).
    """
    N, L = len(problem.nodes), len(chain)
    position = {h: i + 1 for i, h in enumerate(chain)}
    succs: list[list[int]] = [[] for _ in range(N)]
    preds: list[list[int]] = [[] for _ in range(N)]
    for u, v in (*problem.edges, *problem.order_edges):
        succs[u].append(v)
        preds[v].append(u)
    before, after = [L + 1] * N, [0] * N
    for u in reversed(range(N)):  # node indices are a topological order
        before[u] = min([position.get(u, L + 1), *(before[v] for v in succs[u])])
    for v in range(N):
        after[v] = max([position.get(v, 0), *(after[u] for u in preds[v])])
    return before, after


def _detours(
    problem: Problem, chain: list[int], before: list[int], after: list[int], last: list[int], free_span: int
) -> np.ndarray:
    """[p] the least a boundary between h_p and h_{p+1} carries beyond the tensors that must cross it.

    Off-chain nodes that may sit on either side of such a boundary (``after ≤ p < before``:
    in a transformer, the value projection beside the attention scores) are *free*. A path
    from a node that must stay before the boundary, through free nodes, to one that must
    come after it, crosses the boundary somewhere: the least such crossing is a minimum cut
    (OR-Tools' max flow) in the small network of the free nodes and their neighbours, with
    a tensor's cost paid once, however many of its readers lie beyond, and nothing for a
    tensor already counted as crossing. Free nodes spanning more than ``free_span`` positions
    (:attr:`SolverLimits.free_span`), or with no chain node before or after them, are left out,
    which only lowers the cut. Repeated layers give the same network at many positions: each is
    solved once.
    """
    L, N = len(chain), len(problem.nodes)
    on_chain = set(chain)
    cost = problem.cheapest_transfer
    consumers = problem.consumers()
    producers: list[list[int]] = [[] for _ in range(N)]
    for u, v in problem.edges:
        producers[v].append(u)
    followers: list[list[int]] = [[] for _ in range(N)]  # order edges: precedence, nothing carried
    for u, v in problem.order_edges:
        followers[u].append(v)
    free_at: list[list[int]] = [[] for _ in range(L + 1)]
    for u in range(N):
        if u not in on_chain and 1 <= after[u] and before[u] <= L and before[u] - after[u] <= free_span:
            for p in range(after[u], before[u]):
                free_at[p].append(u)
    links = _Links(producers, consumers, followers, before, after, last, cost)
    extra = np.zeros(L + 1)
    solved: dict[tuple, int] = {}
    for p in range(1, L):
        if free_at[p]:
            arcs = links.network(p, free_at[p])
            if arcs not in solved:
                solved[arcs] = _min_cut(arcs)
            extra[p] = solved[arcs]
    return extra


@dataclass(frozen=True)
class _Links:
    """What :func:`_detours` reads of the graph and the chain, per node."""

    producers: list[list[int]]
    consumers: list[list[int]]
    followers: list[list[int]]
    """Order edges: precedence, nothing carried."""
    before: list[int]
    after: list[int]
    last: list[int]
    """The last chain position that must follow one of the node's readers."""
    cost: list[int]
    """The least transfer of the node's output."""

    def network(self, p: int, free: list[int]) -> tuple[tuple[int, int, int], ...]:
        """Arcs (tail, head, capacity; −1 infinite) of the cut network at position p: node 0 is
        the side before the boundary, 1 the side after it, then the free nodes and the tensors.
        The same structure gives the same arcs, so the caller can solve each network once."""
        local = {u: i + 2 for i, u in enumerate(free)}
        tensors: dict[int, int] = {}  # producer → the network node of its output, paid once
        arcs: list[tuple[int, int, int]] = []

        def side(w: int) -> int | None:
            if w in local:
                return local[w]
            return 0 if self.before[w] <= p else 1 if self.after[w] > p else None  # None: a free node left out

        def tensor_of(w: int, tail: int) -> int:
            if w not in tensors:
                tensors[w] = len(local) + 2 + len(tensors)
                arcs.append((tail, tensors[w], self.cost[w]))
            return tensors[w]

        for u in free:
            for w in self.producers[u]:
                if side(w) == 0 and not (self.before[w] <= p < self.last[w]):  # w's tensor is not counted yet
                    arcs.append((tensor_of(w, 0), local[u], -1))
            tensor = tensor_of(u, local[u])
            for v in self.consumers[u]:
                head = side(v)
                if head is not None and head != 0:
                    arcs.append((tensor, head, -1))  # u before the boundary and v after it: u's tensor crosses
                    if head > 1:
                        arcs.append((head, local[u], -1))  # v before the boundary ⇒ u before it
            for v in self.followers[u]:
                head = side(v)
                if head is not None and head > 1:
                    arcs.append((head, local[u], -1))
        return tuple(arcs)


def _min_cut(arcs: Sequence[tuple[int, int, int]]) -> int:
    """Value of the least cut from node 0 to node 1 (capacity −1: infinite)."""
    from ortools.graph.python import max_flow  # deferred: OR-Tools loads when a bound first needs it

    tails, heads, caps = (np.asarray(c, dtype=np.int64) for c in zip(*arcs))
    caps = np.where(caps < 0, np.iinfo(np.int64).max // (len(arcs) + 1), caps)
    flow = max_flow.SimpleMaxFlow()
    flow.add_arcs_with_capacity(tails, heads, caps)
    if flow.solve(0, 1) != flow.OPTIMAL:
        return 0  # no bound beats a wrong one
    return int(flow.optimal_flow())


def chain_of(problem: Problem, limits: SolverLimits = SolverLimits()) -> Chain:
    """The heaviest chain of ``problem`` with the compute, crossings and room along it that every plan
    must respect (:class:`Chain`); ``limits``: how far the detour cuts look (:attr:`SolverLimits.free_span`)."""
    chain = heaviest_chain(problem)
    L = len(chain)
    before, after = chain_reach(problem, chain)
    on_chain = set(chain)
    crossing = np.zeros(L + 2)  # a difference array over cut positions p = 0..L
    forced_end, forced_start = np.zeros(L + 2), np.zeros(L + 2)
    last = [max((after[v] for v in consumers), default=0) for consumers in problem.consumers()]
    fastest, transfer = problem.fastest, problem.cheapest_transfer
    for u in range(len(problem.nodes)):
        if before[u] < last[u]:  # u's output crosses every cut p with before[u] ≤ p < last[u]
            crossing[before[u]] += transfer[u]
            crossing[last[u]] -= transfer[u]
        if u not in on_chain and after[u] >= 1 and before[u] <= L:  # pinned between h_after and h_before
            forced_end[before[u]] += fastest[u]
            forced_start[after[u]] += fastest[u]
    x = np.cumsum(crossing)[: L + 1] + _detours(problem, chain, before, after, last, limits.free_span)
    x[0] = x[-1] = 0.0
    members = {n for g in problem.colocate for n in g}
    units = [*problem.colocate, *((n,) for n in range(len(problem.nodes)) if n not in members)]
    free = np.zeros(L + 2)  # a difference array: off-chain units that may sit at p, after ≤ p < before
    for g in units:
        if not on_chain.intersection(g):
            free[max(after[n] for n in g)] += 1
            free[min(before[n] for n in g)] -= 1
    room = np.cumsum(free)[: L + 1]
    room[1:L] += 1
    prefix = np.concatenate([[0.0], np.cumsum([fastest[n] for n in chain])])
    return Chain(chain, prefix, x, np.cumsum(forced_end)[: L + 1], np.cumsum(forced_start)[: L + 1], room)
