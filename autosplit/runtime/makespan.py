"""The runtime of a makespan plan (DLPlacer): each device runs its nodes' forward and backward
tasks in the planned order, as soon as their inputs are there, at the same time as the others.

One worker thread per device (CPU devices; one intra-op thread for the whole process while
a step runs, so each worker is one core's worth of work and the kernels, which release the
GIL, overlap). A device's work is cut into *segments*: runs of its consecutive forward tasks
in the planned order, broken where a node reads, from outside the segment, a value planned
after the segment began; so every segment depends only on segments begun before it, no path
leaves a segment and comes back, and the segments form a DAG. Each
segment runs on its own autograd graph: inputs from outside it are cut
(``detach().requires_grad_()``), so its backward runs on its own device's thread, once every
consumer outside it has returned the gradient of its outputs — the hand-driven equivalent of
autograd's engine, which would otherwise run the whole backward on one thread. Every device
runs its segments' forwards and backwards in one global order (a topological order of the
segment DAG, by planned start), so no two devices wait on each other. Parameters are not cut:
their gradients accumulate in ``.grad`` as usual (autograd's accumulation is thread-safe). A
node that writes a cut input in place (``relu_``, ``x += y``) works on a clone of it, so later
nodes must read the value it returns (as traced code does: ``x = relu_(x)``,
``out += identity``). The loss is computed on the calling thread after every output's forward,
as the plan's task model says.

The plan counts each device's share of the optimizer step in its own time, so the update
runs on the devices at once too: :meth:`MakespanRunner.optimizer` makes one optimizer per
device over the parameters its nodes read, and its ``step`` runs them on one thread each.

Usage::

    runner = autosplit.Planner(model, ["cpu", "cpu"], example_inputs=(x,), objective="makespan").build()
    opt = runner.optimizer(torch.optim.Adam, lr=1e-3)          # one Adam per device
    loss = runner.step(x, target=y, loss_fn=F.cross_entropy)   # gradients in model.parameters()
    opt.step()
    opt.zero_grad()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from autosplit.compat import pytree
from autosplit.errors import CodegenError, DistributedError, advice
from autosplit.passes.annotations import node_info
from autosplit.passes.capture import Captured, flat_inputs
from autosplit.plans import Plan
from autosplit.solver.makespan.schedule import run_key

__all__ = ["MakespanRunner", "DeviceOptimizers"]


class _Abort(Exception):
    """Another worker failed: stop waiting."""


class MakespanRunner(torch.nn.Module):
    """A model and its makespan plan: ``step`` trains with the devices overlapping; ``forward``
    runs the graph in order (for evaluation)."""

    plan: Plan
    _captured: Captured
    _interpreter: fx.Interpreter

    def __init__(self, model: torch.nn.Module, captured: Captured, plan: Plan):
        super().__init__()
        if plan.objective != "makespan":
            raise CodegenError(advice(
                f"MakespanRunner got a {plan.objective} plan ({plan.schedule})", "it runs plans made with objective='makespan'",
                "build pipeline plans with Planner.build",
            ))
        devices = {plan.devices[d].torch_device for d in plan.stage_devices}
        if devices != {"cpu"}:
            raise CodegenError(advice(
                f"the makespan runtime runs CPU devices so far, not {sorted(map(str, devices))}",
                "its workers are threads of one process; CUDA streams and events are not written yet",
                "plan onto 'cpu' devices, or use objective='pipeline' for GPUs",
            ))
        self.model = model
        object.__setattr__(self, "_captured", captured)
        object.__setattr__(self, "plan", plan)
        self._order = _segments(captured.gm, plan)
        # Runs one node from its fetched arguments; its call_* methods keep no state, so the
        # device threads share it.
        object.__setattr__(self, "_interpreter", fx.Interpreter(captured.gm, garbage_collect_values=False))
        self._writes = {n.name: _written_inputs(n) for n in captured.gm.graph.nodes}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._captured.restore_output(self._captured.gm(*flat_inputs(self._captured, args, kwargs)))

    def optimizer(self, cls: type[torch.optim.Optimizer], **kwargs: Any) -> DeviceOptimizers:
        """``cls(params, **kwargs)`` for each device over the parameters its nodes read (a
        parameter read on several devices goes to the first; one no node reads, to the first
        device), stepped at once by :meth:`DeviceOptimizers.step`."""
        gm = self._captured.gm
        owner: dict[torch.Tensor, int] = {}
        for d, tasks in self._order.items():
            for node in (n for segment, kind in tasks if kind == "forward" for n in segment):
                if node.op == "call_module":
                    params = list(gm.get_submodule(str(node.target)).parameters())
                elif node.op == "get_attr":
                    value = self._interpreter.fetch_attr(str(node.target))
                    params = [value] if isinstance(value, torch.nn.Parameter) else []
                else:
                    continue
                for p in params:
                    owner.setdefault(p, d)
        first = self.plan.stage_devices[0]
        for p in self.model.parameters():
            owner.setdefault(p, first)
        groups = {d: [p for p, o in owner.items() if o == d] for d in self.plan.stage_devices}
        return DeviceOptimizers({d: cls(ps, **kwargs) for d, ps in groups.items() if ps})

    def step(self, *args: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], **kwargs: Any) -> torch.Tensor:
        """One training step: forward and backward of every node on its device's worker, in the
        planned order; the loss on this thread. Returns the loss (detached); gradients accumulate."""
        gm = self._captured.gm
        env: dict[fx.Node, Any] = {}
        for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"),
                               flat_inputs(self._captured, args, kwargs)):
            env[node] = value
        output_node = next(n for n in gm.graph.nodes if n.op == "output")
        state = _Step(self._interpreter, env)
        threads = [threading.Thread(target=state.work, args=(tasks, self._writes), daemon=True)
                   for tasks in self._order.values()]
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for t in threads:
                t.start()
            result = state.wait_for(output_node.args[0])
            out = pytree.tree_map(_cut, result)
            loss = loss_fn(out, target)
            loss.backward()
            state.send_back(output_node.args[0], out)
            for t in threads:
                t.join()
        except _Abort:  # a worker failed before the outputs were ready: its error is raised below
            pass
        finally:
            state.abort_if_running()
            torch.set_num_threads(previous)
        if state.error is not None:
            raise DistributedError(advice(
                f"a device worker of the makespan runtime failed: {type(state.error).__name__}: {state.error}",
                "the node it ran raised", "run the model unsplit with the same inputs to see the error",
            )) from state.error
        return loss.detach()


class DeviceOptimizers:
    """One optimizer per device of a makespan plan; :meth:`step` runs them at once, one thread
    each with one intra-op thread, as the devices' workers do."""

    def __init__(self, optimizers: dict[int, torch.optim.Optimizer]):
        self.optimizers = optimizers

    def step(self) -> None:
        errors: list[BaseException] = []

        def run(opt: torch.optim.Optimizer) -> None:
            torch.set_num_threads(1)  # per thread, as the workers (see _Step.work)
            try:
                opt.step()
            except BaseException as e:  # noqa: BLE001 — raised typed on the calling thread below
                errors.append(e)

        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            threads = [threading.Thread(target=run, args=(opt,), daemon=True) for opt in self.optimizers.values()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            torch.set_num_threads(previous)
        if errors:
            raise DistributedError(advice(
                f"a device's optimizer step failed: {type(errors[0]).__name__}: {errors[0]}",
                "the optimizer raised on its parameters", "step the same optimizer on the unsplit model to see the error",
            )) from errors[0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[int, dict[str, Any]]:
        return {d: opt.state_dict() for d, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict[int, dict[str, Any]]) -> None:
        for d, opt in self.optimizers.items():
            opt.load_state_dict(state[d])


def _cut(value: Any) -> Any:
    """A tensor detached into a leaf of its own graph (gradient wanted if the original had one)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return value.detach().requires_grad_(value.requires_grad)
    return value


def _written_inputs(node: fx.Node) -> frozenset[str]:
    """Names of the input nodes ``node`` writes in place (annotation saw their version move)."""
    try:
        return frozenset(node_info(node).mutates)
    except KeyError:  # placeholders and outputs carry no annotation
        return frozenset()


Segment = tuple[fx.Node, ...]


def _segments(gm: fx.GraphModule, plan: Plan) -> dict[int, list[tuple[Segment, str]]]:
    """Each device's segments, forward and backward, in one global order (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    # What a node must follow: its inputs, and the earlier readers of a value it writes in place.
    after: dict[fx.Node, set[fx.Node]] = {n: set(n.all_input_nodes) for n in nodes}
    for n in nodes:
        for name in _written_inputs(n):
            after[n] |= {r for r in by_name[name].users if r is not n and position[r] < position[n]}

    runs = sorted(plan.tasks, key=lambda t: run_key(t.start, t.end, t.kind, position[by_name[t.node]]))
    rank = {(t.node, t.kind): i for i, t in enumerate(runs)}
    segments: list[list[fx.Node]] = []
    device_of: list[int] = []
    segment_of: dict[fx.Node, int] = {}
    open_on: dict[int, tuple[int, int]] = {}  # device → (its open segment, the rank of that segment's first task)
    for t in runs:
        if t.kind == "backward":
            open_on.pop(t.device, None)
            continue
        node = by_name[t.node]
        i, start = open_on.get(t.device, (-1, -1))
        # A node joins the open segment only if every value it reads from outside was planned
        # before the segment began: then every segment depends only on segments begun earlier,
        # and the segments form a DAG (no path leaves a segment and comes back).
        if i < 0 or any(segment_of.get(p) != i and rank.get((p.name, "forward"), -1) >= start for p in after[node]):
            i, start = len(segments), rank[t.node, "forward"]
            open_on[t.device] = (i, start)
            segments.append([])
            device_of.append(t.device)
        segments[i].append(node)
        segment_of[node] = i
    # Every forward before every backward (the loss needs every output); within each kind, a
    # topological order of the segments, earliest planned first.
    feeds = [{segment_of[p] for n in seg for p in after[n] if p in segment_of} - {i} for i, seg in enumerate(segments)]
    needs = [{segment_of[u] for n in seg for u in n.users if u in segment_of} - {i} for i, seg in enumerate(segments)]
    order: dict[int, list[tuple[Segment, str]]] = {d: [] for d in plan.stage_devices}
    for kind, prerequisites in (("forward", feeds), ("backward", needs)):
        planned = [min(rank[n.name, kind] for n in seg) for seg in segments]
        ranked = _topological(prerequisites, planned)
        if len(ranked) < len(segments):  # cannot happen: every segment depends only on earlier ones
            raise CodegenError(advice(
                f"the makespan runtime's {kind} segments form a cycle ({len(segments) - len(ranked)} of {len(segments)} left)",
                "a segment reads a value computed after it began", "report this plan: it is a bug",
            ))
        for i in ranked:
            order[device_of[i]].append((tuple(segments[i]), kind))
    return order


def _topological(prerequisites: list[set[int]], priority: list[int]) -> list[int]:
    """A topological order, the lowest ``priority`` first among the ready (fewer than all when there is a cycle)."""
    import networkx as nx  # deferred: networkx loads when a makespan plan first runs

    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(prerequisites)))
    graph.add_edges_from((j, i) for i, pre in enumerate(prerequisites) for j in pre)
    try:
        return list(nx.lexicographical_topological_sort(graph, key=priority.__getitem__))
    except nx.NetworkXUnfeasible:
        return []


