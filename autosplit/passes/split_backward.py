"""Split backward: a graph's backward as a zero-bubble pipeline stage runs it, for the profiler.

Zero-bubble schedules split a stage's backward into torch's input pass (I: gradients of the
stage's inputs) and weight pass (W: gradients of its parameters), run apart. To time each node's
share of both, the profiler cuts the graph where its activations first need a gradient, as a
stage boundary would (:func:`cut_at_frontier`), and runs the backward through torch's own
``stage_backward_input`` and ``stage_backward_weight`` (:func:`split_backward`).

Usage::

    cut = cut_at_frontier(flat(gm), inputs)
    out, values, leaves = cut(*inputs)
    seconds_i, seconds_w = split_backward(grad_outputs(out), values, leaves, list(gm.parameters()))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from autosplit import compat
from autosplit.compat import pytree

__all__ = ["cut_at_frontier", "split_backward"]


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


def cut_at_frontier(gm: fx.GraphModule, inputs: Sequence[Any]) -> fx.GraphModule | None:
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


def split_backward(
    outs: list[torch.Tensor], values: list[torch.Tensor], leaves: list[torch.Tensor], params: list[torch.nn.Parameter],
    weight_pass: Callable[[], None] = lambda: None, now: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """The backward of a graph cut by :func:`cut_at_frontier` as a zero-bubble stage runs it:
    torch's input pass (I) down to the leaves, then its weight pass (W) (``weight_pass()`` called
    as it starts); what precedes the cut (the embeddings: weight gradients alone, which torch's
    first stage runs in its W) gets a plain backward. Returns the seconds of I and of W (that plain
    backward included) by the clock ``now`` (on a GPU one that waits for the queued kernels)."""
    # torch's own functions, as its stages call them (imported here: `import autosplit` leaves
    # torch.distributed.pipelining for first use)
    stage_backward_input, stage_backward_weight = compat.stage_backward()

    outs = [o.clone() if o._is_view() else o for o in outs]  # torch detaches them in place, which a view refuses
    t0 = now()
    grads, groups = stage_backward_input(outs, [torch.ones_like(o) for o in outs], leaves, iter(params))
    t1 = now()
    weight_pass()
    stage_backward_weight(iter(params), groups)
    below = [(v, g) for v, g in zip(values, grads) if g is not None]
    if below:
        torch.autograd.backward([v for v, _ in below], [g for _, g in below])
    return t1 - t0, now() - t1
