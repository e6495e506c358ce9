"""Comparison: autosplit's plan and each manual split on the same footing, as tables (text,
JSON, HTML). Made by :func:`autosplit.compare`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from autosplit.candidates import Candidate
from autosplit.plans import Plan
from autosplit.report.html import render
from autosplit.units import format_bytes
from autosplit.units import format_ms as _ms

__all__ = ["Comparison"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Comparison:
    """autosplit's plan (first) and each manual split, on the same footing."""

    candidates: tuple[Candidate, ...]

    @property
    def autosplit(self) -> Plan:
        plan = self.candidates[0].plan
        assert plan is not None
        return plan

    @property
    def bound(self) -> float:
        """The solver's proven lower bound on the objective of any plan of autosplit's objective
        under this cost model (seconds)."""
        return self.autosplit.solver.bound

    def table(self, width: int = 400) -> str:
        from rich.console import Console
        from rich.table import Table

        measured = any(c.measured for c in self.candidates)
        auto = self.autosplit
        table = Table(title=f"autosplit vs manual splits on {math.prod(auto.mesh.values())} devices")
        columns = ["split", "feasible", "mesh", "schedule", "predicted step", "vs autosplit", "objective", "bottleneck stage",
                   "stage times (ms)", "memory / cap"]
        if measured:
            columns += ["measured", "min–max (ms)", "runtime", "its prediction", "error"]
        for col in columns:
            left = col in ("split", "feasible", "mesh", "schedule", "stage times (ms)", "memory / cap", "runtime")
            table.add_column(col, justify="left" if left else "right", no_wrap=True)
        for c in self.candidates:
            if c.plan is None:
                table.add_row(c.name, "no (below)", *[""] * (len(columns) - 2))
                continue
            p = c.plan
            row = [
                c.name, "yes" if c.feasible else "no: over a cap", _mesh(p), _schedule(p), _ms(p.step_time),
                f"{p.step_time / auto.step_time:.3f}×",
                _ms(p.solver.objective), str(p.bottleneck), " ".join(f"{st.time * 1e3:.2f}" for st in p.stages),
                ", ".join(f"{format_bytes(st.memory)}/{format_bytes(st.capacity)}" for st in p.stages),
            ]
            if measured:
                m = c.measured
                row += [""] * 5 if m is None else [
                    _ms(m.median), f"{m.min * 1e3:.2f}–{m.max * 1e3:.2f}", m.runtime, _ms(m.predicted), f"{m.error:+.1%}",
                ]
            table.add_row(*row)
        out = io.StringIO()
        console = Console(file=out, width=width, force_terminal=False, color_system=None)
        console.print(table)
        for c in self.candidates:
            if c.plan is not None and c.plan.solver.status != "MANUAL":
                sv = c.plan.solver
                console.print(f"{c.name}: solver bound {_ms(sv.bound)}, no {_objective(c.plan)} plan's objective (the solver's "
                              f"model of the step) is lower; gap {sv.gap:.2%} ({sv.status})")
        for c in self.candidates:
            for line in c.over_cap:
                console.print(f"{c.name}: {line}")
            if c.error:
                console.print(f"{c.name}: {c.error}")
        if measured and any(c.plan is not None and c.plan.objective == "makespan" and c.measured is None for c in self.candidates):
            console.print("makespan plans are measured in one process (MakespanRunner), not under a process group")
        if measured and any(c.measured and c.measured.runtime == "local" for c in self.candidates):
            console.print("local: one process runs the stages in turn, the whole batch at once; "
                          "its prediction is the sum of the stages' compute")
        return out.getvalue().rstrip()

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return {
            "bound": self.bound,
            "candidates": [
                {
                    "name": c.name, "feasible": c.feasible, "error": c.error, "over_cap": list(c.over_cap),
                    "plan": c.plan.to_dict() if c.plan is not None else None,
                    "measured": dataclasses.asdict(c.measured) if c.measured is not None else None,
                }
                for c in self.candidates
            ],
        }

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    def to_html(self, path: str | Path) -> Path:
        """Write the report (the compare view, then each candidate's plan) as one self-contained HTML file."""

        out = Path(path)
        out.write_text(render(self.candidates, title="autosplit: compare"))
        return out


def _objective(plan: Plan) -> str:
    return plan.objective


def _mesh(plan: Plan) -> str:
    """The mesh's degrees above 1, pp always: ``pp 2 × dp_shard 4``."""
    return " × ".join(f"{dim} {n}" for dim, n in plan.mesh.items() if n > 1 or dim == "pp")


def _schedule(plan: Plan) -> str:
    return "makespan, 1 micro-batch" if plan.objective == "makespan" else f"{plan.schedule} × {plan.micro_batches}"
