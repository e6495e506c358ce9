"""Check a plan against the correctness rules (DESIGN §4.5) without any solver.

Runs after every solve and on every loaded plan: a plan that breaks a rule never reaches
codegen, whoever produced it (CP-SAT, the fallback split, a user's manual split, a file).

Usage::

    validate(problem, stage_of)   # raises PlanValidationError listing every broken rule
"""

from __future__ import annotations

from collections.abc import Sequence

from autosplit.errors import PlanValidationError, advice
from autosplit.solver.evaluation import evaluate
from autosplit.solver.problem import KIB, Problem
from autosplit.units import format_bytes

__all__ = ["violations", "validate"]


def violations(problem: Problem, stage_of: Sequence[int], *, memory: bool = True) -> list[str]:
    """Every rule ``stage_of`` (node index → stage) breaks, as sentences; empty when valid
    (``memory=False``: every rule but the memory caps)."""
    N, S = len(problem.nodes), problem.num_stages
    if len(stage_of) != N:
        return [f"plan places {len(stage_of)} nodes but the graph has {N}: every node must be placed exactly once"]
    out = [
        f"node '{problem.nodes[n]}' is on stage {s}, outside 0..{S - 1}"
        for n, s in enumerate(stage_of)
        if not (isinstance(s, int) and 0 <= s < S)
    ]
    if out:
        return out
    for u, v in (*problem.edges, *problem.order_edges):
        if stage_of[u] > stage_of[v]:
            out.append(
                f"edge {problem.nodes[u]} → {problem.nodes[v]} runs backwards (stage {stage_of[u]} → {stage_of[v]}): "
                "the stage graph must be acyclic"
            )
    for group in problem.colocate:
        stages = {stage_of[n] for n in group}
        if len(stages) > 1:
            names = ", ".join(problem.nodes[n] for n in group[:4])
            out.append(f"nodes sharing parameters or written in place ({names}, ...) sit on stages {sorted(stages)}")
    for c in problem.constraints:
        broken = [problem.nodes[n] for n, s in c.forbid if stage_of[n] == s]
        if broken or len({stage_of[n] for n in c.together}) > 1:
            out.append(f"breaks the constraint: {c.text}" + (f" (node {broken[0]})" if broken else ""))
    if N >= S:
        empty = sorted(set(range(S)) - set(stage_of))
        if empty:
            out.append(f"stages {empty} are empty")
    if not memory:
        return out
    ev = evaluate(problem, stage_of)
    if problem.stages_per_rank == 1:
        for s, (mem, cap) in enumerate(zip(ev.memory, problem.capacity)):
            if mem > cap:
                out.append(f"stage {s} on {problem.devices[s]} needs {format_bytes(mem * KIB)}, over its cap {format_bytes(cap * KIB)}")
        return out
    for r, mem in enumerate(ev.rank_memory):
        mine = [s for s in range(S) if problem.rank(s) == r]
        cap = problem.capacity[mine[0]]
        if mem > cap:
            out.append(f"rank {r} on {problem.devices[mine[0]]} needs {format_bytes(mem * KIB)} for its stages {mine}, "
                       f"over its cap {format_bytes(cap * KIB)}")
    return out


def validate(problem: Problem, stage_of: Sequence[int], *, memory: bool = True) -> None:
    found = violations(problem, stage_of, memory=memory)
    if found:
        raise PlanValidationError(advice(
            "the plan breaks {} rule(s):\n  - {}".format(len(found), "\n  - ".join(found)),
            "the assignment was edited, or made for other caps or constraints",
            "re-plan, or fix the nodes named above",
        ))
