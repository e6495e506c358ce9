"""Random DAG models split = unsplit.

Hypothesis draws a small *program*: a list of ops over a growing list of values of one
feature width, each op reading one or two earlier values, so branches and skip connections
arise. Ops: a Linear of its own, one shared Linear called at several points (a module used
twice), tanh / sigmoid / relu, add / mul of two values, concat of two values then a Linear
back to the width, ``* scale`` (a float kwarg) and ``+ bias`` (a tensor kwarg). A value just
produced by a Linear, the shared Linear, an add, a concat's Linear or the bias add may be
written in place (``nn.ReLU(inplace=True)``, ``add_``, ``mul_``, ``torch.relu_``) before
anything reads it, which eager autograd allows. The output is a tensor, a tuple, or a dict
holding a tensor and a tuple, made of several values, including non-final ones, so values
cross stages. A real ``nn.Module`` interprets the fixed program in a plain Python loop,
which ``torch.fx`` unrolls. The model is split over 2–4 CPU devices in float64 and one
training step (outputs and every parameter gradient) must match the original.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import autosplit
from tests.helpers import assert_same_step

WIDTH, BATCH = 4, 3

ACTS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu}
# Ops that produce a fresh tensor autograd does not save for backward: safe to write in place.
WRITABLE = {"lin", "shared", "add", "cat", "bias"}
IN_PLACE = (None, None, "relu_module", "add_", "mul_", "relu_")


@dataclass(frozen=True)
class Op:
    kind: str  # lin, shared, act, add, mul, cat, scale, bias
    srcs: tuple[int, ...]  # indices into the values (0 is the input x; value i + 1 is op i's result)
    act: str | None = None
    in_place: str | None = None
    const: float = 0.5


@dataclass(frozen=True)
class Program:
    ops: tuple[Op, ...]
    form: str  # tensor, tuple, dict
    outputs: tuple[int, ...]  # value indices; a tensor output returns the first
    devices: int

    def units(self) -> int:
        """How many stages the planner can fill: the program's graph nodes, contracted.

        Every op is one node (a concat two: ``cat`` and its Linear); an in-place write stays
        with the tensor it writes (same op here); the calls of the shared Linear stay together
        (``CostTable.colocate``), and since stages run in order, so does every node on a path
        from one call to another. Fewer units than devices is an ``InfeasiblePlanError``.
        """
        # per op: its first and last node; per node: predecessors
        first: list[int] = []
        last: list[int] = []
        preds: list[set[int]] = []
        for op in self.ops:
            inputs = [last[s - 1] for s in op.srcs if s > 0]
            first.append(len(preds))
            preds.append(set(inputs))
            if op.kind == "cat":
                preds.append({len(preds) - 1})
            last.append(len(preds) - 1)
        ancestors: list[set[int]] = []
        for p in preds:
            ancestors.append(set(p).union(*(ancestors[q] for q in p)))
        group = {first[i] for i, op in enumerate(self.ops) if op.kind == "shared"}
        between = {n for n in range(len(preds)) if ancestors[n] & group and any(n in ancestors[g] for g in group)}
        return len(preds) - max(len(group | between) - 1, 0)

class RandomDAG(nn.Module):
    def __init__(self, program: Program):
        super().__init__()
        self.program = program
        ops = program.ops
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for op in ops if op.kind == "lin")
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.joins = nn.ModuleList(nn.Linear(2 * WIDTH, WIDTH) for op in ops if op.kind == "cat")
        self.relus = nn.ModuleList(nn.ReLU(inplace=True) for op in ops if op.in_place == "relu_module")

    def forward(self, x, bias=None, scale: float = 1.0):
        values = [x]
        lin = join = relu = 0
        for op in self.program.ops:
            a = values[op.srcs[0]]
            b = values[op.srcs[-1]]
            if op.kind == "lin":
                y = self.layers[lin](a)
                lin += 1
            elif op.kind == "shared":
                y = self.shared(a)
            elif op.kind == "act":
                y = ACTS[cast(str, op.act)](a)
            elif op.kind == "add":
                y = a + b
            elif op.kind == "mul":
                y = a * b
            elif op.kind == "cat":
                y = self.joins[join](torch.cat([a, b], dim=-1))
                join += 1
            elif op.kind == "scale":
                y = a * scale
            elif op.kind == "bias":
                y = a + bias
            else:
                raise AssertionError(op.kind)
            if op.in_place == "relu_module":
                y = self.relus[relu](y)
                relu += 1
            elif op.in_place == "add_":
                y.add_(op.const)
            elif op.in_place == "mul_":
                y.mul_(op.const)
            elif op.in_place == "relu_":
                torch.relu_(y)
            values.append(y)
        outs = [values[i] for i in self.program.outputs]
        if self.program.form == "tensor":
            return outs[0]
        if self.program.form == "tuple":
            return tuple(outs)
        return {"main": outs[0], "aux": tuple(outs[1:])}


FREE_KINDS = ("lin", "lin", "act", "add", "mul", "cat", "shared")


@st.composite
def programs(draw) -> Program:
    n = draw(st.integers(4, 12), label="ops")
    kinds = list(draw(st.lists(st.sampled_from(FREE_KINDS), min_size=n, max_size=n), label="kinds"))
    # The kwargs are always used, and the shared Linear, when present, at two or more points.
    n_shared = draw(st.sampled_from((0, 2, 2, 3)), label="shared calls")
    mandatory = ["scale", "bias"] + ["shared"] * min(n_shared, n - 2)
    kinds = [k if k != "shared" else "lin" for k in kinds]
    places = draw(st.permutations(range(n)), label="mandatory places")[: len(mandatory)]
    for place, kind in zip(places, mandatory):
        kinds[place] = kind
    ops = []
    for i, kind in enumerate(kinds):
        arity = 2 if kind in ("add", "mul", "cat") else 1
        srcs = tuple(draw(st.integers(0, i)) for _ in range(arity))
        act = draw(st.sampled_from(sorted(ACTS))) if kind == "act" else None
        in_place = draw(st.sampled_from(IN_PLACE)) if kind in WRITABLE else None
        const = draw(st.sampled_from((0.5, -1.0, 2.0))) if in_place in ("add_", "mul_") else 0.5
        ops.append(Op(kind, srcs, act, in_place, const))
    form = draw(st.sampled_from(("dict", "tuple", "tensor")))
    extra = {"tensor": (0, 0), "tuple": (0, 3), "dict": (1, 3)}[form]
    others = draw(st.lists(st.integers(1, n - 1), unique=True, min_size=extra[0], max_size=extra[1]))
    # The loss must reach a parameter: if no output does, the latest value that does joins them.
    trained = [False]
    for op in ops:
        trained.append(op.kind in ("lin", "shared", "cat") or any(trained[s] for s in op.srcs))
    outputs = (n, *others)
    if not any(trained[i] for i in outputs):
        assume(any(trained))
        latest = max(i for i, t in enumerate(trained) if t)
        outputs = (latest,) if form == "tensor" else (*outputs, latest)
    program = Program(tuple(ops), form, outputs, devices=0)
    devices = min(draw(st.sampled_from((4, 3, 2)), label="devices"), program.units())
    return Program(program.ops, form, program.outputs, devices)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_dag_splits_like_original(program):
    torch.manual_seed(0)
    model = RandomDAG(program).double()
    x = torch.randn(BATCH, WIDTH, dtype=torch.float64)
    kwargs = {"bias": torch.randn(WIDTH, dtype=torch.float64), "scale": 0.5}
    reference = copy.deepcopy(model)
    devices = ["cpu"] * program.devices
    split = autosplit.autosplit(model, devices, example_inputs=(x,), example_kwargs=kwargs, time_limit=1.0)
    assert len(set(split.plan.assignment.values())) == len(devices), "every device gets a stage"
    assert [n for n, _ in split.named_parameters()] == [n for n, _ in reference.named_parameters()]
    event(f"{program.devices} devices, {program.form} output")
    for op in program.ops:
        if op.in_place:
            event(f"in place: {op.in_place}")
    if sum(op.kind == "shared" for op in program.ops) >= 2:
        event("shared Linear called at 2+ points")
    assert_same_step(split(x, **kwargs), reference(x, **kwargs), split.named_parameters(), reference.parameters())
