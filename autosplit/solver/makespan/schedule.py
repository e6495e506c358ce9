"""Tasks of one training step, their schedule on devices, and a list scheduler (HEFT).

The makespan objective (DESIGN §4.3, Pal et al.'s DLPlacer) places each unit (a node, or a
block after coarsening) on one device, where it runs two tasks: its forward ``F_u`` and,
after the loss, its backward ``B_u`` (with its share of the optimizer step). Durations come
from :class:`~autosplit.solver.problem.Problem`: ``F_u`` takes ``forward[u][d]`` on device
``d``, ``B_u`` the rest of ``compute[u][d]``. With one micro-batch, ``transfer[u][k]`` is
u's output sent forward plus its gradient sent back over the link k, so each direction
costs half of it; devices joined by different links are charged the slowest (one delay per
value, whichever pair of devices exchanges it). Transfers overlap compute (they delay the
consumer; they do not occupy a device).

Precedence, for every data edge u → v and ``δ_uv`` = [u and v on different devices]:

    start F_v ≥ end F_u + c_u · δ_uv          (the activation travels forward)
    start B_u ≥ end B_v + c_u · δ_uv          (its gradient travels back)
    start B_u ≥ end F_u,   start B_s ≥ L ≥ end F_w  for outputs s, w (the loss needs every output)

and ``start F_v ≥ end F_u`` for order-only edges (an in-place write and the reads before it).
A device runs one task at a time; the step's makespan is the end of the last task.

:func:`list_schedule` is HEFT (Topcuoglu et al. 2002): tasks by decreasing upward rank,
each forward on the device where it finishes first among those with memory left, each
backward on its forward's device, at the earliest time its inputs are there and the device
is free (appended, no insertion). It is the warm start of the CP-SAT model and the fallback.
:func:`schedule_of` times a given assignment with the same rules, in a given order.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from networkx.utils import UnionFind

from autosplit.solver.problem import Problem

__all__ = [
    "Task", "Schedule", "comm", "run_key", "durations", "groups", "list_schedule", "memory_of", "pinned_search", "schedule_of",
    "task_graph",
]


@dataclass(frozen=True)
class Task:
    unit: int
    kind: str
    """``"forward"`` or ``"backward"``."""
    device: int
    start: int
    end: int


@dataclass(frozen=True)
class Schedule:
    """An assignment with every task timed (ns)."""

    device_of: tuple[int, ...]
    tasks: tuple[Task, ...]

    @property
    def makespan(self) -> int:
        return max((t.end for t in self.tasks), default=0)

    def order(self, device: int) -> list[Task]:
        """The tasks ``device`` runs, in order."""
        return sorted((t for t in self.tasks if t.device == device), key=lambda t: run_key(t.start, t.end, t.kind, t.unit))


def run_key(start: float, end: float, kind: str, position: int) -> tuple[float, float, bool, int]:
    """Sort key that puts tasks in an order their precedence allows: by start, then end; tasks
    that tie there take no time, so forwards go first in topological order (``position``) and
    backwards after them in reverse. Sorting by start alone can put a task before the
    zero-length task it waits for, and two devices waiting on each other never finish."""
    backward = kind == "backward"
    return start, end, backward, -position if backward else position


def durations(problem: Problem) -> tuple[list[list[int]], list[list[int]]]:
    """([unit][device] forward ns, [unit][device] backward ns)."""
    fwd = [[problem.forward_time(u, d) for d in range(problem.num_stages)] for u in range(len(problem.nodes))]
    bwd = [[problem.compute[u][d] - fwd[u][d] for d in range(problem.num_stages)] for u in range(len(problem.nodes))]
    return fwd, bwd


def comm(problem: Problem) -> list[int]:
    """[unit] ns to send its output one way between two devices (its slowest link; 0 with one device)."""
    latency = max(problem.boundary_latency, default=0)
    return [(max(row, default=0) + latency) // 2 for row in problem.transfer]


def task_graph(problem: Problem) -> list[tuple[int, int, int]]:
    """Precedence between tasks as (task a, task b, unit w) triples.

    Task ``2u`` is F_u, ``2u + 1`` is B_u. Each ``(a, b, w)``: b starts after a ends,
    plus w's one-way comm when a's and b's units sit on different devices (w = −1: no comm).
    The loss edges (every output's forward before every output's backward) carry no comm.
    """
    N = len(problem.nodes)
    has_consumer = [False] * N
    prec: list[tuple[int, int, int]] = []
    for u, v in problem.edges:
        has_consumer[u] = True
        prec.append((2 * u, 2 * v, u))
        prec.append((2 * v + 1, 2 * u + 1, u))
    for u, v in problem.order_edges:
        prec.append((2 * u, 2 * v, -1))
    outputs = [u for u in range(N) if not has_consumer[u]]
    for u in range(N):
        prec.append((2 * u, 2 * u + 1, -1))
    for w in outputs:
        for s in outputs:
            if w != s:
                prec.append((2 * w, 2 * s + 1, -1))
    return prec


def memory_of(problem: Problem, device_of: Sequence[int]) -> list[int]:
    """[device] KiB: state and saved activations of its units, the outputs it receives, the reserve."""
    mem = [problem.transient_mem] * problem.num_stages
    received: set[tuple[int, int]] = set()
    for u, d in enumerate(device_of):
        mem[d] += problem.state_mem[u] + problem.act_mem[u][d]
    for u, v in problem.edges:
        d = device_of[v]
        if device_of[u] != d and (u, d) not in received:
            received.add((u, d))
            mem[d] += problem.recv_mem[u][d]
    return mem


def _topological_tasks(problem: Problem, prec: Sequence[tuple[int, int, int]], rank: Sequence[float]) -> list[int]:
    """Every task, each after its predecessors, the highest rank first among the ready ones."""
    import networkx as nx  # deferred: networkx loads when a makespan is first scheduled

    graph = nx.DiGraph()
    graph.add_nodes_from(range(2 * len(problem.nodes)))
    graph.add_edges_from((a, b) for a, b, _ in prec)
    return list(nx.lexicographical_topological_sort(graph, key=lambda t: (-rank[t], t)))


def _upward_rank(problem: Problem, prec: Sequence[tuple[int, int, int]]) -> list[float]:
    """HEFT's upward rank: a task's mean duration plus the longest path after it (mean comm on edges)."""
    fwd, bwd = durations(problem)
    c = comm(problem)
    D = problem.num_stages
    mean = [0.0] * (2 * len(problem.nodes))
    for u in range(len(problem.nodes)):
        mean[2 * u], mean[2 * u + 1] = sum(fwd[u]) / D, sum(bwd[u]) / D
    succ: list[list[tuple[int, float]]] = [[] for _ in mean]
    for a, b, w in prec:
        succ[a].append((b, c[w] * (D - 1) / D if w >= 0 else 0.0))
    rank = [0.0] * len(mean)
    for t in reversed(_topological_tasks(problem, prec, [0.0] * len(mean))):
        rank[t] = mean[t] + max((e + rank[b] for b, e in succ[t]), default=0.0)
    return rank


def _time(
    problem: Problem, order: Sequence[int], prec: Sequence[tuple[int, int, int]], choose,
) -> Schedule:
    """Time ``order`` (a topological order of the tasks); ``choose(unit, ready_at, free)`` picks a forward's device."""
    fwd, bwd = durations(problem)
    c = comm(problem)
    preds: list[list[tuple[int, int]]] = [[] for _ in range(2 * len(problem.nodes))]
    for a, b, w in prec:
        preds[b].append((a, w))
    device_of = [-1] * len(problem.nodes)
    end = [0] * (2 * len(problem.nodes))
    free = [0] * problem.num_stages
    tasks = []

    def ready(t: int, d: int) -> int:
        return max((end[a] + (c[w] if w >= 0 and device_of[a // 2] != d else 0) for a, w in preds[t]), default=0)

    for t in order:
        u, backward = divmod(t, 2)
        if backward:
            d = device_of[u]
        else:
            d = choose(u, lambda d, t=t: ready(t, d), free)
            device_of[u] = d
        start = max(ready(t, d), free[d])
        end[t] = free[d] = start + (bwd if backward else fwd)[u][d]
        tasks.append(Task(u, "backward" if backward else "forward", d, start, end[t]))
    return Schedule(tuple(device_of), tuple(tasks))


def schedule_of(problem: Problem, device_of: Sequence[int], priority: Sequence[int] | None = None) -> Schedule:
    """Time the assignment ``device_of``: each device runs its tasks as soon as their inputs are
    there, in ``priority`` order (task ids ``2u``/``2u + 1``; default HEFT's rank)."""
    prec = task_graph(problem)
    if priority is None:
        rank = _upward_rank(problem, prec)
    else:
        rank = [0.0] * (2 * len(problem.nodes))
        for i, t in enumerate(priority):
            rank[t] = -float(i)
    return _time(problem, _topological_tasks(problem, prec, rank), prec, lambda u, _ready, _free: device_of[u])


def groups(problem: Problem) -> UnionFind:
    """Units that must share a device (colocated, or kept together by a constraint), as a union-find."""
    from networkx.utils import UnionFind

    group = UnionFind(range(len(problem.nodes)))
    for members in [*problem.colocate, *(c.together for c in problem.constraints)]:
        group.union(*members)
    return group


def list_schedule(problem: Problem, pinned: Mapping[int, int] | None = None) -> Schedule | None:
    """HEFT within the memory caps: None when a unit finds no device with room. ``pinned``
    (unit → device) places those units' groups there instead of where they would finish first."""
    prec = task_graph(problem)
    fwd, _ = durations(problem)
    order = _topological_tasks(problem, prec, _upward_rank(problem, prec))
    forbidden = {(n, s) for c in problem.constraints for n, s in c.forbid}
    used = [problem.transient_mem] * problem.num_stages
    caps = problem.capacity
    group = groups(problem)  # the first unit of a group placed decides for all of it
    placed: dict[int, int] = {group[u]: d for u, d in (pinned or {}).items()}

    def choose(u: int, ready, free) -> int:
        if group[u] in placed:
            d = placed[group[u]]
            used[d] += problem.state_mem[u] + problem.act_mem[u][d]
            if (u, d) in forbidden:
                raise _NoRoom
            return d
        best = None
        for d in range(problem.num_stages):
            need = problem.state_mem[u] + problem.act_mem[u][d]
            if (u, d) in forbidden or used[d] + need > caps[d]:
                continue
            finish = max(ready(d), free[d]) + fwd[u][d]
            if best is None or finish < best[0]:
                best = (finish, d)
        if best is None:
            raise _NoRoom
        used[best[1]] += problem.state_mem[u] + problem.act_mem[u][best[1]]
        placed[group[u]] = best[1]
        return best[1]

    try:
        found = _time(problem, order, prec, choose)
    except _NoRoom:
        return None
    if any(m > cap for m, cap in zip(memory_of(problem, found.device_of), caps)):
        return None
    return found


def pinned_search(problem: Problem, start: Schedule, *, deadline: float, evaluations: int = 400) -> Schedule:
    """``start`` (HEFT's schedule) improved by pinning whole groups to other devices.

    HEFT places a group where its first unit finishes first, blind to the group's later units:
    a recurrence called once per time piece (each call a unit, all of them one group) lands on
    the device that ran the piece below it, for want of one transfer, and a stack of them never
    runs as a wavefront. This local search takes the heavy groups (each at least 1% of the work,
    heaviest first), pins one at a time to another device (every other with up to 4 devices,
    else the 3 least busy), runs HEFT again around the pins and keeps a pin that shortens the
    step. Passes repeat until none does, ``evaluations`` HEFT runs are spent or
    ``time.perf_counter()`` passes ``deadline``. Every schedule it returns is HEFT's under some
    pins, so it keeps every rule HEFT keeps."""
    group = groups(problem)
    fwd, bwd = durations(problem)
    work: dict[int, int] = {}
    for u in range(len(problem.nodes)):
        work[group[u]] = work.get(group[u], 0) + min(f + b for f, b in zip(fwd[u], bwd[u]))
    total = sum(work.values())
    heavy = sorted((w, g) for g, w in work.items() if w >= total / 100)[::-1][:48]
    best, pins, spent = start, dict[int, int](), 0
    improved = True
    while improved and spent < evaluations and time.perf_counter() < deadline:
        improved = False
        for _, g in heavy:
            busy = [0] * problem.num_stages
            for t in best.tasks:
                busy[t.device] += t.end - t.start
            here = best.device_of[g]
            others = sorted((d for d in range(problem.num_stages) if d != here), key=lambda d: (busy[d], d))
            for d in others if problem.num_stages <= 4 else others[:3]:
                if spent >= evaluations or time.perf_counter() >= deadline:
                    return best
                spent += 1
                found = list_schedule(problem, {**pins, g: d})
                if found is not None and found.makespan < best.makespan:
                    best, pins, improved = found, {**pins, g: d}, True
                    break
    return best


class _NoRoom(Exception):
    """No device has memory left for a unit (internal to :func:`list_schedule`)."""
