"""Measurements: what running the code actually costs (DESIGN §2: a *measurement*, not a cost).

- :func:`timed` — seconds of a call, warm-up then repeats, the median: CUDA events on a GPU,
  the monotonic ``perf_counter_ns`` clock on the CPU.
- :class:`MemoryTracker` — live and peak bytes of tensor storages on the CPU (a dispatch
  mode; GPUs use the caching allocator's statistics instead). Written here because
  ``torch.distributed._tools.MemTracker`` is private, refuses a module called twice (every
  pipeline does that, once per micro-batch) and rounds sizes to the CUDA allocator's blocks.
- :func:`pinned` — run with the threads (and CPU cores) a stage will have, so that a
  profile is taken under the conditions of the run.
- :func:`measure_link` — point-to-point latency and bandwidth between two processes over
  ``torch.distributed`` (gloo here, NCCL between GPUs), fitted as ``latency + bytes / bandwidth``.
- :func:`measure_runtime` — the link, and the pipeline runtime's fixed cost per micro-batch,
  fitted from a tiny two-stage ``torch.distributed.pipelining`` run (cached on disk).

Both start their two processes as fresh interpreters running this module's own entry point
(:func:`_pair`), not ``multiprocessing`` copies of the caller's ``__main__``: a script calls them
without an ``if __name__ == "__main__":`` guard.

Usage::

    fwd = timed(lambda: layer(x), device="cpu", warmup=2, repeats=5)
    with MemoryTracker() as mem:
        loss(model(x)).backward()
    link = measure_link()          # LinkMeasurement(bandwidth=..., latency=...)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autosplit.errors import ConstraintError, CostModelError, advice

__all__ = [
    "timed", "MemoryTracker", "pinned", "LinkMeasurement", "measure_link", "RuntimeMeasurement", "measure_runtime",
    "StageMeasurement", "measure_stages", "steady_allocator",
]

_log = logging.getLogger(__name__)


def timed(
    fn: Callable[..., Any], *, device: str = "cpu", warmup: int = 2, repeats: int = 5,
    setup: Callable[[], Any] | None = None,
) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs.

    ``setup`` runs untimed before every call and its result is passed to ``fn``.
    """
    cuda = torch.device(device).type == "cuda"
    samples = []
    for i in range(warmup + repeats):
        args = (setup(),) if setup is not None else ()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn(*args)
            end.record()
            torch.cuda.synchronize(device)
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter_ns()
            fn(*args)
            elapsed = (time.perf_counter_ns() - t0) / 1e9
        if i >= warmup:
            samples.append(elapsed)
    return statistics.median(samples)


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created inside it (plus those given to :meth:`track`).

    Every op's outputs are seen through ``__torch_dispatch__``; a storage counts once
    (views share it) and stops counting when it is freed (a weak reference to it dies).
    Backward on the CPU runs on the calling thread, so gradients are seen too.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def track(self, *values: Any) -> None:
        """Count tensors that already exist (parameters, inputs) as live."""
        for t in pytree.tree_leaves(values):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage())

    def reset_peak(self) -> None:
        self.peak = self.current

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key == 0 or key in self._live:
            return
        self._live[key] = storage.nbytes()
        self.current += self._live[key]
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage())
        return out


def steady_allocator(trim_threshold: int = 1 << 30, mmap_threshold: int = 32 << 20) -> bool:
    """Keep freed memory in this process instead of handing it back to the kernel (glibc's
    ``mallopt``; the same as starting with ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_``).

    A CPU training step frees and reallocates the same large tensors every micro-batch. By
    default glibc returns memory above 128 KiB to the kernel when it is freed and faults it in
    again on the next use, which on this project's 2-core VM made a process that had planned
    first run its training steps measurably slower (``benchmarks/pipeline_runtime.py`` calls
    this for every process it times). Process-wide, so it is the caller's choice; returns
    ``False`` where there is no glibc ``mallopt``.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_trim_threshold, trim_threshold)) and bool(mallopt(m_mmap_threshold, mmap_threshold))


@contextlib.contextmanager
def pinned(threads: int | None, cores: Sequence[int] | None = None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads on ``cores`` (Linux), restoring both after."""
    old_threads = torch.get_num_threads()
    old_cores = os.sched_getaffinity(0) if cores is not None and hasattr(os, "sched_getaffinity") else None
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        if old_cores is not None and cores is not None:
            os.sched_setaffinity(0, set(cores))
        yield
    finally:
        torch.set_num_threads(old_threads)
        if old_cores is not None:
            os.sched_setaffinity(0, old_cores)


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


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (held open together, so the system gives different ones)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


