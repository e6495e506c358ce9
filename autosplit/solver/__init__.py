"""The placement solver: a plain :class:`Problem` in, an assignment out. No torch, no fx,
nothing from ``autosplit.passes``.

Objectives are an axis over the same :class:`Problem`, :mod:`~autosplit.solver.coarsen` and
:mod:`~autosplit.solver.validate`: :mod:`autosplit.solver.pipeline` (contiguous stages,
GPipe/1F1B step time) and :mod:`autosplit.solver.makespan` (DLPlacer: tasks with start
times on any device, one step's makespan). How much work either may do before it coarsens or
skips CP-SAT is one value, :class:`~autosplit.options.SolverLimits`.
"""

from autosplit.options import SolverLimits
from autosplit.solver.build import build_problem, in_flight
from autosplit.solver.evaluation import Evaluation, evaluate
from autosplit.solver.pipeline.bounds import lower_bound
from autosplit.solver.pipeline.dp import split_dp, topological_order
from autosplit.solver.pipeline.order import choose_order
from autosplit.solver.pipeline.strategy import Solution, solve
from autosplit.solver.problem import Problem
from autosplit.solver.validate import validate, violations

__all__ = [
    "Evaluation", "Problem", "Solution", "SolverLimits",
    "build_problem", "choose_order", "evaluate", "in_flight", "lower_bound", "solve", "split_dp",
    "topological_order", "validate", "violations",
]
