"""The command line's processes: torchrun launches, progress bars and output on rank 0, each error printed once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["REPORTS", "bars", "emit", "first_to_report", "init_process_group", "launch", "rank"]


# -- progress bars and ranks -------------------------------------------------------------------
def rank() -> int:
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def bars() -> Iterator[None]:
    """rich progress bars for the compiler's passes, on a terminal and on rank 0 only."""
    if not sys.stderr.isatty() or rank() != 0:
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from autosplit import progress

    bars = Progress(SpinnerColumn(), TextColumn("{task.description:<10}"), BarColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)
    running: dict[str, tuple[Any, threading.Event]] = {}

    def tick(task: Any, limit: float, stop: threading.Event) -> None:  # a solve's bar fills over its time limit
        start = time.monotonic()
        while not stop.wait(0.1):
            bars.update(task, completed=min(time.monotonic() - start, limit))

    def listener(event: str, name: str, limit: float | None) -> None:
        if event == "start":
            task, stop = bars.add_task(name, total=limit), threading.Event()
            running[name] = (task, stop)
            if limit:
                threading.Thread(target=tick, args=(task, limit, stop), daemon=True).start()
        elif name in running:
            task, stop = running.pop(name)
            stop.set()
            bars.update(task, total=1, completed=1)

    with bars, progress.listen(listener):
        yield


def launch(argv: list[str], nproc: int) -> int | None:
    """Start this command under torchrun with ``nproc`` processes, unless already in it."""
    if "RANK" in os.environ:
        return None
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # torchrun sets one intra-op thread per process unless told otherwise, and prints a banner
    # saying so; setting the same default here keeps the choice and drops the banner.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="autosplit-errors-") as reports:
        os.environ[REPORTS] = reports  # the ranks print each distinct error once (see first_to_report)
        try:  # the processes run the same command; with RANK set, they do not launch again
            torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "autosplit", *argv])
        except ChildFailedError as e:  # the ranks printed their errors; exit as the first failed rank did
            return next(iter(e.failures.values())).exitcode or 1
        finally:
            os.environ.pop(REPORTS, None)
    return 0


REPORTS = "AUTOSPLIT_ERROR_REPORTS"
"""A folder shared by the ranks of one launch, where each distinct error is claimed by the first
rank that prints it."""


def first_to_report(message: str) -> bool:
    """Whether this process prints ``message``: always outside torchrun; under it, only the first
    rank with this exact message (every rank usually fails alike: a bad workload or option), so
    a launch prints each distinct error once. The ranks of ``autosplit run`` share the folder
    :func:`launch` made; under a torchrun started by hand, the ranks of one node share one keyed
    by the run and the launching agent's process."""
    import hashlib
    import tempfile

    if "RANK" not in os.environ:
        return True
    folder = os.environ.get(REPORTS) or os.path.join(
        tempfile.gettempdir(), "autosplit-errors", f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.getppid()}"
    )
    try:
        os.makedirs(folder, exist_ok=True)
        claim = os.path.join(folder, hashlib.sha1(message.encode()).hexdigest()[:16])
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False  # another rank printed it
    except OSError:
        return True  # no shared folder: better twice than never
    return True


def init_process_group() -> None:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def emit(args: argparse.Namespace, text: str, data: Any) -> None:
    if rank() == 0:
        print(json.dumps(data, indent=1) if args.json else text)
