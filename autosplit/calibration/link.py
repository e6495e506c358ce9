"""Point-to-point latency and bandwidth between two processes over ``torch.distributed``
(gloo here, NCCL between GPUs), fitted as ``latency + bytes / bandwidth``.

Usage::

    link = measure_link()          # LinkMeasurement(bandwidth=..., latency=...)
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autosplit.calibration.pair import free_port, run_pair
from autosplit.errors import CostModelError, advice

__all__ = ["fit_allreduce", "fit_link", "LinkMeasurement", "measure_link", "ping_pong"]


@dataclass(frozen=True)
class LinkMeasurement:
    """One link, fitted as ``latency + bytes / bandwidth`` from ping-pong round trips."""

    bandwidth: float
    """Bytes/s, one direction."""
    latency: float
    """Seconds per message."""
    backend: str
    samples: tuple[tuple[int, float], ...]
    """(bytes, median one-way seconds) per message size."""

    def apply(self, spec):
        """``spec`` (a :class:`~autosplit.devices.DeviceSpec`) with this link's bandwidth and latency."""
        return dataclasses.replace(spec, link_bandwidth=self.bandwidth, link_latency=self.latency)


def ping_pong(
    rank: int, port: int, backend: str, sizes: Sequence[int], repeats: int, out: str, allreduce_out: str | None = None,
) -> None:
    """Rank 0 saves ``(bytes, one-way seconds)`` per size to ``out``; with ``allreduce_out``, also
    ``(bytes, median seconds)`` of an ``all_reduce`` of each size over the two ranks (the sizes interleaved)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        bufs = [torch.empty(max(n // 4, 1), dtype=torch.float32, device=device) for n in sizes]
        trips: list[list[float]] = [[] for _ in sizes]
        # Rounds visit every size in turn, so a burst of load elsewhere on the machine lands
        # on all sizes alike instead of tilting the line through one of them.
        for round_ in range(repeats + 2):
            for buf, times in zip(bufs, trips):
                dist.barrier()
                t0 = time.perf_counter_ns()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if backend == "nccl":
                    torch.cuda.synchronize(device)
                if round_ >= 2:  # the first rounds set up the connection
                    times.append((time.perf_counter_ns() - t0) / 1e9)
        if rank == 0:
            torch.save([(buf.numel() * 4, min(times) / 2) for buf, times in zip(bufs, trips)], out)
        if allreduce_out is not None:
            reduces: list[list[float]] = [[] for _ in sizes]
            for round_ in range(repeats + 2):
                for buf, times in zip(bufs, reduces):
                    dist.barrier()
                    t0 = time.perf_counter_ns()
                    dist.all_reduce(buf)
                    if backend == "nccl":
                        torch.cuda.synchronize(device)
                    if round_ >= 2:
                        times.append((time.perf_counter_ns() - t0) / 1e9)
            if rank == 0:
                torch.save([(buf.numel() * 4, statistics.median(times)) for buf, times in zip(bufs, reduces)], allreduce_out)
    finally:
        dist.destroy_process_group()


def measure_link(
    *, backend: str = "gloo", sizes: Sequence[int] = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20),
    repeats: int = 10,
) -> LinkMeasurement:
    """Measure point-to-point transfers between two local processes and fit the link model.

    Two processes (fresh interpreters, one thread each) bounce a message of every size ``repeats``
    times, the sizes interleaved; the one-way time is half the fastest round trip (load
    elsewhere only ever adds time). The line through the smallest and the largest message
    gives ``bandwidth`` (its inverse slope) and ``latency`` (the smallest message's time
    less its bytes): a least-squares fit would let one noisy middle size tilt the slope,
    even below zero, on a busy machine. ``backend="nccl"`` measures between ``cuda:0``
    and ``cuda:1``. Raises :class:`~autosplit.errors.CostModelError` when the largest
    message was not slower than the smallest, which only a machine too busy to measure
    on produces.
    """
    if len(set(sizes)) < 2:
        raise CostModelError(advice(
            f"measure_link needs at least two distinct message sizes, got {tuple(sizes)}",
            "bandwidth and latency are the slope and intercept of a line through them", "pass sizes=(4 << 10, 16 << 20)",
        ))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "link.pt")
        run_pair("ping_pong", [free_port(), backend, list(sizes), repeats, out], f"measure_link over {backend}")
        rows = torch.load(out)
    return fit_link(rows, backend, repeats)


def fit_link(rows: Sequence[Sequence[float]], backend: str, repeats: int) -> LinkMeasurement:
    """The line through the smallest and the largest message of ``(bytes, one-way seconds)`` rows."""
    pairs = [(int(n), float(t)) for n, t in rows]
    (small, t_small), (large, t_large) = min(pairs), max(pairs)
    if t_large <= t_small:
        raise CostModelError(advice(
            f"the link measurement over {backend} is noise: a {large}-byte message took {t_large * 1e6:.0f} us one way, "
            f"no longer than a {small}-byte one ({t_small * 1e6:.0f} us)", "other work on the machine delayed the transfers",
            f"measure on a quiet machine or with more repeats (repeats={repeats})",
        ))
    bandwidth = (large - small) / (t_large - t_small)
    return LinkMeasurement(
        bandwidth=bandwidth, latency=max(t_small - small / bandwidth, 0.0), backend=backend, samples=tuple(pairs)
    )


def fit_allreduce(rows: Sequence[Sequence[float]], backend: str, repeats: int) -> LinkMeasurement:
    """One hop of a ring all-reduce, from ``(bytes, seconds)`` of all-reduces over two ranks: the
    line through the smallest and the largest (:func:`fit_link`) is ``bytes / bandwidth + 2 ·
    latency`` for a ring of two (:func:`~autosplit.solver.hybrid.ring_allreduce`). Their median,
    not their fastest, is fitted: a step waits for the all-reduce it gets, which on CPU ranks
    includes waking the backend's threads on cores that are computing."""
    line = fit_link(rows, backend, repeats)
    return dataclasses.replace(line, latency=line.latency / 2)
