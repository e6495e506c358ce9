"""The pipeline runtime's fixed cost per micro-batch, fitted on a traced two-stage
``torch.distributed.pipelining`` run, beside the link's and the all-reduce's measurements (cached on disk).

Usage::

    spec = measure_runtime().apply(autosplit.devices.resolve_devices(["cpu"])[0])
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from autosplit import schedules
from autosplit.calibration.link import LinkMeasurement, fit_allreduce, fit_link, ping_pong
from autosplit.calibration.pair import free_ports, run_pair
from autosplit.schedules import Action
from autosplit.solver.replay import measured_durations, replay

__all__ = ["fit_overhead", "link_and_pipeline", "measure_runtime", "RuntimeMeasurement", "tiny_pipeline"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeMeasurement:
    """What the pipeline runtime adds around compute, measured on two processes: the link, and a
    fixed cost per micro-batch and stage (schedule bookkeeping, send/recv set-up, autograd entry)."""

    link: LinkMeasurement
    microbatch_overhead: float
    """Seconds per micro-batch and stage (its forward and its backward: half each) beyond compute and link time."""
    samples: tuple[tuple[int, float], ...]
    """(micro-batches, median seconds from a step's start to its last action's end) of the tiny
    two-stage pipeline it was fitted from."""
    allreduce: LinkMeasurement | None = None
    """One hop of the backend's ring all-reduce between the two processes (:func:`fit_allreduce`)."""

    def apply(self, spec):
        """``spec`` with this link, this per-micro-batch overhead and this all-reduce."""
        spec = dataclasses.replace(self.link.apply(spec), microbatch_overhead=self.microbatch_overhead)
        if self.allreduce is not None:
            spec = dataclasses.replace(spec, allreduce_bandwidth=self.allreduce.bandwidth, allreduce_latency=self.allreduce.latency)
        return spec

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RuntimeMeasurement:
        def line(d: dict) -> LinkMeasurement:
            return LinkMeasurement(d["bandwidth"], d["latency"], d["backend"], tuple(map(tuple, d["samples"])))

        allreduce = data.get("allreduce")
        return cls(line(data["link"]), data["microbatch_overhead"], tuple(map(tuple, data["samples"])),
                   None if allreduce is None else line(allreduce))


def _pin(rank: int) -> None:
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > rank:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})


TINY_WIDTH, TINY_ROWS = 256, 256
"""The calibration pipeline's stage: a ``Linear(256, 256)`` on micro-batches of 256 rows — a 256 KiB
crossing and about a millisecond of compute per pass, so that a rank receives while it computes. On
CPU ranks of one core each, what a crossing costs beyond the link's ping-pong time grows with its
size (the receiving core must leave its compute to take it in); the overhead fitted here holds it
for crossings of this size, the transformer blocks' of the benchmarks."""


