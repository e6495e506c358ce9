r"""The pipeline placement model in OR-Tools CP-SAT (DESIGN §4.4).

Nodes ``n`` (topological order), stages ``s = 0..S−1`` (stage ``s`` on device ``s``),
boundaries ``k = 1..S−1`` (between stages ``k−1`` and ``k``).

Variables
    b[n, k] ∈ {0, 1}   node n sits in stage ≥ k           (b[n, 0] ≡ 1, b[n, S] ≡ 0)
    y[u, k] ∈ {0, 1}   u's output crosses boundary k
    T ≥ 0              the slowest stage's time

Stage membership is ``in(n, s) = b[n, s] − b[n, s+1]``. Constraints (each added by the
method named in brackets):

    b[n, k+1] ≤ b[n, k]                                   ordered stages     [_order]
    b[u, k]   ≤ b[v, k]       ∀ edge u → v, ∀ k           acyclic, contiguous [_order]
    b[a, k]   = b[c, k]       ∀ colocated a, c            shared parameters  (one variable)
    Σ_n in(n, s) ≥ 1          ∀ s                          no empty stage     [_nonempty]
    y[u, k]   ≥ b[v, k] − b[u, k]   ∀ u → v               crossings          [_crossings]
    t_s = Σ_n c[n,s]·in(n,s) + X_s + X_{s+1},  X_k = L_k + Σ_u x[u,k]·y[u,k]
    T ≥ t_s,  T ≥ ⌈Σ_n min_s c[n,s] / S⌉,  T ≥ max_n min_s c[n,s]          [_time]
    Σ_n (m[n] + a[n,s])·in(n,s) + Σ_u r[u,s]·y[u,s] + R ≤ cap_s  ⇐ assume_s  [add_assumptions]
    in(n, s) = 0 (keep off / pin),  b[a, k] = b[c, k] (together)    ⇐ assume_c  [add_assumptions]

Objective: minimise ``Σ_s t_s + (M − 1)·T`` (the step-time numerator of
:mod:`autosplit.solver.problem`). The ordered-stage encoding turns precedence into
implications that CP-SAT propagates well and whose LP relaxation is tight, unlike a
one-hot ``x[n, d]`` model that stalls at several hundred nodes. Every memory cap is
guarded by an assumption literal, so an infeasible problem comes back with the devices
whose caps conflict. :mod:`autosplit.solver.pipeline.strategy` passes the dynamic program's plan as a
hint and keeps it if the time limit ends first.

Usage::

    status, stage_of, bound, core = cpsat(problem, hint, time_limit=10, seed=0, workers=None)
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

from autosplit.errors import InfeasiblePlanError, advice
from autosplit.solver.pipeline.bounds import memory_units
from autosplit.solver.problem import KIB, Problem
from autosplit.units import format_bytes

__all__ = ["cp_solver", "cpsat", "explain_infeasible", "explain_memory", "precheck", "PROVEN_GAP"]

PROVEN_GAP = 1e-3
"""Search stops once a plan is proven within this fraction of optimal (CP-SAT's relative gap;
the strategy skips CP-SAT when the DP's plan is already there)."""

log = logging.getLogger(__name__)


class _Model:
    """Builds the model above; ``caps=False`` drops memory caps (used to explain infeasibility);
    ``partial=False``: recomputed blocks recompute every micro-batch (no k[u, s])."""

    def __init__(self, problem: Problem, partial: bool = True):
        self.p = problem
        self.partial = partial
        from ortools.sat.python import cp_model  # deferred: OR-Tools (and the pandas it imports) load when a search first runs

        self.m = cp_model.CpModel()
        S = problem.num_stages
        rep = list(range(len(problem.nodes)))
        for group in problem.colocate:
            for n in group:
                rep[n] = group[0]
        self.b: dict[int, list[Any]] = {}  # [n][k]: 1 at k = 0, 0 at k = S, a boolean between
        for n in range(len(problem.nodes)):
            if rep[n] == n:
                self.b[n] = [1] + [self.m.new_bool_var(f"b_{n}_{k}") for k in range(1, S)] + [0]
        for n in range(len(problem.nodes)):
            self.b[n] = self.b[rep[n]]
        self._order()
        self._nonempty()
        self._crossings()
        self._recompute()
        self._time()

    def ge(self, n: int, k: int):
        return self.b[n][k]

    def inside(self, n: int, s: int):
        return self.b[n][s] - self.b[n][s + 1]

    def _order(self) -> None:
        S = self.p.num_stages
        for n, row in self.b.items():
            if n == 0 or row is not self.b[n - 1]:
                for k in range(1, S - 1):
                    self.m.add_implication(row[k + 1], row[k])
        for u, v in (*self.p.edges, *self.p.order_edges):
            if self.b[u] is not self.b[v]:
                for k in range(1, S):
                    self.m.add_implication(self.b[u][k], self.b[v][k])

    def _nonempty(self) -> None:
        N = len(self.p.nodes)
        for s in range(self.p.num_stages):
            self.m.add(sum(self.inside(n, s) for n in range(N)) >= 1)

    def _crossings(self) -> None:
        self.y: dict[tuple[int, int], cp_model.IntVar] = {}
        for u, consumers in enumerate(self.p.consumers()):
            outside = [v for v in consumers if self.b[v] is not self.b[u]]
            if not outside:
                continue
            for k in range(1, self.p.num_stages):
                y = self.y[u, k] = self.m.new_bool_var(f"y_{u}_{k}")
                self.m.add_implication(y, self.b[u][k].negated())
                for v in outside:  # b[v, k] ∧ ¬b[u, k] → y[u, k]
                    self.m.add_bool_or([self.b[v][k].negated(), self.b[u][k], y])

    def _recompute(self) -> None:
        """Per block u a literal r[u] (recompute it) and per stage z[u, s] = r[u] ∧ in(first member, s);
        a recomputed block's members share a stage. A stage's time grows by the blocks it recomputes,
        its memory shrinks by what they save, and every stage's reserve grows by the largest recomputed
        block's (see :meth:`Problem.fixed`). A block the solver chooses that can keep some of its
        stage's in-flight micro-batches (:attr:`~autosplit.solver.problem.Recompute.in_flight`) gets k[u, s], the micro-batches
        it keeps there (0 unless z[u, s]): the time and memory of :meth:`~autosplit.solver.problem.Recompute.partly`, as tables."""
        p, S = self.p, self.p.num_stages
        self.r: list[Any] = []
        self.k: dict[tuple[int, int], Any] = {}
        self.extra_time: list[Any] = [0] * S
        self.extra_mem: list[Any] = [0] * S  # the activations it no longer holds (at its in-flight count)
        self.reserve: Any = 0
        z: dict[tuple[int, int], Any] = {}
        for u, block in enumerate(p.recompute):
            r = self.m.new_bool_var(f"r_{u}")
            if block.forced is not None:
                self.m.add(r == int(block.forced))
            self.r.append(r)
            first = block.members[0]
            for n in block.members[1:]:
                if self.b[n] is not self.b[first]:
                    for k in range(1, S):
                        self.m.add(self.b[n][k] == self.b[first][k]).only_enforce_if(r)
            for s in range(S):
                zz = z[u, s] = self.m.new_bool_var(f"z_{u}_{s}")
                inside = self.inside(first, s)
                self.m.add(zz <= r)
                self.m.add(zz <= inside)
                self.m.add(zz >= r + inside - 1)
                self.extra_time[s] += block.compute[s] * zz
                self.extra_mem[s] -= block.saves[s] * zz
                window = block.in_flight[s] if self.partial and block.in_flight and block.forced is None else 1
                if window > 1:
                    kk = self.k[u, s] = self.m.new_int_var(0, window - 1, f"k_{u}_{s}")
                    self.m.add(kk <= (window - 1) * zz)
                    ways = [block.partly(s, keep, p.micro_batches) for keep in range(window)]
                    time_back = self.m.new_int_var(0, block.compute[s], f"kt_{u}_{s}")
                    mem_back = self.m.new_int_var(0, block.saves[s], f"km_{u}_{s}")
                    self.m.add_element(kk, [block.compute[s] - w.compute[s] for w in ways], time_back)
                    self.m.add_element(kk, [block.saves[s] - w.saves[s] for w in ways], mem_back)
                    self.extra_time[s] -= time_back
                    self.extra_mem[s] += mem_back
        if p.recompute:  # one reserve for every stage, as the cost table keeps one transient reserve
            self.reserve = self.m.new_int_var(0, max(b.room for b in p.recompute), "reserve")
            for u, block in enumerate(p.recompute):
                self.m.add(self.reserve >= block.room * self.r[u])

    def recomputed(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        return tuple(u for u, r in enumerate(self.r) if solver.value(r))

    def kept(self, solver: cp_model.CpSolver) -> dict[int, tuple[int, int]]:
        """Block → (its stage, micro-batches it keeps there), for the blocks that keep some."""
        return {u: (s, solver.value(k)) for (u, s), k in self.k.items() if solver.value(k) > 0}

    def _time(self) -> None:
        p, S, N = self.p, self.p.num_stages, len(self.p.nodes)
        boundary = [0] + [
            p.boundary_latency[k - 1] + sum(p.transfer[u][k - 1] * y for (u, kk), y in self.y.items() if kk == k)
            for k in range(1, S)
        ] + [0]
        self.stage_time = [
            sum(p.compute[n][s] * self.inside(n, s) for n in range(N)) + (boundary[s] if s > 0 else 0) + boundary[s + 1]
            + self.extra_time[s]
            for s in range(S)
        ]
        fastest = [min(row) for row in p.compute]
        upper = sum(max(row) for row in p.compute) + sum(sum(row) for row in p.transfer) + sum(p.boundary_latency)
        upper += sum(max(block.compute) for block in p.recompute)
        lower = max(math.ceil(sum(fastest) / S), max(fastest, default=0))
        self.T = self.m.new_int_var(lower, max(lower, upper), "T")
        for t in self.stage_time:
            self.m.add(self.T >= t)
        if p.steady:
            self.objective = p.micro_batches * self.T
            return
        if p.stages_per_rank == 1:
            self.objective = sum(self.stage_time) + (p.micro_batches - 1) * self.T
            return
        rank_T = self.m.new_int_var(lower, max(lower, upper), "rank_T")  # each rank's stages' times summed
        for r in range(p.ranks):
            self.m.add(rank_T >= sum(t for s, t in enumerate(self.stage_time) if p.rank(s) == r))
        self.objective = p.micro_batches * rank_T + (p.ranks - 1) * self.T

    def held(self, s: int):
        """Stage s's activations at its in-flight count (what a rank holds a share of at each of its moments)."""
        return sum(self.p.act_mem[n][s] * self.inside(n, s) for n in range(len(self.p.nodes))) + self.extra_mem[s]

    def memory(self, s: int):
        p = self.p
        mem = p.transient_mem + self.reserve + sum(p.state_mem[n] * self.inside(n, s) for n in range(len(p.nodes))) + self.held(s)
        if s > 0:
            mem += sum(p.recv_mem[u][s] * y for (u, k), y in self.y.items() if k == s)
        if s < p.num_stages - 1 and p.send_mem:
            mem += sum(p.send_mem[u][s] * y for (u, k), y in self.y.items() if k == s + 1)
        return mem

    def _rank_caps(self, rank: int, mine: list[int]) -> list[Any]:
        """The rank's cap over its stages ``mine``: their memory with one transient reserve; with several
        stages, their activations at each moment the rank may peak
        (:attr:`~autosplit.solver.problem.Problem.peak_weights`, scaled by L to stay in integers)."""
        p = self.p
        whole = sum(self.memory(t) for t in mine) - (len(mine) - 1) * (p.transient_mem + self.reserve)  # one reserve per rank
        if not p.peak_weights:
            return [whole <= p.capacity[mine[0]]]
        L, moments = p.peak_weights[rank]
        held = [self.held(t) for t in mine]
        rest = whole - sum(held)
        return [L * rest + sum(w * h for w, h in zip(weights, held)) <= L * p.capacity[mine[0]] for weights in moments]

    def add_assumptions(self, caps: bool = True) -> list[tuple[cp_model.IntVar, int | str]]:
        """Memory caps (unless ``caps=False``) and user constraints, each behind a literal:
        (literal, stage index or constraint text)."""
        guarded: list[tuple[cp_model.IntVar, int | str]] = []
        p = self.p
        for s in range(p.num_stages if caps else 0):
            mine = [t for t in range(p.num_stages) if p.rank(t) == p.rank(s)]
            if s != mine[0]:
                continue  # a rank's cap is guarded once, at its first stage
            lit = self.m.new_bool_var(f"cap_{s}")
            for constraint in self._rank_caps(p.rank(s), mine):
                self.m.add(constraint).only_enforce_if(lit)
            guarded.append((lit, s))
        for i, c in enumerate(self.p.constraints):
            lit = self.m.new_bool_var(f"user_{i}")
            for n, s in c.forbid:
                self.m.add(self.inside(n, s) == 0).only_enforce_if(lit)
            for a, b in zip(c.together, c.together[1:]):
                for k in range(1, self.p.num_stages):
                    self.m.add(self.b[a][k] == self.b[b][k]).only_enforce_if(lit)
            guarded.append((lit, c.text))
        self.m.add_assumptions([lit for lit, _ in guarded])
        return guarded

    def hint(self, stage_of: tuple[int, ...], recompute: Collection[int] = ()) -> None:
        for u, r in enumerate(self.r):
            self.m.add_hint(r, int(u in recompute))
        seen = set()
        for n, s in enumerate(stage_of):
            row = self.b[n]
            if id(row) in seen:
                continue
            seen.add(id(row))
            for k in range(1, self.p.num_stages):
                self.m.add_hint(row[k], int(s >= k))

    def stage_of(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        S = self.p.num_stages
        return tuple(sum(solver.value(self.b[n][k]) for k in range(1, S)) for n in range(len(self.p.nodes)))


def cp_solver(
    time_limit: float, seed: int, workers: int | None, deterministic: bool = True, gap: float = PROVEN_GAP,
    wall: float | None = None,
) -> cp_model.CpSolver:
    """A seeded solver whose answer does not depend on timing: workers run interleaved and stop
    at a deterministic-time limit (half the wall-clock one, which on this kind of machine ends
    first), or once the plan is proven within ``gap`` of optimal (by default :data:`PROVEN_GAP`,
    0.1%; the planner passes :attr:`~autosplit.options.PlanOptions.gap`; the report shows the gap).
    The wall-clock limit is the hard stop users asked for (``wall``: what building the model left of
    it; the deterministic limit stays a function of ``time_limit`` alone, so every rank stops at the
    same point). ``deterministic=False`` runs the workers in parallel instead: stronger without a
    hint, but timing decides the answer."""
    from ortools.sat.python import cp_model  # deferred: OR-Tools (and the pandas it imports) load when a search first runs

    solver = cp_model.CpSolver()
    solver.parameters.random_seed = int(seed)
    solver.parameters.num_workers = workers or min(8, max(2, os.cpu_count() or 1))
    if deterministic:
        solver.parameters.interleave_search = True
        solver.parameters.max_deterministic_time = float(time_limit) / 2
    solver.parameters.max_time_in_seconds = float(time_limit if wall is None else max(0.01, min(wall, time_limit)))
    solver.parameters.relative_gap_limit = float(gap)
    return solver


def explain_infeasible(problem: Problem, core: Sequence[int | str], time_limit: float, seed: int) -> str:
    """Why no plan exists, in the user's terms, leading with the real cause.

    A core is sufficient, not minimal: it may name memory caps and constraints together.
    So the problem is first solved with the caps dropped: if it is still infeasible, the
    user constraints that conflict lead the message (or, with none, the pipeline's own
    structure: too few independent units for the devices); otherwise memory is the cause, and
    the message gives each capped stage's cap and the least any plan needs.
    """
    conflict = _without_caps(problem, time_limit, seed)
    if conflict:
        return advice(
            "these placement constraints cannot all hold: " + "; ".join(conflict),
            "each of them is needed for the conflict, given that every device runs one non-empty stage and "
            "stages follow the graph's order (memory is not the cause: without the caps they still conflict)",
            "drop or relax one of them",
        )
    if conflict is not None:
        return advice(
            f"the {problem.num_stages} devices cannot each get a non-empty stage, whatever the memory",
            "the calls of a shared module, and every node on a path between them, must share one stage (so must "
            "an in-place write and the tensor it writes), which leaves fewer independent parts than devices",
            "use fewer devices",
        )
    rules = [c for c in core if isinstance(c, str)]
    caps = [c for c in core if isinstance(c, int)]
    return explain_memory(problem, caps, time_limit, seed, constraints=rules)


def _without_caps(problem: Problem, time_limit: float, seed: int) -> list[str] | None:
    """None when a plan exists with the memory caps dropped; else the user constraints in the conflict (maybe none)."""
    model = _Model(problem)
    guarded = model.add_assumptions(caps=False)
    solver = cp_solver(time_limit, seed, None)
    if solver.status_name(solver.solve(model.m)) != "INFEASIBLE":
        return None
    index = {lit.Index(): what for lit, what in guarded}
    return [str(index[i]) for i in solver.sufficient_assumptions_for_infeasibility() if i in index]


def explain_memory(
    problem: Problem, core: list[int], time_limit: float, seed: int, constraints: Sequence[str] = ()
) -> str:
    """No plan fits the caps of the ``core`` stages (all when empty): the least peak memory any
    plan reaches on its fullest device (caps ignored), against those caps; ``constraints``: the
    user constraints that take part in the conflict."""
    core = core or list(range(problem.num_stages))
    model = _Model(problem)
    most = problem.transient_mem + sum(problem.state_mem) + sum(map(max, problem.act_mem)) + sum(map(max, problem.recv_mem))
    most += sum(map(max, problem.send_mem))
    peak = model.m.new_int_var(0, most, "peak")
    for s in range(problem.num_stages):
        model.m.add(peak >= model.memory(s))
    model.m.minimize(peak)
    # No hint exists for this model, and interleaved search rarely finds a first solution
    # without one; an explanation need not be reproducible, so search in parallel.
    solver = cp_solver(time_limit, seed, None, deterministic=False)
    status = solver.status_name(solver.solve(model.m))
    caps = ", ".join(f"stage {s} on {problem.devices[s]} (cap {_kib(problem.capacity[s])})" for s in core)
    least = _kib(solver.value(peak)) if status in ("OPTIMAL", "FEASIBLE") else "unknown"
    bound = _kib(int(solver.best_objective_bound)) if status == "FEASIBLE" else least
    return advice(
        f"no plan fits the memory caps of {caps}: the least memory any plan needs on its fullest device is "
        f"{least} (proven lower bound {bound}), against the largest cap {_kib(max(problem.capacity))}",
        "parameters + gradients + optimizer state + saved activations exceed what the devices hold"
        + (f", with the constraints {'; '.join(constraints)}" if constraints else ""),
        "raise the caps (memory={...}), add devices, use schedule='1f1b' with more micro-batches, "
        "a smaller batch, or optimizer='sgd'",
    )


def _kib(kib: int) -> str:
    return format_bytes(kib * KIB)


def precheck(problem: Problem) -> None:
    N, S = len(problem.nodes), problem.num_stages
    if S > N:
        raise InfeasiblePlanError(advice(
            f"{S} devices but only {N} graph nodes to place", "every stage needs at least one node",
            f"use at most {N} devices",
        ))
    units = N - sum(len(g) - 1 for g in problem.colocate)
    if S > units:
        raise InfeasiblePlanError(advice(
            f"{S} devices but only {units} independent units to place",
            "nodes sharing parameters or writing each other's tensors in place stay together",
            f"use at most {units} devices",
        ))
    largest = max(problem.capacity)
    for group, need in memory_units(problem):
        if need > largest:
            n = group[0]
            together = f", colocated with {len(group) - 1} more nodes" if len(group) > 1 else ""
            raise InfeasiblePlanError(advice(
                f"node '{problem.nodes[n]}' (module '{problem.labels[n]}'{together}) alone needs {_kib(need)} "
                f"but the largest device cap is {_kib(largest)}",
                "its parameters, gradients, optimizer state and activations cannot be split across devices",
                "raise the cap, use optimizer='sgd', or split that module's parameters",
            ))


def cpsat(
    problem: Problem,
    hint: Sequence[int] | None,
    *,
    time_limit: float,
    seed: int,
    workers: int | None,
    deterministic: bool = True,
    hint_recompute: Collection[int] = (),
    recomputed: list[int] | None = None,
    kept: dict[int, tuple[int, int]] | None = None,
    partial: bool = True,
    gap: float = PROVEN_GAP,
) -> tuple[str, tuple[int, ...] | None, float, list[int | str]]:
    """Run the model: (status, assignment or None, best bound, the infeasibility core).

    The core lists what conflicts: stage indices for memory caps, texts for user constraints. With
    :attr:`Problem.recompute` blocks, ``hint_recompute`` are the hinted ones, the blocks the plan
    recomputes are appended to ``recomputed`` and those that keep some micro-batches put in ``kept``
    (block → (stage, micro-batches kept)); ``partial=False`` leaves that choice out of the model
    (its bound then holds only for blocks recomputed whole). ``gap``: stop once the plan is proven
    within this fraction of optimal (:func:`cp_solver`).
    """
    started = time.perf_counter()
    model = _Model(problem, partial)
    guarded = model.add_assumptions()
    if hint is not None:
        model.hint(tuple(hint), hint_recompute)
    model.m.minimize(model.objective)
    solver = cp_solver(time_limit, seed, workers, deterministic, gap, wall=time_limit - (time.perf_counter() - started))
    name = solver.status_name(solver.solve(model.m))
    log.info("cp-sat: %s in %.2fs, %d nodes x %d stages, bound %s", name, solver.wall_time,
             len(problem.nodes), problem.num_stages, solver.best_objective_bound)
    if name in ("OPTIMAL", "FEASIBLE"):
        if recomputed is not None:
            recomputed.extend(model.recomputed(solver))
        if kept is not None:
            kept.update(model.kept(solver))
        return name, model.stage_of(solver), solver.best_objective_bound, []
    core: list[int | str] = []
    if name == "INFEASIBLE":
        index = {lit.Index(): what for lit, what in guarded}
        core = [index[i] for i in solver.sufficient_assumptions_for_infeasibility() if i in index]
    return name, None, solver.best_objective_bound, core
