"""The placement solver: a plain :class:`Problem` in, an assignment out. No torch, no fx."""

from autosplit.solver.dp import split_dp, topological_order
from autosplit.solver.problem import Evaluation, Problem, build_problem, evaluate, in_flight
from autosplit.solver.bounds import lower_bound
from autosplit.solver.strategy import Solution, solve
from autosplit.solver.validate import validate, violations

__all__ = [
    "Problem", "Evaluation", "Solution",
    "build_problem", "evaluate", "in_flight", "lower_bound", "solve", "split_dp", "topological_order",
    "validate", "violations",
]
