"""Two fresh interpreters running one measurement worker, ranks 0 and 1 of a process group of their own.

The calibrations start their processes as fresh interpreters running this module's entry point
(:func:`run_pair`), not ``multiprocessing`` copies of the caller's ``__main__``: a script calls them
without an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autosplit.errors import CostModelError, advice

__all__ = ["free_port", "free_ports", "run_pair", "worker_main"]

_log = logging.getLogger(__name__)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (held open together, so the system gives different ones)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


_WORKERS = {
    "ping_pong": "autosplit.calibration.link",
    "link_and_pipeline": "autosplit.calibration.overhead",
}
"""Each worker a process of the pair may run, and the module that defines it."""


def run_pair(worker: str, args: list[Any], what: str, *, timeout: float = 600.0) -> None:
    """Run ``worker(rank, *args)`` (one of :data:`_WORKERS`) on ranks 0 and 1, each a fresh
    interpreter, and wait for both.

    ``python -c`` with this module's entry point, not ``torch.multiprocessing.spawn``: spawning
    re-imports the caller's ``__main__`` in every child, so a script without an
    ``if __name__ == "__main__":`` guard would start the measurement again inside each child.
    A rank that fails ends the other (which would wait for its peer until the timeout) and
    raises :class:`~autosplit.errors.CostModelError` with the end of its stderr.
    """
    root = str(Path(__file__).resolve().parents[2])  # the folder holding autosplit/, for a checkout run in place
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a caller under torchrun: the pair is a process group of its own
    code = "import sys; from autosplit.calibration.pair import worker_main; worker_main(sys.argv[1:])"
    with tempfile.TemporaryDirectory() as tmp:
        logs = [Path(tmp) / f"rank{rank}.log" for rank in (0, 1)]
        procs = []
        for rank, log in enumerate(logs):
            with open(log, "wb") as sink:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", code, worker, str(rank), json.dumps(args)],
                    stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env,
                ))
        deadline, failed = time.monotonic() + timeout, None
        try:
            while any(p.poll() is None for p in procs) and failed is None:
                failed = next((r for r, p in enumerate(procs) if p.returncode not in (None, 0)), None)
                if time.monotonic() > deadline:
                    raise CostModelError(advice(
                        f"{what}: its two processes did not finish in {timeout:.0f} s",
                        "a process is stuck (the machine is overloaded, or the port was taken)", "run it again",
                    ))
                time.sleep(0.05)
            failed = next((r for r, p in enumerate(procs) if p.returncode not in (None, 0)), failed)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        if failed is not None:
            output = logs[failed].read_text(errors="replace").strip()
            _log.debug("%s: output of rank %d:\n%s", what, failed, output)
            # The exception's own line: the last one a traceback does not indent.
            last = next((line for line in reversed(output.splitlines()) if line and not line[0].isspace()), "no output")
            raise CostModelError(advice(
                f"{what}: rank {failed} of its two processes exited with code {procs[failed].returncode}: {last}",
                "the measuring process raised this (a backend this machine lacks, a port taken, a broken install)",
                "set AUTOSPLIT_DEBUG=1 to log its whole output, fix the cause, and measure again",
            ))


def worker_main(argv: Sequence[str]) -> None:
    """Entry point of one process of :func:`run_pair`: ``WORKER RANK JSON-ARGS``."""
    worker, rank, args = argv
    if worker not in _WORKERS:
        raise CostModelError(advice(
            f"autosplit.calibration.pair: unknown worker {worker!r}", f"this entry point runs {sorted(_WORKERS)} only",
            "start measurements through measure_link or measure_runtime",
        ))
    getattr(importlib.import_module(_WORKERS[worker]), worker)(int(rank), *json.loads(args))