def tiny_pipeline(rank: int, port: int, backend: str, counts: Sequence[int], steps: int, cores: bool, out: str) -> None:
    """Rank 0 saves, per micro-batch count, every timed step's ``(start, spans)`` of both ranks
    (:class:`~autosplit.runtime.stage.Span`) of a two-stage GPipe pipeline of :data:`TINY_WIDTH`."""
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe

    from autosplit.runtime.stage import EarlyReceivingStage  # the stage distribute() runs

    torch.set_num_threads(1)
    if cores:
        _pin(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        module = torch.nn.Linear(TINY_WIDTH, TINY_WIDTH)
        meta = (torch.empty(TINY_ROWS, TINY_WIDTH, device="meta").requires_grad_(True),)
        rows: dict[int, list] = {}
        for m in counts:
            stage = EarlyReceivingStage(
                module, rank, 2, torch.device("cpu"), input_args=() if rank == 0 else meta, output_args=meta
            )
            schedule = ScheduleGPipe(stage, n_microbatches=m, loss_fn=lambda out, t: out.sum())
            x, rows[m] = torch.randn(m * TINY_ROWS, TINY_WIDTH), []
            for i in range(steps + 3):
                stage.timeline = []
                dist.barrier()
                t0 = time.perf_counter()
                schedule.step(x) if rank == 0 else schedule.step(target=x)
                if i >= 3:
                    rows[m].append((t0, [tuple(span) for span in stage.timeline]))
        both: list = [None, None]
        dist.all_gather_object(both, rows)
        if rank == 0:
            torch.save(both, out)
    finally:
        dist.destroy_process_group()


def fit_overhead(
    actions: Sequence[Sequence[Action]], rank_of: Sequence[int], spans: Sequence[tuple[str, int, int, float, float]],
    start: float, delay: Sequence[float],
) -> float:
    """The seconds ``o`` each action takes beyond its measured span such that replaying the
    schedule's ``actions`` with the step's own durations plus ``o`` and the link's ``delay``
    per crossing ends when the step's last action ended (measured from ``start``): the runtime's
    work between actions (the schedule's bookkeeping, posting sends, waking for a receive). The
    replay only grows with ``o``, so bisection finds it; 0 when the replay alone ends later."""
    seconds = measured_durations(spans)
    end = max(e for *_, e in spans) - start

    def replayed(o: float) -> float:
        return replay(actions, rank_of=rank_of, durations={k: t + o for k, t in seconds.items()}, delay=delay).step

    low, high = 0.0, end
    if replayed(low) >= end:
        return 0.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if replayed(mid) < end else (low, mid)
    return low


def link_and_pipeline(
    rank: int, ports: Sequence[int], backend: str, sizes: Sequence[int], repeats: int, counts: Sequence[int], steps: int,
    cores: bool, link_out: str, allreduce_out: str, pipeline_out: str,
) -> None:
    """:func:`ping_pong` (with all-reduces), then :func:`tiny_pipeline`, in one process (a process
    group each), pinned to a core of its own as pipeline ranks run (``cores``): on one core, the
    backend's threads wait for the compute thread's time slice, which an all-reduce feels most."""
    if cores:
        _pin(rank)
    ping_pong(rank, ports[0], backend, sizes, repeats, link_out, allreduce_out)
    tiny_pipeline(rank, ports[1], backend, counts, steps, cores, pipeline_out)


def measure_runtime(
    *, backend: str = "gloo", cache: bool = True, cache_dir: str | None = None, pin_cores: bool = True
) -> RuntimeMeasurement:
    """Measure the link (:func:`~autosplit.calibration.link.measure_link`), the backend's all-reduce (:func:`fit_allreduce`) and
    the pipeline runtime's fixed cost per micro-batch.

    Two processes (one thread each, pinned to their own cores) run a two-stage GPipe pipeline of
    a small linear layer (:func:`tiny_pipeline`) and record when each forward and backward ran.
    Replaying each step's own durations with the link's transfer time ends before the step did;
    the overhead per action that closes the gap (:func:`fit_overhead`, the median over steps) is
    the runtime's own work, and a micro-batch's forward and backward on a stage pay it twice
    (``microbatch_overhead``). Fitted on a step's own spans, it does not depend on how fast the
    machine computes at that moment. The result is cached on disk (``$AUTOSPLIT_CACHE`` or
    ``~/.cache/autosplit``, keyed by backend, host, torch version); ``cache=False`` measures again.
    Apply it to a device with ``measurement.apply(spec)``.
    """
    import platform

    root = Path(cache_dir or os.environ.get("AUTOSPLIT_CACHE") or Path.home() / ".cache" / "autosplit")
    path = root / "runtime" / f"{backend}-{platform.node()}-{torch.__version__}-v4.json"  # v4: all-reduce; overhead fitted on spans
    if cache and path.exists():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return RuntimeMeasurement.from_dict(json.loads(path.read_text()))
    counts, sizes, repeats = (8,), (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20), 10
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, "link.pt"), os.path.join(tmp, "allreduce.pt"), os.path.join(tmp, "runtime.pt")]
        # One pair of processes for both measurements: starting one (importing torch) costs seconds.
        run_pair("link_and_pipeline", [free_ports(2), backend, list(sizes), repeats, list(counts), 20, pin_cores, *outs],
              f"measure_runtime over {backend}")
        link = fit_link(torch.load(outs[0]), backend, repeats)
        allreduce = fit_allreduce(torch.load(outs[1]), backend, repeats)
        got = torch.load(outs[2])
    crossing = link.latency + TINY_ROWS * TINY_WIDTH * 4 / link.bandwidth
    fits, samples = [], []
    for m in counts:
        actions = schedules.lookup("gpipe").actions(2, m)
        steps = list(zip(got[0][m], got[1][m]))
        fits += [fit_overhead(actions, (0, 1), spans0 + spans1, min(t0, t1), [crossing]) for (t0, spans0), (t1, spans1) in steps]
        samples.append((m, statistics.median(max(e for *_, e in s0 + s1) - min(t0, t1) for (t0, s0), (t1, s1) in steps)))
    overhead = 2 * statistics.median(fits)
    result = RuntimeMeasurement(link, overhead, tuple(samples), allreduce)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict()))
    return result
