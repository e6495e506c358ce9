r"""Lower bounds on the pipeline objective, valid for every plan (DESIGN §4.4: "give the solver
the bound; report the gap against it").

*Analytic*: every node at its fastest, perfectly balanced, latency paid:

    LB = Σ_n min_s c[n,s] + 2·Σ_k L_k + (M − 1)·max(⌈that / S⌉, max_n min_s c[n,s])

*Chain* (tighter on deep models). Take the heaviest dependency chain h_1 → … → h_L of the
graph (in a transformer, the residual backbone with every matmul on it). In any plan the
chain's nodes fall into S consecutive, possibly empty, segments in stage order, and when a
stage boundary falls between h_p and h_{p+1}, h_p's output crosses it. So every stage costs
at least its chain segment's compute, plus the latency and the crossing chain link at each
of its boundaries, and

    T ≥ B* = min over 0 = p_0 ≤ … ≤ p_S = L of max_s [ c_H(p_s, p_{s+1}) + [s > 0](L + x(p_s))
                                                         + [s < S−1](L + x(p_{s+1})) ]

with x(0) = x(L) = 0 (a boundary outside the chain crosses no chain link) and L, x at their
cheapest over boundaries. B* is a bottleneck dynamic program over chain positions; unlike
⌈total / S⌉ it knows that cutting inside a layer moves a large tensor and that nodes do
not split.

Usage::

    bound = lower_bound(problem)
"""

from __future__ import annotations

import math

import numpy as np

from autosplit.solver.problem import Problem

__all__ = ["lower_bound", "chain_bound", "memory_units", "memory_floor"]


def heaviest_chain(problem: Problem) -> list[int]:
    """The dependency chain of largest total compute (longest path, nodes at their fastest)."""
    cost = [min(row) for row in problem.compute]
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


def chain_bound(problem: Problem, upper: float = math.inf) -> float:
    """B* above: no plan's slowest stage is faster. ``upper`` (any plan's slowest stage) narrows the DP."""
    S = problem.num_stages
    chain = heaviest_chain(problem)
    L = len(chain)
    if S == 1 or L == 0:
        return float(sum(min(problem.compute[n]) for n in chain))
    lat = float(min(problem.boundary_latency))
    prefix = np.concatenate([[0.0], np.cumsum([min(problem.compute[n]) for n in chain])])
    x = np.zeros(L + 1)
    x[1:L] = [min(problem.transfer[n]) for n in chain[:-1]]  # cut after chain[p-1]: its output crosses
    ends = np.arange(L + 1)
    lo = np.searchsorted(prefix, prefix - upper, side="left") if math.isfinite(upper) else np.zeros(L + 1, dtype=int)
    width = int((ends - lo).max()) + 1
    starts = ends[:, None] - np.arange(width)[None, :]  # segment (a, b], a ≤ b: empty segments allowed
    valid = (starts >= lo[:, None]) & (starts >= 0)
    starts = np.clip(starts, 0, L)
    val = np.where(ends == 0, 0.0, np.inf)
    for s in range(S):
        t = prefix[ends][:, None] - prefix[starts]
        if s > 0:
            t = t + lat + x[starts]
        if s < S - 1:
            t = t + lat + x[ends][:, None]
        cand = np.where(valid, np.maximum(val[starts], t), np.inf)
        val = cand.min(axis=1)
    return float(val[L])


def lower_bound(problem: Problem, upper: float = math.inf) -> int:
    """The best of the bounds above, on the objective ``Σ t_s + (M − 1)·max t_s``."""
    S = problem.num_stages
    fastest = [min(row) for row in problem.compute]
    total = sum(fastest) + 2 * sum(problem.boundary_latency)
    slowest = max(math.ceil(total / S), max(fastest, default=0), math.floor(chain_bound(problem, upper)))
    return total + (problem.micro_batches - 1) * slowest


def memory_units(problem: Problem) -> list[tuple[tuple[int, ...], int]]:
    """Each unit that cannot be split (a colocated group, or a lone node) with the KiB it needs
    on any device: its state, its least activations, and the transient reserve."""
    need = [problem.state_mem[n] + min(problem.act_mem[n]) for n in range(len(problem.nodes))]
    groups = [*problem.colocate, *((n,) for n in range(len(problem.nodes)))]
    return [(tuple(g), problem.transient_mem + sum(need[n] for n in g)) for g in groups]


def memory_floor(problem: Problem) -> int:
    """KiB that any plan puts on its fullest device, at least: perfect spreading of state and
    activations, and no less than the largest unit that cannot be split."""
    total = sum(problem.state_mem[n] + min(problem.act_mem[n]) for n in range(len(problem.nodes)))
    largest_unit = max(need for _, need in memory_units(problem))
    return max(problem.transient_mem + math.ceil(total / problem.num_stages), largest_unit)
