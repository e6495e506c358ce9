"""Reports: they read plans (data) and draw them, as text, HTML and timelines.

- :mod:`.text` — :func:`plan_report`, the partition report;
- :mod:`.html` — :func:`write_html`, one self-contained page (``templates/report.html.j2``);
- :mod:`.timeline` — a plan's schedule simulated task by task;
- :mod:`.compare` — :class:`~.compare.Comparison`, autosplit's plan beside manual splits.
"""

from autosplit.report.html import write_html
from autosplit.report.text import plan_report

__all__ = ["plan_report", "write_html"]