_WORKERS = ("_ping_pong", "_tiny_pipeline", "_link_and_pipeline")


def _pair(worker: str, args: list[Any], what: str, *, timeout: float = 600.0) -> None:
    """Run ``worker(rank, *args)`` (a function of this module) on ranks 0 and 1, each a fresh
    interpreter, and wait for both.

    ``python -c`` with this module's entry point, not ``torch.multiprocessing.spawn``: spawning
    re-imports the caller's ``__main__`` in every child, so a script without an
    ``if __name__ == "__main__":`` guard would start the measurement again inside each child.
    A rank that fails ends the other (which would wait for its peer until the timeout) and
    raises :class:`~autosplit.errors.CostModelError` with the end of its stderr.
    """
    root = str(Path(__file__).resolve().parents[1])  # the folder holding autosplit/, for a checkout run in place
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a caller under torchrun: the pair is a process group of its own
    code = "import sys; from autosplit.measure import _worker_main; _worker_main(sys.argv[1:])"
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


def _worker_main(argv: Sequence[str]) -> None:
    """Entry point of one process of :func:`_pair`: ``WORKER RANK JSON-ARGS``."""
    worker, rank, args = argv
    if worker not in _WORKERS:
        raise CostModelError(advice(
            f"autosplit.measure: unknown worker {worker!r}", f"this entry point runs {sorted(_WORKERS)} only",
            "start measurements through measure_link or measure_runtime",
        ))
    globals()[worker](int(rank), *json.loads(args))


def _ping_pong(rank: int, port: int, backend: str, sizes: Sequence[int], repeats: int, out: str) -> None:
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
        _pair("_ping_pong", [_free_port(), backend, list(sizes), repeats, out], f"measure_link over {backend}")
        rows = torch.load(out)
    return _fit_link(rows, backend, repeats)


def _fit_link(rows: Sequence[Sequence[float]], backend: str, repeats: int) -> LinkMeasurement:
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


@dataclass(frozen=True)
class StageMeasurement:
    """What one stage of a split module took in a training step, run on its own."""

    forward: float
    """Seconds of forward for the whole batch (sum over micro-batches, median over steps)."""
    backward: float
    peak_bytes: int
    """Peak bytes live during a step: state, optimizer state, received inputs, activations."""

    @property
    def time(self) -> float:
        return self.forward + self.backward


