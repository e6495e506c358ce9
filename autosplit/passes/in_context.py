"""In-context timing: every node of a graph timed inside whole training passes, on the CPU or a GPU.

A node alone on fresh inputs runs on caches it has to itself and on freshly allocated tensors;
inside a pass it runs after its neighbours, between the other micro-batches' tensors, and its
backward is scheduled by the autograd engine. The profiler's times come from here
(:func:`in_context`): passes of the plan's micro-batches in the schedule's order, each node's
clock scaled to a pass timed without the clocks, optionally while the host's other cores run the
same passes (:func:`beside`), and with a split backward (:mod:`autosplit.passes.split_backward`)
for a zero-bubble schedule.

On a GPU the clocks are CUDA events on the stream (:class:`_Clock`): the host queues kernels ahead
of the GPU, so a node's time is what the stream spends between its marks — its kernels, and the
wait for the host where the host is the slower — and a node timed alone, synchronised, would be
charged the host's launch of every small kernel that a pass hides behind the large ones
(``benchmarks/gpu_check.py`` compares the predicted step with the measured one).

Usage::

    times = in_context(gm, inputs, micro_batches=4, forwards_first=True, rounds=5)
    fwd, bwd, weight_share, split_cost = times["linear_1"]
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from autosplit.compat import graph_codegen, pytree
from autosplit.errors import CostModelError, advice
from autosplit.passes.autocast_policy import forward_autocast, step_scope
from autosplit.passes.split_backward import cut_at_frontier, split_backward

__all__ = ["FREE_TARGETS", "beside", "flat", "grad_outputs", "in_context"]

FREE_TARGETS = {operator.getitem}
"""Nodes that compute nothing (they only name a value): never timed."""


class _Clock:
    """The host's clock (CPU), or CUDA events recorded on the current stream (GPU), read once the
    work queued before them is done (:meth:`seconds` after :meth:`now` or a synchronisation)."""

    def __init__(self, device: torch.device):
        self.device_type = device.type
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return end - start if not self.cuda else start.elapsed_time(end) / 1e3

    def now(self) -> float:
        """The host's clock once everything queued is done (a reference pass's bounds)."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class _InContext(fx.Interpreter):
    """Times every compute node inside real training passes of the whole graph.

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

    def __init__(self, gm: fx.GraphModule, clock: _Clock):
        super().__init__(gm)
        self.clock = clock
        self._marked: list[tuple[dict[str, float], str, Any, Any]] = []
        """(times, node, start, end) marked and not yet read (:meth:`settle`)."""
        self.fwd: dict[str, float] = {}
        self.bwd: dict[str, float] = {}
        """Backward seconds per node: of a whole backward, or of a split one's input pass (I)."""
        self.weight: dict[str, float] = {}
        """A split backward's weight pass (W) seconds per node."""
        self._charged = self.bwd
        self.owner: dict[Any, str] = {}
        """Autograd node → the fx node that made it (kept alive: hooks stay registered once)."""
        self._handles: list[Any] = []
        self._last = clock.mark()

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_function", "call_method", "call_module") or n.target in FREE_TARGETS:
            return super().run_node(n)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            t0 = self.clock.mark()
            out = getattr(self, n.op)(n.target, args, kwargs)
            self._marked.append((self.fwd, n.name, t0, self.clock.mark()))
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
        now = self.clock.mark()
        self._marked.append((self._charged, name, self._last, now))
        self._last = now

    def _charge(self, into: dict[str, float]) -> None:
        self._charged, self._last = into, self.clock.mark()

    def settle(self) -> None:
        """Read the marks: each node's seconds added to its forward, backward or weight-pass time."""
        self.clock.now()
        for times, name, start, end in self._marked:
            times[name] = times.get(name, 0.0) + self.clock.seconds(start, end)
        self._marked.clear()

    @contextlib.contextmanager
    def _started_at(self, outs: list[torch.Tensor]) -> Iterator[None]:
        """The clock restarts as the backward reaches the outputs' autograd nodes: what the engine
        and torch's split do before (the split's walk over the whole graph) goes to no node, and
        the scaling to the measured pass shares it among them all, as each stage pays it for its own."""
        def restart(_grad_outputs: Any) -> None:
            self._last = self.clock.mark()

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
        """:func:`~autosplit.passes.split_backward.split_backward` on a graph this timer ran cut by
        :func:`~autosplit.passes.split_backward.cut_at_frontier`."""
        self._charge(self.bwd)
        with self._started_at(outs):
            split_backward(outs, values, leaves, params, weight_pass=lambda: self._charge(self.weight), now=self.clock.now)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self.owner.clear()


def grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def flat(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` called with its placeholders' values in order, as the profiler holds them: an
    exported graph's own ``forward`` rebuilds the model's (args, kwargs) first, which a flat call
    does not match. Shares ``gm``'s modules and tensors."""
    if type(graph_codegen(gm.graph)) is fx.graph.CodeGen:
        return gm
    graph = fx.Graph()  # the same nodes, the plain code generator
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)



def _passes(
    params: Sequence[torch.Tensor], micro_batches: int, forwards_first: bool, now: Callable[[], float], precision: str,
    device_type: str, forward: Callable[[], Any], backward: Callable[[list[torch.Tensor]], None],
) -> tuple[float, float]:
    """(forward, backward) seconds of one pass of ``micro_batches`` micro-batches: all forwards
    first when ``forwards_first`` (GPipe), else each forward followed by its backward; for a mixed
    ``precision`` each forward under autocast, the backwards outside it, and each weight cast once
    for the pass (:func:`~autosplit.passes.autocast_policy.step_scope`), as the runtime's step runs them."""
    for p in params:  # as after zero_grad(): the first micro-batch's gradients are stored, the others added
        p.grad = None
    t_fwd = t_bwd = 0.0
    pending: list[list[torch.Tensor]] = []
    with step_scope(precision, device_type):
        for m in range(micro_batches):
            t0 = now()
            with forward_autocast(precision, device_type):
                outs = grad_outputs(forward())
            t_fwd += now() - t0
            pending.append(outs)
            if not forwards_first or m == micro_batches - 1:
                for outs in pending:
                    t0 = now()
                    if outs:
                        backward(outs)
                    t_bwd += now() - t0
                pending = []
    return t_fwd, t_bwd


def _plain_backward(outs: list[torch.Tensor]) -> None:
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def _cut_pass(
    run: Callable[..., Any], backward: Callable[..., Any], inputs: Sequence[Any], params: list[torch.nn.Parameter],
) -> tuple[Callable[[], Any], Callable[[list[torch.Tensor]], None]]:
    """A forward of the cut graph (by ``run``) and the split backward (by ``backward``) that takes its cut."""
    cuts: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (frontier values, their leaves) per micro-batch

    def forward() -> Any:
        out, values, leaves = run(*inputs)
        cuts.append((values, leaves))
        return out
    return forward, lambda outs: backward(outs, *cuts.pop(0), params)


def _round(
    gm: fx.GraphModule, plain: fx.GraphModule, split: fx.GraphModule | None, inputs: Sequence[Any],
    micro_batches: int, forwards_first: bool, clock: _Clock, precision: str,
) -> dict[str, list[float]]:
    """One round: the passes timed node by node (:class:`_InContext`), then without the clocks
    (the reference the node times are scaled to); [node] forward, I, W and what splitting costs,
    per micro-batch. A mixed ``precision`` runs each forward under autocast, as the runtime does."""
    params = list(gm.parameters())
    # the clocked passes' own times are not read (their nodes' are): they run unsynchronised, as a step does
    clocked = functools.partial(_passes, params, micro_batches, forwards_first, time.perf_counter, precision, clock.device_type)
    passes = functools.partial(_passes, params, micro_batches, forwards_first, clock.now, precision, clock.device_type)
    parts = [0.0, 0.0]  # the split reference pass's I and W seconds

    def reference_split(outs: list[torch.Tensor], values: list[torch.Tensor], leaves: list[torch.Tensor], ps: list) -> None:
        i, w = split_backward(outs, values, leaves, ps, now=clock.now)
        parts[0] += i
        parts[1] += w

    timer = _InContext(split if split is not None else gm, clock)
    try:
        clocked(*(_cut_pass(timer.run, timer.split_backward, inputs, params) if split is not None
                  else (functools.partial(timer.run, *inputs), timer.backward)))
        timer.settle()
        owned = collections.Counter(timer.owner.values())  # autograd nodes per fx node
    finally:
        timer.close()
    ref_fwd, ref_bwd = passes(*(_cut_pass(split, reference_split, inputs, params) if split is not None
                                else (lambda: plain(*inputs), _plain_backward)))
    whole = passes(lambda: plain(*inputs), _plain_backward)[1] if split is not None else ref_bwd
    return _scaled(timer, owned, ref_fwd, whole, parts if split is not None else None, micro_batches)


def _scaled(
    timer: _InContext, owned: collections.Counter, ref_fwd: float, whole: float, parts: list[float] | None,
    micro_batches: int,
) -> dict[str, list[float]]:
    """Each node's clocked times scaled to the reference passes: its forward to the forward pass,
    its computing to a whole backward; what splitting adds to a pass (``parts``: the split
    reference's I and W seconds; torch's walks over the autograd graph, its hooks) shared by the
    autograd nodes of the fx nodes in it."""
    f_scale = ref_fwd / max(sum(timer.fwd.values()), 1e-12)
    b_scale = whole / max(sum(timer.bwd.values()) + sum(timer.weight.values()), 1e-12)
    # what a split pass adds cannot be negative: a reference pass clocked below its nodes' sum is noise
    extra = [(max(0.0, total - b_scale * sum(times.values())) / max(sum(owned[n] for n in times), 1), times)
             for total, times in ((parts[0], timer.bwd), (parts[1], timer.weight))] if parts is not None else []
    out = {}
    for name in timer.fwd:
        added = [per_node * owned[name] if name in times else 0.0 for per_node, times in extra] or [0.0, 0.0]
        i = max(0.0, timer.bwd.get(name, 0.0) * b_scale + added[0])
        w = max(0.0, timer.weight.get(name, 0.0) * b_scale + added[1])
        out[name] = [x / micro_batches for x in (timer.fwd[name] * f_scale, i, w, sum(added))]
    return out


def in_context(
    gm: fx.GraphModule, inputs: Sequence[Any], micro_batches: int, forwards_first: bool, rounds: int,
    split_backward: bool = False, device: torch.device | str = "cpu", precision: str = "fp32",
) -> dict[str, tuple[float, float, float | None, float]]:
    """(forward, backward, weight-pass share of the backward or None, what splitting adds to the
    backward) seconds per micro-batch of every compute node, timed inside whole passes of
    ``micro_batches`` micro-batches (all forwards first for GPipe, else one forward and its
    backward at a time); the median over ``rounds`` after one untimed round.

    The per-node clocks and hooks cost time of their own: each round's node times are scaled
    so that they add up to the same pass without them, timed alongside. With ``split_backward``
    (zero-bubble schedules) both passes run their backward as torch's pipeline stages do
    (:func:`~autosplit.passes.split_backward.split_backward`), and each node's input pass (I) and
    weight pass (W) are timed apart.
    A whole backward is timed too (torch's first stage runs one): each node's computing is scaled
    to it, and what each split pass takes beyond it — torch's walks over the autograd graph, its
    hooks — is shared among the nodes in that pass by their autograd nodes, as each stage pays it
    over its own graph: that share is what splitting adds to the node.
    On a CUDA ``device`` (where ``gm`` and ``inputs`` live) the nodes are timed by CUDA events (:class:`_Clock`);
    a mixed ``precision`` runs the forwards under autocast (:func:`_passes`).
    """
    clock = _Clock(torch.device(device))
    params = list(gm.parameters())
    grads = [p.grad for p in params]
    plain = flat(gm)
    split = cut_at_frontier(plain, inputs) if split_backward else None
    samples: dict[str, list[list[float]]] = {}  # per round: forward, I, W, what splitting costs
    try:
        for r in range(rounds + 1):
            clocked = _round(gm, plain, split, inputs, micro_batches, forwards_first, clock, precision)
            if r == 0:  # untimed: warm-up
                continue
            for name, row in clocked.items():
                samples.setdefault(name, []).append(row)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    times = {}
    for name, rows in samples.items():
        f, i, w, cost = (statistics.median(col) for col in zip(*rows))
        times[name] = (f, i + w, w / (i + w) if split is not None and i + w > 0 else None, cost)
    return times


@contextlib.contextmanager
def beside(gm: fx.GraphModule, inputs: Sequence[Any], cores: Sequence[int], threads: int | None) -> Iterator[None]:
    """Run the block while a forked copy of this process on each of ``cores`` runs ``gm``'s forward
    and backward on ``inputs`` over and over (:attr:`~autosplit.options.ProfileOptions.beside`). A fork shares the
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
    if torch.cuda.is_initialized():  # a forked child of a process that has used CUDA cannot run torch safely
        raise CostModelError(advice(
            f"cannot profile beside cores {tuple(cores)}: this process has initialised CUDA, and the passes beside "
            "run in forked copies of it",
            "the CUDA runtime does not survive fork(); a forked child of this process may fail or hang",
            "profile with beside= in a process that has not used CUDA, or leave ProfileOptions.beside empty",
        ))
    run, parent, children, failed = flat(gm), os.getpid(), {}, []
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
                        outs = grad_outputs(run(*inputs))
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
