"""``AUTOSPLIT_DEBUG``: what autosplit logs, by level, in one place.

- ``1``: each pass with its time (capture, annotate, estimate, …, codegen);
- ``2``: also every library log line (the solver's progress and status) and each plan's report;
- ``3``: also each stage's generated Python code.

Library code logs through :data:`pass_times`, :data:`plans` and :data:`stage_code` (or its own
module logger, shown from level 2); :func:`configure` attaches one handler to the ``autosplit``
logger. Without the variable, autosplit adds only a ``NullHandler``: the application decides.

Usage::

    AUTOSPLIT_DEBUG=2 python train.py
"""

from __future__ import annotations

import logging
import os

__all__ = ["configure", "level", "pass_times", "plans", "stage_code"]

pass_times = logging.getLogger("autosplit.debug.passes")
"""One line per pass and its seconds (level 1)."""
plans = logging.getLogger("autosplit.debug.plans")
"""Each plan's report (level 2)."""
stage_code = logging.getLogger("autosplit.debug.stage_code")
"""Each stage's generated code (level 3)."""


def level() -> int:
    """The level ``AUTOSPLIT_DEBUG`` asks for (0: off; a value that is not a number counts as 1)."""
    value = os.environ.get("AUTOSPLIT_DEBUG", "").strip()
    if not value:
        return 0
    return int(value) if value.isdigit() else 1


def configure(at: int | None = None) -> None:
    """Show autosplit's logs on stderr up to level ``at`` (default: the environment's)."""
    at = level() if at is None else at
    root = logging.getLogger("autosplit")
    if at <= 0:
        return
    shown = {1: {pass_times.name}, 2: None}.get(at, None)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[autosplit] %(name)s: %(message)s"))
    if shown is not None:
        handler.addFilter(lambda record: record.name in shown)
    elif at == 2:
        handler.addFilter(lambda record: record.name != stage_code.name)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