class _Step:
    """The shared state of one step: values, cut inputs, returned gradients, and who waits for what."""

    def __init__(self, interpreter: fx.Interpreter, env: dict[fx.Node, Any]):
        self.interpreter = interpreter
        self.env = env
        self.done: dict[fx.Node, threading.Event] = {}
        self.cuts: dict[Segment, list[tuple[fx.Node, Any, Any]]] = {}
        """segment → (producer outside it, the value it received, its cut copy) per tensor input."""
        self.grads: dict[fx.Node, list[Any]] = {}
        """producer → gradient of each flat output, summed over the consumers outside its segment."""
        self.pending: dict[fx.Node, int] = {}
        """producer → cut copies of its outputs whose gradient has not come back yet."""
        self.lock = threading.Condition()
        self.error: BaseException | None = None
        self.stopped = False
        self.loss_done = threading.Event()

    def _event(self, node: fx.Node) -> threading.Event:
        with self.lock:
            return self.done.setdefault(node, threading.Event())

    def wait_for(self, arg: Any) -> Any:
        """``arg`` with every node replaced by its value, once each is computed."""
        for node in _nodes_in(arg):
            if node.op != "placeholder":
                while not self._event(node).wait(0.05):
                    if self.stopped:
                        raise _Abort
        return fx.node.map_arg(arg, lambda n: self.env[n])

    def work(self, tasks: list[tuple[Segment, str]], writes: dict[str, frozenset[str]]) -> None:
        # OpenMP's thread count is per calling thread: a new thread starts with the machine's
        # default, and the oneDNN kernels it runs spread over every core (two Python threads
        # running small convolutions with F.conv2d each took 2× as long as one alone, and as
        # long as one alone once each thread set it).
        torch.set_num_threads(1)
        try:
            for segment, kind in tasks:
                if kind == "forward":
                    self.forward(segment, writes)
                else:
                    self.backward(segment)
        except _Abort:
            pass
        except BaseException as e:  # noqa: BLE001 — handed to the calling thread, which raises it typed
            with self.lock:
                self.error = self.error or e
                self.stopped = True
                self.lock.notify_all()

    def forward(self, segment: Segment, writes: dict[str, frozenset[str]]) -> None:
        """Run the segment's nodes in order; values from outside it are cut (and cloned where a
        node writes them in place); each node's value is published as soon as it is computed."""
        inside = set(segment)
        cuts: list[tuple[fx.Node, Any, Any]] = []
        received: dict[fx.Node, Any] = {}
        for node in segment:
            self.wait_for([p for p in node.all_input_nodes if p not in inside])
            written = writes.get(node.name, frozenset())

            def value_of(producer: fx.Node, written: frozenset[str] = written) -> Any:
                if producer in inside:
                    return self.env[producer]
                if producer not in received:
                    def one(v: Any) -> Any:
                        c = _cut(v)
                        if c is not v:
                            cuts.append((producer, v, c))
                        return c

                    received[producer] = pytree.tree_map(one, self.env[producer])
                value = received[producer]
                return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value) \
                    if producer.name in written else value

            args = fx.node.map_arg(node.args, value_of)
            kwargs = fx.node.map_arg(node.kwargs, value_of)
            value = getattr(self.interpreter, node.op)(node.target, args, kwargs)
            with self.lock:
                self.env[node] = value
            self._event(node).set()
        with self.lock:
            self.cuts[segment] = cuts
            for producer, _, c in cuts:
                if c.requires_grad:
                    self.pending[producer] = self.pending.get(producer, 0) + 1

    def backward(self, segment: Segment) -> None:
        # After the loss (every forward has run, so every cut is counted), and once every
        # consumer outside the segment has returned its gradient.
        while not self.loss_done.wait(0.05):
            if self.stopped:
                raise _Abort
        with self.lock:
            while any(self.pending.get(n, 0) > 0 for n in segment) and not self.stopped:
                self.lock.wait(0.05)
            if self.stopped:
                raise _Abort
            grads = {n: self.grads.pop(n) for n in segment if n in self.grads}
        roots, seeds = [], []
        for node, node_grads in grads.items():
            outs = [o for o in pytree.tree_leaves(self.env[node]) if isinstance(o, torch.Tensor)]
            for o, g in zip(outs, node_grads):
                if g is not None and o.requires_grad:
                    roots.append(o)
                    seeds.append(g)
        if roots:  # one backward through the segment's graph: autograd sums the paths inside it
            torch.autograd.backward(roots, seeds)
        self._return(segment)

    def send_back(self, arg: Any, cut_values: Any) -> None:
        """The loss's gradients of the outputs, to the nodes that made them."""
        made_by = {id(t): n for n in _nodes_in(arg) for t in pytree.tree_leaves(self.env[n]) if isinstance(t, torch.Tensor)}
        values = fx.node.map_arg(arg, lambda n: self.env[n])
        with self.lock:
            for orig, c in zip(pytree.tree_leaves(values), pytree.tree_leaves(cut_values)):
                if isinstance(c, torch.Tensor) and c.grad is not None and id(orig) in made_by:
                    self._add(made_by[id(orig)], orig, c.grad)
            self.lock.notify_all()
        self.loss_done.set()

    def _return(self, segment: Segment) -> None:
        """Hand the gradients of the segment's cut inputs to their producers."""
        with self.lock:
            for producer, orig, c in self.cuts.get(segment, ()):
                if c.requires_grad:
                    if c.grad is not None:
                        self._add(producer, orig, c.grad)
                    self.pending[producer] -= 1
            self.lock.notify_all()

    def _add(self, producer: fx.Node, orig: torch.Tensor, grad: torch.Tensor) -> None:
        outs = [o for o in pytree.tree_leaves(self.env[producer]) if isinstance(o, torch.Tensor)]
        slot = next(i for i, o in enumerate(outs) if o is orig)
        acc = self.grads.setdefault(producer, [None] * len(outs))
        acc[slot] = grad if acc[slot] is None else acc[slot] + grad

    def abort_if_running(self) -> None:
        with self.lock:
            if any(not e.is_set() for e in self.done.values()) or self.error is not None:
                self.stopped = True
            self.lock.notify_all()


def _nodes_in(arg: Any) -> list[fx.Node]:
    found: dict[fx.Node, None] = {}

    def note(n: fx.Node) -> fx.Node:
        found[n] = None
        return n

    fx.node.map_arg(arg, note)
    return list(found)
