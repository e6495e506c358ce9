"""Profile: measured forward/backward time and memory of every node on a real device.

The analytic roofline (``passes/costs.py``) is what we plan with for hardware we do not
have; for a device we do have, we run the graph on it (DESIGN §4.1). An ``fx.Interpreter``
runs the captured graph on real tensors of one micro-batch. At each compute node it
replays the node on fresh inputs that require grad, like the annotate pass, and records

- forward and backward seconds, with the intra-op threads the run will use. On the CPU they
  are timed inside whole passes of the M micro-batches in the schedule's order
  (:class:`_InContext`), optionally while the other cores of the host run the same passes, as
  the pipeline's other ranks will (``ProfileOptions.beside``); on a GPU the replay is timed alone with CUDA events (warm-up runs,
  then the median of the repeats);
- saved bytes (what autograd keeps for backward, parameters excluded, each storage once)
  and the transient peak of forward and backward above what was live before, from the
  allocator's statistics on a GPU and :class:`autosplit.timers.MemoryTracker` on the CPU.

One step of the plan's optimizer over all parameters is timed too. Costs in a
:class:`Profile` are per micro-batch; the cost table scales them to the batch.
Profiling leaves the model as it was: buffers (BatchNorm statistics) and the RNG state are
restored afterwards.

Profiles are cached on disk as JSON under ``cache_dir`` (default ``$AUTOSPLIT_CACHE`` or
``~/.cache/autosplit``), keyed by graph fingerprint, device name, dtypes, input shapes,
threads and torch version, so a restart does not profile again.

Usage::

    prof = profile(captured, micro_inputs, "cpu", options=ProfileOptions(threads=1))
    prof.nodes["linear_1"].fwd
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import logging
import operator
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from autosplit import compat
from autosplit.compat import pytree
from autosplit.errors import CostModelError, advice
from autosplit.options import ProfileOptions
from autosplit.passes.annotate import fresh
from autosplit.passes.capture import Captured
from autosplit.timers import MemoryTracker, pinned, timed

__all__ = ["ProfileOptions", "NodeProfile", "Profile", "profile"]

log = logging.getLogger(__name__)

_FREE_TARGETS = {operator.getitem}
_SCHEMA = 7  # bump when what a profile measures changes: older cache files are then ignored


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
            "schema": _SCHEMA, "device": self.device, "key": self.key, "wall_time": self.wall_time,
            "optimizer_step": self.optimizer_step, "nodes": {name: dataclasses.astuple(p) for name, p in self.nodes.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        nodes = {name: NodeProfile(*row) for name, row in data["nodes"].items()}
        return cls(data["device"], data["key"], nodes, data["wall_time"], cached=True, optimizer_step=data["optimizer_step"])


def _cache_dir(options: ProfileOptions) -> Path:
    root = options.cache_dir or os.environ.get("AUTOSPLIT_CACHE") or Path.home() / ".cache" / "autosplit"
    return Path(root) / "profiles"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        import platform

        return f"cpu:{platform.processor() or platform.machine()}"
    return str(device)


class _Profiler(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, device: torch.device, options: ProfileOptions):
        super().__init__(gm, garbage_collect_values=True)
        self.device = device
        self.options = options
        self.params = {id(p) for p in gm.parameters()}
        self.param_storage = {p.untyped_storage().data_ptr() for p in gm.parameters()}
        self.results: dict[str, NodeProfile] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module") and n.target not in _FREE_TARGETS:
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
        if self.device.type == "cpu":  # timed inside whole passes instead (_in_context)
            return NodeProfile(0.0, 0.0, saved, peak)
        opts = self.options

        def forward(_=None):
            a, k, grads = self._fresh(args, kwargs)
            return _grad_outputs(self._call(n, a, k)), grads + params

        fwd = timed(lambda inputs: self._call(n, *inputs[:2]), device=str(self.device), warmup=opts.warmup,
                    repeats=opts.repeats, setup=lambda: self._fresh(args, kwargs))
        outs, targets = forward()
        bwd = 0.0
        if outs and targets:
            # Parameter gradients accumulate over micro-batches: time the add into .grad too.
            accumulators = {i: torch.zeros_like(t) for i, t in enumerate(targets) if id(t) in self.params}

            def setup():
                outs, targets = forward()
                return outs, targets, [torch.ones_like(o) for o in outs]

            def backward(x):
                grads = torch.autograd.grad(x[0], x[1], x[2], allow_unused=True)
                for i, acc in accumulators.items():
                    if grads[i] is not None:
                        acc.add_(grads[i])

            bwd = timed(backward, device=str(self.device), warmup=opts.warmup, repeats=opts.repeats, setup=setup)
        return NodeProfile(fwd, bwd, saved, peak)

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
            outs = _grad_outputs(out)
            wrt = [*grads, *params]
            if outs and wrt:
                torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
            peak = torch.cuda.max_memory_allocated(self.device) - before if cuda else tracker.peak
        counted = sum(t.numel() * t.element_size() for t in [*outs, *params, *(g for g in grads if id(g) in self.params)])
        return sum(saved.values()), max(int(peak) - counted, 0)


class _InContext(fx.Interpreter):
    """Times every compute node inside real training passes of the whole graph (CPU).

    A node alone on fresh inputs runs on caches it has to itself and on freshly allocated
    tensors; inside a pass it runs after its neighbours, between the other micro-batches'
    tensors, and its backward is scheduled by the autograd engine. The two differ by more than
    the cut decisions tolerate (on GNMT the embeddings' backward is much slower alone, the
    LSTMs' and the output layer's forward faster), so on the CPU the times come from here.

    Forward: a clock around each node's call. Backward: a post-hook on every autograd node the
    node's forward created (found from its outputs, stopping at nodes already owned), charging
    the time since the previous autograd node finished, so the engine's own work between nodes
    (summing gradients of a value read twice) goes to the node it precedes. A backward split as
    torch's stages split it (:meth:`split_backward`) charges each pass apart: an autograd node
    that computes a weight's gradient runs again in the weight pass, and its post-hook fires there.
    """

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.fwd: dict[str, float] = {}
        self.bwd: dict[str, float] = {}
        """Backward seconds per node: of a whole backward, or of a split one's input pass (I)."""
        self.weight: dict[str, float] = {}
        """A split backward's weight pass (W) seconds per node."""
        self._charged = self.bwd
        self.owner: dict[Any, str] = {}
        """Autograd node → the fx node that made it (kept alive: hooks stay registered once)."""
        self._handles: list[Any] = []
        self._last = 0.0

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_function", "call_method", "call_module") or n.target in _FREE_TARGETS:
            return super().run_node(n)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            t0 = time.perf_counter()
            out = getattr(self, n.op)(n.target, args, kwargs)
            self.fwd[n.name] = self.fwd.get(n.name, 0.0) + time.perf_counter() - t0
        stack: list[Any] = [t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in self.owner:
                continue
            self.owner[fn] = n.name
            self._handles.append(fn.register_hook(lambda _gi, _go, name=n.name: self._done(name)))
            stack.extend(f for f, _ in fn.next_functions)
        return out

    def _done(self, name: str) -> None:
        now = time.perf_counter()
        self._charged[name] = self._charged.get(name, 0.0) + now - self._last
        self._last = now

    def _charge(self, into: dict[str, float]) -> None:
        self._charged, self._last = into, time.perf_counter()

    @contextlib.contextmanager
    def _started_at(self, outs: list[torch.Tensor]) -> Iterator[None]:
        """The clock restarts as the backward reaches the outputs' autograd nodes: what the engine
        and torch's split do before (the split's walk over the whole graph) goes to no node, and
        the scaling to the measured pass shares it among them all, as each stage pays it for its own."""
        def restart(_grad_outputs: Any) -> None:
            self._last = time.perf_counter()

        handles = [fn.register_prehook(restart) for fn in {o.grad_fn for o in outs if o.grad_fn is not None}]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def backward(self, outs: list[torch.Tensor]) -> None:
        seeds = [torch.ones_like(o) for o in outs]
        self._charge(self.bwd)
        with self._started_at(outs):
            torch.autograd.backward(outs, seeds)

    def split_backward(
        self, outs: list[torch.Tensor], values: list[torch.Tensor], leaves: list[torch.Tensor], params: list[torch.nn.Parameter],
    ) -> None:
        """:func:`_split_backward` on a graph this timer ran cut by :func:`_cut_at_frontier`."""
        self._charge(self.bwd)
        with self._started_at(outs):
            _split_backward(outs, values, leaves, params, weight_pass=lambda: self._charge(self.weight))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self.owner.clear()


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _flat(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` called with its placeholders' values in order, as the profiler holds them: an
    exported graph's own ``forward`` rebuilds the model's (args, kwargs) first, which a flat call
    does not match. Shares ``gm``'s modules and tensors."""
    if type(compat.graph_codegen(gm.graph)) is fx.graph.CodeGen:
        return gm
    graph = fx.Graph()  # the same nodes, the plain code generator
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


class _GradFrontier(fx.Interpreter):
    """The nodes whose outputs are the first activations that need a gradient: computed from the
    inputs and parameters alone (an embedding's output), where a stage's input would be."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.grad: set[fx.Node] = set()
        self.frontier: list[fx.Node] = []
        self.tensors = True

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op != "get_attr" and any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(out)):
            self.grad.add(n)
            if not any(a in self.grad for a in n.all_input_nodes):
                self.frontier.append(n)
                self.tensors &= isinstance(out, torch.Tensor)
        return out


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


def _cut_at_frontier(gm: fx.GraphModule, inputs: Sequence[Any]) -> fx.GraphModule | None:
    """``gm`` (flat) cut where its activations first need a gradient, as a stage boundary would
    cut it: each such value is replaced by a leaf copy, and the graph returns ``(its output, the
    values, their leaves)``. None when nothing needs a gradient or such a value is not one tensor."""
    finder = _GradFrontier(gm)
    finder.run(*inputs)
    if not finder.frontier or not finder.tensors:
        return None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    values: list[fx.Node] = []
    leaves: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op == "output":
            graph.output((fx.map_arg(n.args[0], env.__getitem__), values, leaves))
            break
        env[n] = graph.node_copy(n, env.__getitem__)
        if n in finder.frontier:
            values.append(env[n])
            env[n] = graph.call_function(_leaf, (values[-1],))
            leaves.append(env[n])
    return fx.GraphModule(gm, graph)


def _split_backward(
    outs: list[torch.Tensor], values: list[torch.Tensor], leaves: list[torch.Tensor], params: list[torch.nn.Parameter],
    weight_pass: Callable[[], None] = lambda: None,
) -> tuple[float, float]:
    """The backward of a graph cut by :func:`_cut_at_frontier` as a zero-bubble stage runs it:
    torch's input pass (I) down to the leaves, then its weight pass (W) (``weight_pass()`` called
    as it starts); what precedes the cut (the embeddings: weight gradients alone, which torch's
    first stage runs in its W) gets a plain backward. Returns the seconds of I and of W (that plain
    backward included)."""
    # torch's own functions, as its stages call them (imported here: `import autosplit` leaves
    # torch.distributed.pipelining for first use)
    stage_backward_input, stage_backward_weight = compat.stage_backward()

    outs = [o.clone() if o._is_view() else o for o in outs]  # torch detaches them in place, which a view refuses
    t0 = time.perf_counter()
    grads, groups = stage_backward_input(outs, [torch.ones_like(o) for o in outs], leaves, iter(params))
    t1 = time.perf_counter()
    weight_pass()
    stage_backward_weight(iter(params), groups)
    below = [(v, g) for v, g in zip(values, grads) if g is not None]
    if below:
        torch.autograd.backward([v for v, _ in below], [g for _, g in below])
    return t1 - t0, time.perf_counter() - t1


def _in_context(
    gm: fx.GraphModule, inputs: Sequence[Any], micro_batches: int, forwards_first: bool, rounds: int,
    split_backward: bool = False,
) -> dict[str, tuple[float, float, float | None, float]]:
    """(forward, backward, weight-pass share of the backward or None, what splitting adds to the
    backward) seconds per micro-batch of every compute node, timed inside whole passes of
    ``micro_batches`` micro-batches (all forwards first for GPipe, else one forward and its
    backward at a time); the median over ``rounds`` after one untimed round.

    The per-node clocks and hooks cost time of their own: each round's node times are scaled
    so that they add up to the same pass without them, timed alongside. With ``split_backward``
    (zero-bubble schedules) both passes run their backward as torch's pipeline stages do
    (:func:`_split_backward`), and each node's input pass (I) and weight pass (W) are timed apart.
    A whole backward is timed too (torch's first stage runs one): each node's computing is scaled
    to it, and what each split pass takes beyond it — torch's walks over the autograd graph, its
    hooks — is shared among the nodes in that pass by their autograd nodes, as each stage pays it
    over its own graph: that share is what splitting adds to the node.
    """
    params = list(gm.parameters())
    grads = [p.grad for p in params]
    plain = _flat(gm)
    split = _cut_at_frontier(plain, inputs) if split_backward else None
    parts = [0.0, 0.0]  # the split reference pass's I and W seconds, this round

    def passes(forward: Callable[[], Any], backward: Callable[[list[torch.Tensor]], None]) -> tuple[float, float]:
        for p in params:  # as after zero_grad(): the first micro-batch's gradients are stored, the others added
            p.grad = None
        t_fwd = t_bwd = 0.0
        pending: list[list[torch.Tensor]] = []
        for m in range(micro_batches):
            t0 = time.perf_counter()
            outs = _grad_outputs(forward())
            t_fwd += time.perf_counter() - t0
            pending.append(outs)
            if not forwards_first or m == micro_batches - 1:
                for outs in pending:
                    t0 = time.perf_counter()
                    if outs:
                        backward(outs)
                    t_bwd += time.perf_counter() - t0
                pending = []
        return t_fwd, t_bwd

    def plain_backward(outs: list[torch.Tensor]) -> None:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    def cut_pass(run: Callable[..., Any], backward: Callable[..., Any]) -> tuple[Callable[[], Any], Callable[[list[torch.Tensor]], None]]:
        """A forward of the cut graph (by ``run``) and the split backward (by ``backward``) that takes its cut."""
        cuts: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (frontier values, their leaves) per micro-batch

        def forward() -> Any:
            out, values, leaves = run(*inputs)
            cuts.append((values, leaves))
            return out
        return forward, lambda outs: backward(outs, *cuts.pop(0), params)

    def reference_split(outs: list[torch.Tensor], values: list[torch.Tensor], leaves: list[torch.Tensor], ps: list) -> None:
        i, w = _split_backward(outs, values, leaves, ps)
        parts[0] += i
        parts[1] += w

    samples: dict[str, list[list[float]]] = {}  # per round: forward, I, W, what splitting costs
    try:
        for r in range(rounds + 1):
            timer = _InContext(split if split is not None else gm)
            try:
                passes(*(cut_pass(timer.run, timer.split_backward) if split is not None
                         else (functools.partial(timer.run, *inputs), timer.backward)))
                owned = collections.Counter(timer.owner.values())  # autograd nodes per fx node
            finally:
                timer.close()
            parts[:] = [0.0, 0.0]
            ref_fwd, ref_bwd = passes(*(cut_pass(split, reference_split) if split is not None
                                        else (lambda: plain(*inputs), plain_backward)))
            whole = passes(lambda: plain(*inputs), plain_backward)[1] if split is not None else ref_bwd
            if r == 0:
                continue
            f_scale = ref_fwd / max(sum(timer.fwd.values()), 1e-12)
            # Each node's computing, scaled to a whole backward; what splitting adds to a pass (torch's
            # walks over the autograd graph, its hooks) shared by the autograd nodes of the fx nodes in it.
            b_scale = whole / max(sum(timer.bwd.values()) + sum(timer.weight.values()), 1e-12)
            extra = [((total - b_scale * sum(times.values())) / max(sum(owned[n] for n in times), 1), times)
                     for total, times in ((parts[0], timer.bwd), (parts[1], timer.weight))] if split is not None else []
            for name in timer.fwd:
                added = [per_node * owned[name] if name in times else 0.0 for per_node, times in extra] or [0.0, 0.0]
                i = max(0.0, timer.bwd.get(name, 0.0) * b_scale + added[0])
                w = max(0.0, timer.weight.get(name, 0.0) * b_scale + added[1])
                samples.setdefault(name, []).append([x / micro_batches for x in (timer.fwd[name] * f_scale, i, w, sum(added))])
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    times = {}
    for name, rows in samples.items():
        f, i, w, cost = (statistics.median(col) for col in zip(*rows))
        times[name] = (f, i + w, w / (i + w) if split is not None and i + w > 0 else None, cost)
    return times


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
def _beside(gm: fx.GraphModule, inputs: Sequence[Any], cores: Sequence[int], threads: int | None) -> Iterator[None]:
    """Run the block while a forked copy of this process on each of ``cores`` runs ``gm``'s forward
    and backward on ``inputs`` over and over (:attr:`ProfileOptions.beside`). A fork shares the
    graph without pickling it, and its gradients and state stay its own; it exits when killed or
    when this process is gone. A copy that stopped on an error is refused afterwards: the profile
    would have been taken on an idle core, not beside a busy one."""
    if not cores:
        yield
        return
    if not (hasattr(os, "fork") and hasattr(os, "sched_setaffinity")):
        raise CostModelError(advice(
            f"cannot profile beside cores {tuple(cores)} on this platform",
            "running the passes beside the profile forks processes pinned to cores (Linux only)",
            "leave ProfileOptions.beside empty",
        ))
    run, parent, children, failed = _flat(gm), os.getpid(), {}, []
    try:
        for core in cores:
            pid = os.fork()
            if pid == 0:  # the child: never returns into the caller's code
                code = 1
                try:
                    os.sched_setaffinity(0, {core})
                    torch.set_num_threads(threads or 1)
                    while os.getppid() == parent:
                        for p in gm.parameters():
                            p.grad = None
                        outs = _grad_outputs(run(*inputs))
                        if outs:
                            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                    code = 0
                finally:
                    os._exit(code)
            children[pid] = core
        yield
    finally:
        for pid, core in children.items():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            if os.WIFEXITED(status) and os.WEXITSTATUS(status):
                failed.append(core)
    if failed:
        raise CostModelError(advice(
            f"the passes run beside the profile stopped on an error on cores {failed}",
            "the profile was then taken beside idle cores, not beside busy ones as ProfileOptions.beside asks",
            "profile without beside= to see the error, or check that the model runs forward and backward in a forked process",
        ))


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


def _key(captured: Captured, inputs: Sequence[Any], device: torch.device, fingerprint: str, options: ProfileOptions) -> dict:
    tensors = [t for t in pytree.tree_leaves(list(inputs)) if isinstance(t, torch.Tensor)]
    dtypes = sorted({str(p.dtype) for p in captured.gm.parameters()} | {str(t.dtype) for t in tensors})
    return {
        "schema": _SCHEMA,
        "fingerprint": fingerprint,
        "device": _device_name(device),
        "dtypes": dtypes,
        "input_shapes": [list(t.shape) for t in tensors],
        "threads": options.threads or torch.get_num_threads(),
        "warmup": options.warmup,
        "repeats": options.repeats,
        "torch": torch.__version__,
    }


def profile(
    captured: Captured, inputs: Sequence[Any], device: str, *, fingerprint: str,
    options: ProfileOptions | None = None, micro_batches: int = 1, forwards_first: bool = False,
    optimizer: str = "adam", split_backward: bool = False,
) -> Profile:
    """Measure every compute node of ``captured`` on ``device`` for the given (micro-batch) inputs.

    ``inputs`` are the flat graph inputs (``capture.flat_inputs``). The model's state is
    copied to ``device`` when it lives elsewhere; it is never moved. On the CPU, times are
    taken inside passes of ``micro_batches`` micro-batches, all forwards first when
    ``forwards_first`` (GPipe's order), as the stages will run them (:class:`_InContext`),
    the backward split into torch's input and weight passes, each node's timed apart, with
    ``split_backward`` (a zero-bubble schedule's profile);
    one step of ``optimizer`` over all parameters is timed too (:attr:`Profile.optimizer_step`).
    """
    options = options or ProfileOptions()
    dev = torch.device(device)
    key = _key(captured, inputs, dev, fingerprint, options)
    key["optimizer"] = optimizer
    if dev.type == "cpu":
        key.update(micro_batches=micro_batches, forwards_first=forwards_first)
        if options.beside:
            key["beside"] = list(options.beside)
        if split_backward:
            key["split_backward"] = True
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = _cache_dir(options) / f"{digest}.json"
    if options.use_cache and path.exists():
        try:
            cached = Profile.from_json(json.loads(path.read_text()))
            if cached.key == key:
                log.info("profile of %s on %s: cache hit %s", fingerprint[:12], device, path)
                return cached
        except (ValueError, KeyError, TypeError) as e:  # a damaged file is measured again
            log.warning("ignoring unreadable profile cache %s: %s", path, e)

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
        profiler = _Profiler(gm, dev, options)
        profiler.run(*inputs)
        with _beside(gm, inputs, options.beside if dev.type == "cpu" else (), options.threads):
            if dev.type == "cpu":
                times = _in_context(gm, inputs, micro_batches, forwards_first, rounds=options.repeats, split_backward=split_backward)
                profiler.results = {
                    name: dataclasses.replace(p, fwd=times[name][0], bwd=times[name][1], wgrad_share=times[name][2],
                                              split_cost=times[name][3])
                    for name, p in profiler.results.items()
                }
            optimizer_step = _optimizer_step(gm, optimizer, dev, options)
    result = Profile(device, key, profiler.results, time.perf_counter() - start, optimizer_step=optimizer_step)
    log.info("profiled %d nodes on %s in %.2fs", len(result.nodes), device, result.wall_time)
    if options.use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result.to_json()))
        tmp.replace(path)
    return result
