"""Profile: measured forward/backward time and memory of every node on a real device.

The analytic roofline (``passes/costs.py``) is what we plan with for hardware we do not
have; for a device we do have, we run the graph on it (DESIGN §4.1). An ``fx.Interpreter``
runs the captured graph on real tensors of one micro-batch. At each compute node it
replays the node on fresh inputs that require grad, like the annotate pass, and records

- forward and backward seconds, with the intra-op threads the run will use, timed inside whole
  passes of the M micro-batches in the schedule's order (:mod:`autosplit.passes.in_context`; on a
  GPU by CUDA events on the stream), on the CPU optionally while the other cores of the host run
  the same passes, as the pipeline's other ranks will (``ProfileOptions.beside``);
- saved bytes (what autograd keeps for backward, parameters excluded, each storage once)
  and the transient peak of forward and backward above what was live before, from the
  allocator's statistics on a GPU and :class:`autosplit.timers.MemoryTracker` on the CPU.

One step of the plan's optimizer over all parameters is timed too. Costs in a
:class:`Profile` are per micro-batch; the cost table scales them to the batch.
Profiling leaves the model as it was: buffers (BatchNorm statistics) and the RNG state are
restored afterwards.

Profiles are cached on disk as JSON under ``cache_dir`` (default ``$AUTOSPLIT_CACHE`` or
``~/.cache/autosplit``), keyed by graph fingerprint, device name, dtypes, input shapes,
threads and torch version, so a restart does not profile again (:mod:`autosplit.passes.profile_cache`).

Usage::

    prof = profile(captured, micro_inputs, "cpu", options=ProfileOptions(threads=1))
    prof.nodes["linear_1"].fwd
"""


from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autosplit.compat import pytree
from autosplit.errors import CostModelError, advice
from autosplit.options import ProfileOptions
from autosplit.passes import profile_cache
from autosplit.passes.annotate import fresh
from autosplit.passes.autocast_policy import forward_autocast, is_mixed, step_scope
from autosplit.passes.capture import Captured
from autosplit.passes.in_context import FREE_TARGETS, beside, grad_outputs, in_context
from autosplit.timers import MemoryTracker, pinned, timed

