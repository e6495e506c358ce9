"""Pass progress for front ends: the compiler announces each pass, a front end may listen.

Library code only announces (and logs); the command line turns the announcements into rich
progress bars on a terminal (:mod:`autosplit.cli`).

Usage::

    with progress.listen(lambda event, name, limit: ...):   # event: "start" or "end"
        planner.plan()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from autosplit import debug

__all__ = ["Listener", "listen", "phase", "timed_pass"]

Listener = Callable[[str, str, "float | None"], None]
"""``(event, pass name, time limit in seconds or None)``; event is ``"start"`` or ``"end"``."""

_listener: ContextVar[Listener | None] = ContextVar("autosplit_progress", default=None)


@contextmanager
def listen(listener: Listener) -> Iterator[None]:
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)


@contextmanager
def phase(name: str, limit: float | None = None) -> Iterator[None]:
    listener = _listener.get()
    if listener is not None:
        listener("start", name, limit)
    try:
        yield
    finally:
        if listener is not None:
            listener("end", name, limit)


@contextmanager
def timed_pass(name: str, timings: dict[str, float], limit: float | None = None) -> Iterator[None]:
    """Run one named pass: announce it, record its seconds in ``timings[name]`` and log them
    (``AUTOSPLIT_DEBUG=1``)."""
    start = time.perf_counter()
    with phase(name, limit):
        yield
    timings[name] = time.perf_counter() - start
    debug.pass_times.info("pass %-9s %8.3fs", name, timings[name])
