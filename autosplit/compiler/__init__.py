"""The compiler: the named, timed steps from a captured model to a plan, and from a plan to stages.

- :mod:`.trace` — steps *capture* and *annotate* (:class:`~.trace.Traced`, once per model and shape);
- :mod:`.steps` — :func:`~.steps.compile_plan` (*estimate* → *order* → *build* → *solve* →
  *validate*) and :func:`~.steps.codegen`;
- :mod:`.recost` — a saved plan validated and re-costed under other costs, no solving;
- :mod:`.costs` — the cost table ``PlanOptions.costs`` asks for;
- :mod:`.constraints` — ``pin`` / ``avoid`` / ``together`` as rules over nodes;
- :mod:`.prediction` — the predicted step (its terms) and per-stage figures;
- :mod:`.makespan` — the makespan objective's build and solve;
- :mod:`.manual` — the splits users write by hand, as plans;
- :mod:`.hybrid` — the hybrid planner's rows from worker plans.
"""

__all__ = []
