"""The pipeline runtime's fixed cost per micro-batch, fitted from a tiny two-stage
``torch.distributed.pipelining`` run beside a link measurement (cached on disk).

Usage::

    spec = measure_runtime().apply(autosplit.DeviceSpec.cpu())
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

from autosplit.calibration.link import LinkMeasurement, fit_allreduce, fit_link, ping_pong
from autosplit.calibration.pair import free_ports, run_pair
from autosplit.timers import timed

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeMeasurement:
    """What the pipeline runtime adds around compute, measured on two processes: the link, and a
    fixed cost per micro-batch and stage (schedule bookkeeping, send/recv set-up, autograd entry)."""

    link: LinkMeasurement
    microbatch_overhead: float
    """Seconds per micro-batch and stage (forward + backward) beyond compute and link time."""
    samples: tuple[tuple[int, float], ...]
    """(micro-batches, median step seconds) of the tiny two-stage pipeline it was fitted from."""
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


def tiny_pipeline(rank: int, port: int, backend: str, counts: Sequence[int], steps: int, cores: bool, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe

    from autosplit.runtime.stage import EarlyReceivingStage  # the stage distribute() runs

    torch.set_num_threads(1)
    if cores:
        _pin(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        width = 8
        module = torch.nn.Linear(width, width)
        meta = (torch.empty(1, width, device="meta").requires_grad_(True),)
        rows = []
        for m in counts:
            stage = EarlyReceivingStage(
                module, rank, 2, torch.device("cpu"), input_args=() if rank == 0 else meta, output_args=meta
            )
            schedule = ScheduleGPipe(stage, n_microbatches=m, loss_fn=lambda out, t: out.sum())
            x, times = torch.randn(m, width), []
            for i in range(steps + 3):
                dist.barrier()
                t0 = time.perf_counter_ns()
                schedule.step(x) if rank == 0 else schedule.step(target=x)
                if i >= 3:
                    times.append((time.perf_counter_ns() - t0) / 1e9)
            rows.append((m, statistics.median(times)))
        # The compute inside: one micro-batch's forward + backward of the stage module.
        x = torch.randn(1, width, requires_grad=True)
        compute = timed(lambda: module(x).sum().backward(), warmup=5, repeats=50)
        if rank == 0:
            torch.save({"rows": rows, "compute": compute}, out)
    finally:
        dist.destroy_process_group()


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
    """Measure the link (:func:`measure_link`), the backend's all-reduce (:func:`fit_allreduce`) and
    the pipeline runtime's fixed cost per micro-batch.

    Two processes (one thread each, pinned to their own cores) run a two-stage GPipe pipeline of a
    tiny linear layer with 2 and 16 micro-batches: its step is ``(S + M − 1) · τ`` with
    ``τ = compute + overhead`` per micro-batch (the receives are posted early, so the link's
    latency overlaps), so the slope over ``M`` gives ``τ`` and the overhead is what remains of
    it. The result is cached on disk (``$AUTOSPLIT_CACHE`` or ``~/.cache/autosplit``, keyed by
    backend, host, torch version); ``cache=False`` measures again.
    Apply it to a device with ``measurement.apply(spec)``.
    """
    import platform

    root = Path(cache_dir or os.environ.get("AUTOSPLIT_CACHE") or Path.home() / ".cache" / "autosplit")
    path = root / "runtime" / f"{backend}-{platform.node()}-{torch.__version__}-v3.json"  # v3: with the all-reduce
    if cache and path.exists():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return RuntimeMeasurement.from_dict(json.loads(path.read_text()))
    counts, sizes, repeats = (2, 16), (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20), 10
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, "link.pt"), os.path.join(tmp, "allreduce.pt"), os.path.join(tmp, "runtime.pt")]
        # One pair of processes for both measurements: starting one (importing torch) costs seconds.
        run_pair("link_and_pipeline", [free_ports(2), backend, list(sizes), repeats, list(counts), 20, pin_cores, *outs],
              f"measure_runtime over {backend}")
        link = fit_link(torch.load(outs[0]), backend, repeats)
        allreduce = fit_allreduce(torch.load(outs[1]), backend, repeats)
        got = torch.load(outs[2])
    (m0, t0), (m1, t1) = got["rows"]
    per_micro = (t1 - t0) / (m1 - m0)
    # Every receive of a step is posted when it begins (EarlyReceivingStage), so the link's
    # latency is off the critical path here: what a micro-batch adds beyond compute is the runtime's own work.
    overhead = max(per_micro - got["compute"], 0.0)
    result = RuntimeMeasurement(link, overhead, tuple(got["rows"]), allreduce)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict()))
    return result