__all__ = ["NodeProfile", "Profile", "profile"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeProfile:
    """Measurements of one node on one device for one micro-batch."""

    fwd: float
    """Forward seconds (median)."""
    bwd: float
    """Backward seconds (median); 0 when nothing needs a gradient."""
    saved_bytes: int
    """Bytes autograd keeps from forward to backward (parameters excluded)."""
    peak_bytes: int
    """Transient peak of forward + backward above what was live before, beyond the node's
    output and its parameters' gradients (counted as activations and model state)."""
    wgrad_share: float | None = None
    """Of ``bwd``, the share of torch's weight pass (W) when the backward was profiled split
    (zero-bubble schedules); None otherwise (the cost table then divides by flops)."""
    split_cost: float = 0.0
    """Of ``bwd``, what splitting it costs: ``bwd`` less the same node's backward run whole, as
    torch's first stage of a split backward runs it (0 when the backward was not profiled split)."""


@dataclass(frozen=True)
class Profile:
    """Per-node measurements of a graph on one device, and what they were measured under."""

    device: str
    key: dict[str, Any]
    """What the measurements depend on (fingerprint, device, dtypes, shapes, threads, ...)."""
    nodes: dict[str, NodeProfile]
    wall_time: float
    """Seconds the profiling took (0 for a profile read from the cache)."""
    cached: bool = False
    optimizer_step: float = 0.0
    """Seconds of one step of the plan's optimizer over all the graph's parameters (0: none)."""

    def to_json(self) -> dict:
        return {
            "schema": profile_cache.SCHEMA, "device": self.device, "key": self.key, "wall_time": self.wall_time,
            "optimizer_step": self.optimizer_step, "nodes": {name: dataclasses.astuple(p) for name, p in self.nodes.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        nodes = {name: NodeProfile(*row) for name, row in data["nodes"].items()}
        return cls(data["device"], data["key"], nodes, data["wall_time"], cached=True, optimizer_step=data["optimizer_step"])


class _Profiler(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, device: torch.device):
        super().__init__(gm, garbage_collect_values=True)
        self.device = device
        self.params = {id(p) for p in gm.parameters()}
        self.param_storage = {p.untyped_storage().data_ptr() for p in gm.parameters()}
        self.results: dict[str, NodeProfile] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module") and n.target not in FREE_TARGETS:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            try:
                self.results[n.name] = self._measure(n, args, kwargs)
            except Exception as e:
                raise CostModelError(advice(
                    f"could not profile node {n.format_node()} on {self.device}: {type(e).__name__}: {e}",
                    "the op cannot be replayed alone on fresh inputs",
                    "plan with costs='analytic', or override this node's cost (cost_overrides=)",
                )) from e
        return out

    def _fresh(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
        """Inputs cut from the graph (see ``annotate.fresh``) and those that get a gradient."""
        args, kwargs = pytree.tree_map(lambda x: fresh(x, self.params), (args, kwargs))
        grads = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        return args, kwargs, grads

    def _call(self, n: fx.Node, args: tuple, kwargs: dict) -> Any:
        return getattr(self, n.op)(n.target, args, kwargs)

    def _measure(self, n: fx.Node, args: tuple, kwargs: dict) -> NodeProfile:
        params = [p for p in self.module.get_submodule(str(n.target)).parameters() if p.requires_grad] if n.op == "call_module" else []
        saved, peak = self._memory(n, args, kwargs, params)
        return NodeProfile(0.0, 0.0, saved, peak)  # timed inside whole passes (:func:`~autosplit.passes.in_context.in_context`)

    def _memory(self, n: fx.Node, args: tuple, kwargs: dict, params: Sequence[torch.Tensor]) -> tuple[int, int]:
        """(saved bytes, transient peak bytes) of one forward + backward."""
        a, k, grads = self._fresh(args, kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((a, k)) if isinstance(t, torch.Tensor)}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs and storage.data_ptr() not in self.param_storage:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        cuda = self.device.type == "cuda"
        with MemoryTracker() as tracker:
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
                before = torch.cuda.memory_allocated(self.device)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = self._call(n, a, k)
            outs = grad_outputs(out)
            wrt = [*grads, *params]
            if outs and wrt:
                torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
            peak = torch.cuda.max_memory_allocated(self.device) - before if cuda else tracker.peak
        counted = sum(t.numel() * t.element_size() for t in [*outs, *params, *(g for g in grads if id(g) in self.params)])
        return sum(saved.values()), max(int(peak) - counted, 0)


_OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps),
    "adamw": lambda ps: torch.optim.AdamW(ps),
    "adagrad": lambda ps: torch.optim.Adagrad(ps),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
}


def _optimizer_step(gm: fx.GraphModule, optimizer: str, device: torch.device, options: ProfileOptions) -> float:
    """Seconds of one ``optimizer`` step (torch's default implementation, as users train with)
    over the graph's trainable parameters; the parameters and their gradients are put back."""
    params = [p for p in gm.parameters() if p.requires_grad]
    if optimizer not in _OPTIMIZERS or not params:
        return 0.0
    kept = [(p.detach().clone(), p.grad) for p in params]
    try:
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        step = _OPTIMIZERS[optimizer](params).step
        return timed(lambda: step(), device=str(device), warmup=max(options.warmup, 1), repeats=options.repeats)
    finally:
        with torch.no_grad():
            for p, (value, grad) in zip(params, kept):
                p.copy_(value)
                p.grad = grad


@contextlib.contextmanager
def _state_restored(gm: fx.GraphModule) -> Iterator[None]:
    """Every parameter and buffer of ``gm`` as it was when the block began (copied back whole: a
    kernel such as BatchNorm's writes its statistics without moving their version counter)."""
    kept = [(t, t.detach().clone()) for t in {id(t): t for t in [*gm.parameters(), *gm.buffers()]}.values()]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value in kept:
                t.copy_(value)


def profile(
    captured: Captured, inputs: Sequence[Any], device: str, *, fingerprint: str,
    options: ProfileOptions | None = None, micro_batches: int = 1, forwards_first: bool = False,
    optimizer: str = "adam", split_backward: bool = False, precision: str = "fp32",
) -> Profile:
    """Measure every compute node of ``captured`` on ``device`` for the given (micro-batch) inputs.

    ``inputs`` are the flat graph inputs (``capture.flat_inputs``). The model's state is
    copied to ``device`` when it lives elsewhere; it is never moved. Times are
    taken inside passes of ``micro_batches`` micro-batches, all forwards first when
    ``forwards_first`` (GPipe's order), as the stages will run them (:mod:`autosplit.passes.in_context`),
    the backward split into torch's input and weight passes, each node's timed apart, with
    ``split_backward`` (a zero-bubble schedule's profile);
    one step of ``optimizer`` over all parameters is timed too (:attr:`Profile.optimizer_step`).
    A mixed ``precision`` (``"bf16-mixed"``, ``"fp16-mixed"``) runs every forward under autocast as the
    runtime does, each weight cast once per pass (what a node saves then includes its weight's copy);
    the parameters, their gradients and the optimizer stay fp32.
    """
    if precision != "fp32" and not is_mixed(precision):
        raise CostModelError(advice(
            f"costs='measured' profiles the model's nodes in fp32 or under autocast, and precision={precision!r} "
            "computes with bf16 parameters",
            "profiling runs the model's own fp32 weights",
            f"plan precision={precision!r} with costs='analytic' (calibrated device specs: autosplit.calibrate), or "
            "measure with precision='bf16-mixed'",
        ))
    options = options or ProfileOptions()
    dev = torch.device(device)
    key = profile_cache.profile_key(captured, inputs, dev, fingerprint, options)
    key.update(optimizer=optimizer, micro_batches=micro_batches, forwards_first=forwards_first)
    if precision != "fp32":
        key["precision"] = precision
    if options.beside and dev.type == "cpu":
        key["beside"] = list(options.beside)
    if split_backward:
        key["split_backward"] = True
    path = profile_cache.cache_path(key, options)
    cached = profile_cache.load(path, key, Profile.from_json) if options.use_cache else None
    if cached is not None:
        log.info("profile of %s on %s: cache hit %s", fingerprint[:12], device, path)
        return cached

    gm = captured.gm
    on_device = all(t.device == dev for t in [*gm.parameters(), *gm.buffers()])
    if not on_device:
        gm = copy.deepcopy(gm).to(dev)
    inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in inputs]
    start = time.perf_counter()
    # Profiling runs forward many times: BatchNorm's statistics, and any weight forward updates
    # itself (an EMA teacher), are put back afterwards, whether profiling succeeds or fails.
    with _state_restored(gm), pinned(options.threads, options.cores), \
            torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        profiler = _Profiler(gm, dev)
        with step_scope(precision, dev.type), forward_autocast(precision, dev.type):
            profiler.run(*inputs)
        with beside(gm, inputs, options.beside if dev.type == "cpu" else (), options.threads):
            times = in_context(gm, inputs, micro_batches, forwards_first, rounds=options.repeats, split_backward=split_backward,
                               device=dev, precision=precision)
            profiler.results = {
                name: dataclasses.replace(p, fwd=times[name][0], bwd=times[name][1], wgrad_share=times[name][2],
                                          split_cost=times[name][3])
                for name, p in profiler.results.items()
            }
            optimizer_step = _optimizer_step(gm, optimizer, dev, options)
    result = Profile(device, key, profiler.results, time.perf_counter() - start, optimizer_step=optimizer_step)
    log.info("profiled %d nodes on %s in %.2fs", len(result.nodes), device, result.wall_time)
    if options.use_cache:
        profile_cache.store(path, result.to_json())
    return result
