"""The HTML report: one self-contained file (inline CSS and SVG; no script, no network).

For each plan: the solver's status, bound and gap; the pipeline timeline as a Gantt chart of
forward and backward work per micro-batch per stage, bubbles hatched (:mod:`autosplit.report.timeline`);
memory per device as stacked bars — state, activations, received, sent, transient — against
its cap; the module tree coloured by stage; the stage table; predicted beside measured where
measured. With several candidates, the compare view comes first. The page is laid out here,
as numbers; ``templates/report.html.j2`` (jinja2) only draws it.

Usage::

    write_html("plan.html", plan)
    autosplit.compare(...).to_html("compare.html")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autosplit import schedules
from autosplit.candidates import Candidate
from autosplit.plans import Plan
from autosplit.report.timeline import bubbles, timeline
from autosplit.units import format_bytes, format_ms

__all__ = ["render", "write_html", "STAGE_COLOURS"]

STAGE_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999")
"""Okabe & Ito's colour-blind-safe palette, one colour per stage (cycled)."""

WIDTH = 840  # drawing width of the charts, px
ROW = 22  # height of one stage's row, px
LEFT = 70  # room for the row labels, px
MEMORY_PARTS = (("state", "params + grads + optimizer + buffers"), ("activations", "saved for backward"),
                ("received", "inputs from the previous stage"), ("sent", "outputs held for their gradients"),
                ("transient", "largest op's scratch"))


def colour(stage: int) -> str:
    return STAGE_COLOURS[stage % len(STAGE_COLOURS)]


@dataclass
class Rect:
    x: float
    y: float
    w: float
    h: float
    cls: str
    fill: str = ""
    title: str = ""
    label: str = ""


@dataclass
class TreeNode:
    name: str
    path: str
    stages: tuple[int, ...]
    children: list[TreeNode] = field(default_factory=list)

    @property
    def swatch(self) -> str:
        """CSS background: the stage's colour, or equal stripes of each stage's."""
        if len(self.stages) == 1:
            return colour(self.stages[0])
        step = 100 / len(self.stages)
        stops = ", ".join(f"{colour(s)} {i * step:.0f}% {(i + 1) * step:.0f}%" for i, s in enumerate(self.stages))
        return f"linear-gradient(90deg, {stops})"


def _ticks(end: float, width: float) -> list[tuple[float, str]]:
    """About six round time ticks over ``[0, end]`` seconds, as (x, label in ms)."""
    if end <= 0:
        return [(0.0, "0")]
    raw = end * 1e3 / 6
    step = min((m * 10**e for e in range(-6, 7) for m in (1, 2, 5) if m * 10**e >= raw), default=raw)
    ticks, t = [], 0.0
    while t <= end * 1e3 + 1e-12:
        ticks.append((LEFT + t / 1e3 / end * width, f"{t:g}"))
        t += step
    return ticks


def _timeline_view(plan: Plan) -> dict[str, Any]:
    tasks = timeline(plan)
    end = max((t.end for t in tasks), default=0.0) or 1e-12
    scale = WIDTH / end
    rects = []
    for t in tasks:
        what = t.kind if t.kind == "optimizer" else f"{t.kind} of micro-batch {t.micro}"
        w = (t.end - t.start) * scale
        rects.append(Rect(
            LEFT + t.start * scale, t.row * ROW + 2, max(w, 0.5), ROW - 4, f"task {t.kind}", colour(t.stage),
            f"stage {t.stage}: {what}, {t.start * 1e3:.3f}–{t.end * 1e3:.3f} ms",
            str(t.micro) if t.micro >= 0 and w > 14 else "",
        ))
    gaps = [
        Rect(LEFT + a * scale, s * ROW + 2, (b - a) * scale, ROW - 4, "bubble",
             title=f"{'rank' if plan.stages_per_rank > 1 else 'stage'} {s} idle {(b - a) * 1e3:.3f} ms")
        for s, a, b in bubbles(tasks) if (b - a) * scale >= 0.5
    ]
    work = max((t.end for t in tasks if t.kind != "optimizer"), default=0.0)
    busy = sum(t.end - t.start for t in tasks if t.kind != "optimizer")
    rows = sorted({t.row for t in tasks}) or [0]
    several = plan.stages_per_rank > 1
    return {
        "tasks": rects, "bubbles": gaps, "ticks": _ticks(end, WIDTH), "height": len(rows) * ROW + 24,
        "width": LEFT + WIDTH + 10,
        "rows": [(r * ROW + ROW / 2 + 4, f"rank {r}" if several else f"stage {r}") for r in rows],
        "end": end, "bubble_share": 1 - busy / (work * len(rows)) if work else 0.0,
        "asynchronous": plan.objective == "pipeline" and schedules.lookup(plan.schedule).asynchronous,
    }


