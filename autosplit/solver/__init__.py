"""The placement solver: a plain :class:`Problem` in, an assignment out. No torch, no fx."""

from autosplit.solver.cpsat import Solution, balanced_split, solve
from autosplit.solver.problem import Evaluation, Problem, build_problem, evaluate, in_flight
from autosplit.solver.validate import validate, violations

__all__ = [
    "Problem", "Evaluation", "Solution",
    "build_problem", "evaluate", "in_flight", "solve", "balanced_split", "validate", "violations",
]
