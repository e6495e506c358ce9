"""The runtime of a makespan plan (DLPlacer): each device runs its nodes' forward and backward
tasks in the planned order, as soon as their inputs are there, at the same time as the others.

One worker thread per device (CPU devices; one intra-op thread for the whole process while
a step runs, so each worker is one core's worth of work and the kernels, which release the
GIL, overlap). Every node runs on its own autograd graph: its tensor inputs are cut
(``detach().requires_grad_()``), so its backward can be run on its own device's thread, in
the planned order, once every consumer has returned the gradient of its output — the
hand-driven equivalent of autograd's engine, which would otherwise run the whole backward
on one thread. Parameters are not cut: their gradients accumulate in ``.grad`` as usual
(autograd's accumulation is thread-safe). A node that writes an input in place (``relu_``,
``x += y``) works on a clone of its cut input, so later nodes must read the value it returns
(as traced code does: ``x = relu_(x)``, ``out += identity``). The loss is computed on the
calling thread after every output's forward, as the plan's task model says.

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
from torch.utils import _pytree as pytree

from autosplit.errors import CodegenError, DistributedError, advice
from autosplit.passes.annotate import node_info
from autosplit.passes.capture import Captured, flat_inputs
from autosplit.plan import Plan
from autosplit.solver.makespan.schedule import run_key

__all__ = ["MakespanRunner", "DeviceOptimizers"]


class _Abort(Exception):
    """Another worker failed: stop waiting."""


class MakespanRunner(torch.nn.Module):
    """A model and its makespan plan: ``step`` trains with the devices overlapping; ``forward``
    runs the graph in order (for evaluation)."""

    plan: Plan
    _captured: Captured

    def __init__(self, model: torch.nn.Module, captured: Captured, plan: Plan):
        super().__init__()
        if plan.schedule != "makespan":
            raise CodegenError(advice(
                f"MakespanRunner got a {plan.schedule} plan", "it runs plans made with objective='makespan'",
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
        by_name = {n.name: n for n in captured.gm.graph.nodes}
        position = {name: i for i, name in enumerate(by_name)}
        runs = sorted(plan.tasks, key=lambda t: run_key(t.start, t.end, t.kind, position[t.node]))
        self._order = {d: [(by_name[t.node], t.kind) for t in runs if t.device == d] for d in plan.stage_devices}
        self._writes = {t.node: _written_inputs(by_name[t.node]) for t in plan.tasks}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._captured.gm(*flat_inputs(self._captured, self.model, args, kwargs))

    def optimizer(self, cls: type[torch.optim.Optimizer], **kwargs: Any) -> DeviceOptimizers:
        """``cls(params, **kwargs)`` for each device over the parameters its nodes read (a
        parameter read on several devices goes to the first; one no node reads, to the first
        device), stepped at once by :meth:`DeviceOptimizers.step`."""
        gm = self._captured.gm
        owner: dict[torch.Tensor, int] = {}
        for d, tasks in self._order.items():
            for node, kind in tasks:
                if kind != "forward":
                    continue
                if node.op == "call_module":
                    params = list(gm.get_submodule(str(node.target)).parameters())
                elif node.op == "get_attr":
                    value: Any = gm
                    for part in str(node.target).split("."):
                        value = getattr(value, part)
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
                               flat_inputs(self._captured, self.model, args, kwargs)):
            env[node] = value
        output_node = next(n for n in gm.graph.nodes if n.op == "output")
        state = _Step(gm, env)
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
    try:
        return frozenset(p.name for p in node_info(node).mutates)
    except (KeyError, AttributeError):
        return frozenset()


class _Step:
    """The shared state of one step: values, cut inputs, returned gradients, and who waits for what."""

    def __init__(self, gm: fx.GraphModule, env: dict[fx.Node, Any]):
        self.gm = gm
        self.env = env
        self.done: dict[fx.Node, threading.Event] = {}
        self.cuts: dict[fx.Node, list[tuple[fx.Node, Any, Any]]] = {}
        """consumer → (producer, the value it received, its cut copy) per tensor input."""
        self.grads: dict[fx.Node, list[Any]] = {}
        """producer → gradient of each flat output, summed over consumers."""
        self.pending: dict[fx.Node, int] = {}
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

    def work(self, tasks: list[tuple[fx.Node, str]], writes: dict[str, frozenset[str]]) -> None:
        try:
            for node, kind in tasks:
                if kind == "forward":
                    self.forward(node, writes.get(node.name, frozenset()))
                else:
                    self.backward(node)
        except _Abort:
            pass
        except BaseException as e:  # noqa: BLE001 — handed to the calling thread, which raises it typed
            with self.lock:
                self.error = self.error or e
                self.stopped = True
                self.lock.notify_all()

    def forward(self, node: fx.Node, writes: frozenset[str]) -> None:
        self.wait_for((node.args, node.kwargs))
        cuts: list[tuple[fx.Node, Any, Any]] = []

        def cut_input(producer: fx.Node) -> Any:
            def one(v: Any) -> Any:
                c = _cut(v)
                if c is not v:
                    cuts.append((producer, v, c))
                    return c.clone() if producer.name in writes else c
                return v

            return pytree.tree_map(one, self.env[producer])

        args = fx.node.map_arg(node.args, cut_input)
        kwargs = fx.node.map_arg(node.kwargs, cut_input)
        target: Any = node.target
        if node.op == "call_function":
            value = target(*args, **kwargs)
        elif node.op == "call_method":
            value = getattr(args[0], target)(*args[1:], **kwargs)
        elif node.op == "call_module":
            value = self.gm.get_submodule(target)(*args, **kwargs)
        else:  # get_attr
            value = self.gm
            for part in str(target).split("."):
                value = getattr(value, part)
        with self.lock:
            self.env[node] = value
            self.cuts[node] = cuts
            for producer, _, c in cuts:
                if c.requires_grad:
                    self.pending[producer] = self.pending.get(producer, 0) + 1
        self._event(node).set()

    def backward(self, node: fx.Node) -> None:
        # After the loss (every forward has run, so every consumer's cut is counted), and once
        # every consumer has returned its gradient.
        while not self.loss_done.wait(0.05):
            if self.stopped:
                raise _Abort
        with self.lock:
            while self.pending.get(node, 0) > 0 and not self.stopped:
                self.lock.wait(0.05)
            if self.stopped:
                raise _Abort
            grads = self.grads.pop(node, None)
        if grads is not None:
            outs = [o for o in pytree.tree_leaves(self.env[node]) if isinstance(o, torch.Tensor)]
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self._return(node)

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

    def _return(self, node: fx.Node) -> None:
        """Hand the gradients of ``node``'s cut inputs to their producers."""
        with self.lock:
            for producer, orig, c in self.cuts.get(node, ()):
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