def _memory_view(plan: Plan) -> dict[str, Any]:
    stages = plan.stages
    most = max((st.memory for st in stages), default=1) or 1
    caps = [st.capacity for st in stages]
    axis = max(most, max(caps)) if max(caps) <= 4 * most else most * 1.15
    scale = WIDTH / axis
    bars, caplines = [], []
    for s, st in enumerate(stages):
        x = float(LEFT)
        for part, meaning in MEMORY_PARTS:
            nbytes = getattr(st, f"memory_{part}")
            w = nbytes * scale
            bars.append(Rect(x, s * ROW + 3, w, ROW - 6, f"mem mem-{part}", title=f"stage {s} {part} ({meaning}): {format_bytes(nbytes)}"))
            x += w
        on_scale = st.capacity <= axis
        caplines.append({
            "x": LEFT + st.capacity * scale if on_scale else LEFT + WIDTH, "y": s * ROW, "on_scale": on_scale,
            "label": f"{format_bytes(st.memory)} of {format_bytes(st.capacity)}" + ("" if on_scale else " (cap off scale)"),
            "over": st.memory > st.capacity,
        })
    return {"bars": bars, "caps": caplines, "height": len(stages) * ROW + 6, "width": LEFT + WIDTH + 260,
            "rows": [(s * ROW + ROW / 2 + 4, f"stage {s}") for s in range(len(stages))]}


def _tree(plan: Plan) -> TreeNode | None:
    if not plan.module_stages:
        return None
    root = TreeNode("(model)", "", tuple(plan.module_stages.get("", ())))
    nodes = {"": root}
    for path, stages in plan.module_stages.items():  # in graph order, each module after its parent
        if path:
            nodes[path] = TreeNode(path.rsplit(".", 1)[-1], path, tuple(stages))
            nodes[path.rsplit(".", 1)[0] if "." in path else ""].children.append(nodes[path])
    return root


def _entry(candidate: Any, index: int) -> dict[str, Any]:
    plan: Plan | None = candidate.plan
    view: dict[str, Any] = {"index": index, "name": candidate.name, "error": candidate.error,
                            "over_cap": list(candidate.over_cap), "measured": candidate.measured, "plan": plan}
    if plan is not None:
        view.update(timeline=_timeline_view(plan), memory=_memory_view(plan), tree=_tree(plan),
                    colours=[colour(s) for s in range(len(plan.stages))])
    return view


def _compare_view(candidates: Sequence[Any]) -> dict[str, Any]:
    plans = [c for c in candidates if c.plan is not None]
    values = [c.plan.step_time for c in plans] + [c.measured.median for c in plans if c.measured]
    top = max(values, default=1.0) or 1.0
    scale = WIDTH / top
    bars, y = [], 0
    for c in plans:
        bars.append(Rect(LEFT + 60, y, c.plan.step_time * scale, 9, "bar-predicted",
                         title=f"{c.name} predicted {c.plan.step_time * 1e3:.3f} ms"))
        if c.measured:
            bars.append(Rect(LEFT + 60, y + 10, c.measured.median * scale, 9, "bar-measured",
                             title=f"{c.name} measured {c.measured.median * 1e3:.3f} ms ({c.measured.runtime})"))
        y += 26
    return {"bars": bars, "height": y + 4, "width": LEFT + WIDTH + 80,
            "labels": [(13 + 26 * i, c.name) for i, c in enumerate(plans)]}


def render(candidates: Sequence[Any], *, title: str = "autosplit plan") -> str:
    """The report of ``candidates`` (objects with ``name``, ``plan``, ``error``, ``over_cap`` and
    ``measured``, as :class:`autosplit.candidates.Candidate`) as one HTML page."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("autosplit.report", "templates"), autoescape=True, trim_blocks=True, lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["ms"] = format_ms
    env.filters["bytes"] = format_bytes
    env.filters["px"] = lambda v: f"{v:.1f}"
    entries = [_entry(c, i) for i, c in enumerate(candidates)]
    return env.get_template("report.html.j2").render(
        title=title, entries=entries, compare=_compare_view(candidates) if len(candidates) > 1 else None,
        parts=MEMORY_PARTS, left=LEFT, width=WIDTH,
    )


def write_html(path: str | Path, plan: Plan) -> Path:
    """Write the report of one plan to ``path``."""
    out = Path(path)
    out.write_text(render([Candidate(plan.solver.name, plan)], title="autosplit plan"))
    return out
