"""The pipeline objective (DESIGN §4.3–4.4): contiguous stages of a topological order,
step ``(Σ_s t_s + (M − 1)·max_s t_s)/M``.

- :mod:`.dp` — the exact split DP over one order (banded), the baseline, hint and fallback;
- :mod:`.cpsat` — the ordered-stage CP-SAT model (its mathematics in the module docstring);
- :mod:`.bounds` — analytic and chain lower bounds on the time;
- :mod:`.memory` — the memory floors, and the proof that no plan fits the caps;
- :mod:`.recompute_bound` — the time bound with what the caps force every plan to recompute;
- :mod:`.layers` — the split at layer boundaries with each stage's recomputation costed;
- :mod:`.order` — which device takes which stage;
- :mod:`.strategy` — how they combine into :func:`solve`.
"""

from autosplit.solver.pipeline.bounds import lower_bound
from autosplit.solver.pipeline.dp import split_dp, topological_order
from autosplit.solver.pipeline.order import choose_order
from autosplit.solver.pipeline.strategy import Solution, solve

__all__ = ["Solution", "choose_order", "lower_bound", "solve", "split_dp", "topological_order"]