def _stage_inputs(split, micro: Sequence[tuple[tuple, dict]]) -> list[list[tuple]]:
    """[stage][micro-batch] the arguments each stage receives (and whether each needs a gradient)."""
    records: list[list[tuple]] = [[] for _ in split.stages]

    def keep(t: Any) -> Any:
        return t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    hooks = [
        stage.register_forward_pre_hook(lambda mod, args, s=s: records[s].append(pytree.tree_map(keep, args)))
        for s, stage in enumerate(split.stages)
    ]
    try:
        for args, kwargs in micro:
            split(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return records


def measure_stages(
    split, micro_batches: Sequence[tuple[tuple, dict]], *, steps: int = 3, warmup: int = 1,
    threads: int | None = 1, cores: Sequence[int] | None = None, optimizer: str = "adam",
) -> list[StageMeasurement]:
    """Run every stage of ``split`` alone through GPipe training steps and measure it.

    ``micro_batches`` holds the (args, kwargs) of each micro-batch of one step. Each stage
    gets the inputs it receives in the real run (recorded first), runs the forward of
    every micro-batch, then every backward (with output gradients of ones), then an
    optimizer step: the GPipe schedule of one stage, with no waiting for its neighbours.
    Time is the median over ``steps`` after ``warmup`` steps, under ``threads`` pinned to
    ``cores`` as a stage process would run; peak memory is from :class:`MemoryTracker` over
    one step taken after the optimizer state exists.

    Usage::

        micro = split_batch((x,), {}, split.plan.micro_batches)   # autosplit.runtime.microbatch
        stages = measure_stages(split, micro)                     # [StageMeasurement] per stage
    """
    _check_measure_stages(split, micro_batches, steps, warmup, threads)
    records = _stage_inputs(split, micro_batches)
    results = []
    for stage, inputs in zip(split.stages, records):
        params = [p for p in stage.parameters() if p.requires_grad]
        opt = _optimizer(optimizer, params)
        fwd_s, bwd_s = [], []
        with pinned(threads, cores):
            for step in range(warmup + steps + 1):
                tracker = MemoryTracker() if step == warmup + steps else None
                with tracker or contextlib.nullcontext():
                    if tracker is not None:
                        tracker.track(params, [p.grad for p in params], opt.state_dict()["state"], inputs)
                    fwd, bwd = _gpipe_step(stage, inputs, opt)
                if tracker is not None:
                    peak = tracker.peak
                elif step >= warmup:
                    fwd_s.append(fwd)
                    bwd_s.append(bwd)
        results.append(StageMeasurement(statistics.median(fwd_s), statistics.median(bwd_s), peak))
    return results


def _check_measure_stages(split: Any, micro_batches: Any, steps: Any, warmup: Any, threads: Any) -> None:
    """:func:`measure_stages`' arguments, checked before anything runs."""
    from autosplit.runtime.local import SplitModule

    if not isinstance(split, SplitModule):
        raise ConstraintError(advice(
            f"measure_stages(split=...) got a {type(split).__name__}, not a SplitModule",
            "it runs each stage of a split built in this process alone",
            "pass the module autosplit.autosplit(model, devices, example_inputs=...) returns",
        ))
    how = ("pass split_batch((x,), {}, split.plan.micro_batches) (from autosplit.runtime.microbatch), "
           "or a list of ((x_i,), {}) pairs, one per micro-batch")
    if isinstance(micro_batches, (str, bytes, Mapping)) or not isinstance(micro_batches, Sequence):
        raise ConstraintError(advice(
            f"measure_stages(split, micro_batches=...) got {type(micro_batches).__name__} {_short(micro_batches)}, "
            "not a list of micro-batches",
            "it takes the inputs of every micro-batch of one step, each an (args, kwargs) pair, "
            "not a count of micro-batches", how,
        ))
    if not micro_batches:
        raise ConstraintError(advice(
            "measure_stages(split, micro_batches=[]) got no micro-batches", "a step runs at least one micro-batch", how,
        ))
    for i, item in enumerate(micro_batches):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], (tuple, list))
                and isinstance(item[1], Mapping)):
            raise ConstraintError(advice(
                f"measure_stages: micro_batches[{i}] is {type(item).__name__} {_short(item)}, not an (args, kwargs) pair",
                "each micro-batch is the positional arguments (a tuple) and keyword arguments (a dict) of one forward call",
                how,
            ))
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0), ("threads", threads, 1)):
        if value is None and name == "threads":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConstraintError(advice(
                f"measure_stages: {name}={value!r} is not an integer ≥ {least}",
                "steps are timed steps, warmup untimed ones before them, threads the intra-op threads of a stage",
                "e.g. steps=3, warmup=1, threads=1 (threads=None keeps the current count)",
            ))


def _short(value: Any, limit: int = 60) -> str:
    """``value`` for a message: a tensor by its shape, anything else by its repr, cut to ``limit``."""
    if isinstance(value, torch.Tensor):
        return f"of shape {tuple(value.shape)}"
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if not params:
        return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    if name in ("adam", "adamw"):
        return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9 if name == "sgd_momentum" else 0.0)


def _gpipe_step(stage: torch.nn.Module, inputs: list[tuple], opt: torch.optim.Optimizer) -> tuple[float, float]:
    """All forwards, all backwards, one optimizer step; returns (forward s, backward s)."""

    def fresh(t):  # a new leaf per step, as a received tensor is
        return t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    outs, fwd, bwd = [], 0.0, 0.0
    for args in inputs:
        args = pytree.tree_map(fresh, args)
        t0 = time.perf_counter_ns()
        out = stage(*args)
        fwd += (time.perf_counter_ns() - t0) / 1e9
        outs.append([t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad])
    for tensors in outs:
        t0 = time.perf_counter_ns()
        if tensors:
            torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
        bwd += (time.perf_counter_ns() - t0) / 1e9
    del outs
    opt.step()
    opt.zero_grad(set_to_none=True)
    return fwd, bwd


@dataclass(frozen=True)
class RuntimeMeasurement:
    """What the pipeline runtime adds around compute, measured on two processes: the link, and a
    fixed cost per micro-batch and stage (schedule bookkeeping, send/recv set-up, autograd entry)."""

    link: LinkMeasurement
    microbatch_overhead: float
    """Seconds per micro-batch and stage (forward + backward) beyond compute and link time."""
    samples: tuple[tuple[int, float], ...]
    """(micro-batches, median step seconds) of the tiny two-stage pipeline it was fitted from."""

    def apply(self, spec):
        """``spec`` with this link and this per-micro-batch overhead."""
        return dataclasses.replace(self.link.apply(spec), microbatch_overhead=self.microbatch_overhead)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RuntimeMeasurement:
        link = data["link"]
        return cls(
            LinkMeasurement(link["bandwidth"], link["latency"], link["backend"], tuple(map(tuple, link["samples"]))),
            data["microbatch_overhead"], tuple(map(tuple, data["samples"])),
        )


def _tiny_pipeline(rank: int, port: int, backend: str, counts: Sequence[int], steps: int, cores: bool, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe

    from autosplit.runtime.stage import EarlyReceivingStage  # the stage distribute() runs

    torch.set_num_threads(1)
    if cores and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > rank:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
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


def _link_and_pipeline(
    rank: int, ports: Sequence[int], backend: str, sizes: Sequence[int], repeats: int, counts: Sequence[int], steps: int,
    cores: bool, link_out: str, pipeline_out: str,
) -> None:
    """:func:`_ping_pong`, then :func:`_tiny_pipeline`, in one process (a process group each)."""
    _ping_pong(rank, ports[0], backend, sizes, repeats, link_out)
    _tiny_pipeline(rank, ports[1], backend, counts, steps, cores, pipeline_out)


def measure_runtime(
    *, backend: str = "gloo", cache: bool = True, cache_dir: str | None = None, pin_cores: bool = True
) -> RuntimeMeasurement:
    """Measure the link (:func:`measure_link`) and the pipeline runtime's fixed cost per micro-batch.

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
    path = root / "runtime" / f"{backend}-{platform.node()}-{torch.__version__}-v2.json"  # v2: receives posted early
    if cache and path.exists():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return RuntimeMeasurement.from_dict(json.loads(path.read_text()))
    counts, sizes, repeats = (2, 16), (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20), 10
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, "link.pt"), os.path.join(tmp, "runtime.pt")]
        # One pair of processes for both measurements: starting one (importing torch) costs seconds.
        _pair("_link_and_pipeline", [_free_ports(2), backend, list(sizes), repeats, list(counts), 20, pin_cores, *outs],
              f"measure_runtime over {backend}")
        link = _fit_link(torch.load(outs[0]), backend, repeats)
        got = torch.load(outs[1])
    (m0, t0), (m1, t1) = got["rows"]
    per_micro = (t1 - t0) / (m1 - m0)
    # Every receive of a step is posted when it begins (EarlyReceivingStage), so the link's
    # latency is off the critical path here: what a micro-batch adds beyond compute is the runtime's own work.
    overhead = max(per_micro - got["compute"], 0.0)
    result = RuntimeMeasurement(link, overhead, tuple(got["rows"]))
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict()))
    return result
