"""Input-free values (:mod:`autosplit.passes.input_free`): made by each stage that reads them, never sent.

A value made from constants alone (a causal mask, positions from ``arange``) is the same in every
micro-batch: the stages that read it make it, the chain and the local program never send it, the
cost model charges no transfer and no pipeline buffer for it — and the split still computes what
the model computes. What draws random numbers, reads a buffer or a parameter, or writes, is sent.
"""

from __future__ import annotations

import copy

import torch

import autosplit
from autosplit.compiler.costs import cost_table
from autosplit.devices import resolve_devices
from autosplit.passes.chain import generate_chain
from autosplit.passes.codegen import generate
from autosplit.passes.input_free import input_free
from autosplit.solver.build import build_problem


class Masked(torch.nn.Module):
    """Attention-like mixing under a causal mask the model builds itself, noise, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(8, 8, dtype=torch.bool).tril()  # input-free
        noise = torch.rand(8, 16) * 0  # random: never made twice
        h = self.a(x) + noise
        mixed = (h @ h.transpose(1, 2)).masked_fill(~mask, 0.0) @ h
        return self.b(mixed) * self.scale


def _traced(model, x):
    """Captured by ``torch.export``, whose graphs make constants with ops (a symbolic trace runs
    code that reads no input once, while tracing, and keeps its value as a constant)."""
    return autosplit.Planner(model, ["cpu"] * 2, example_inputs=(x,), capture="export").traced


def _names(gm, op_names):
    """The graph's node names whose target is named one of ``op_names``."""
    return {n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method")
            and (str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")).split(".")[0] in op_names}


def test_what_is_made_from_constants_alone_is_input_free_and_nothing_else():
    traced = _traced(Masked(), torch.randn(4, 8, 16))
    gm = traced.captured.gm
    free = input_free(gm)
    assert _names(gm, {"ones", "tril"}) <= free and any(n in free for n in _names(gm, {"invert", "bitwise_not", "__invert__"}))
    assert not _names(gm, {"rand", "mul"}) & free, "random numbers, and what reads them, are made once"
    reads = {n.name for n in gm.graph.nodes if any(u.op in ("placeholder", "get_attr") for u in n.all_input_nodes)}
    assert not reads & free, "nothing that reads an input, a parameter or a buffer"


def _split_after_noise(gm):
    """Stage 0: the mask, the noise and the first layer; stage 1: the rest (reads the mask)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    first = max(i for i, n in enumerate(nodes) if n.name in _names(gm, {"add"}))
    stage = {n.name: int(i > first) for i, n in enumerate(nodes)}
    return {**stage, **{n.name: stage[next(iter(n.users)).name] for n in nodes if n.op == "get_attr"}}  # with their reader


def test_a_stage_makes_the_mask_it_reads_and_trains_as_the_model():
    torch.manual_seed(0)
    model, x = Masked().double(), torch.randn(4, 8, 16, dtype=torch.float64)
    reference = copy.deepcopy(model)
    traced = _traced(model, x)
    gm, assignment = traced.captured.gm, _split_after_noise(traced.captured.gm)
    free = input_free(gm)
    mask_readers = [n for n in gm.graph.nodes if any(u.name in free for u in n.all_input_nodes) and n.name not in free]
    assert {assignment[n.name] for n in mask_readers} == {1}, "the split puts the mask's reader on stage 1"

    chain = generate_chain(traced.captured, assignment, 2, [x])
    assert not set(chain.crossings[0]) & free, "the chain sends no input-free value"
    assert len(chain.crossings[0]) == 1, "stage 1 receives the first layer's output alone"
    out = chain.output(chain.stages[1](*chain.stages[0](x=x), x=x))
    expected = reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)

    program = generate(traced.captured, assignment, ["cpu", "cpu"])
    received = [n.name for n in program.stages[1].graph.nodes if n.op == "placeholder"]
    assert not set(received) & free and len(received) == 1
    torch.testing.assert_close(program.program(x), expected, rtol=0, atol=1e-12)


def test_the_cost_model_charges_no_transfer_and_no_buffer_for_an_input_free_value():
    planner = autosplit.Planner(Masked(), ["cpu"] * 2, example_inputs=(torch.randn(4, 8, 16),), micro_batches=2, schedule="1f1b",
                                capture="export")
    table, _ = cost_table(planner.traced, tuple(resolve_devices(["cpu"] * 2)), planner.options, micro_batches=2)
    free = [n for n, is_free in enumerate(table.input_free) if is_free]
    mask = max(free)  # the last made (what masked_fill reads), from all the others: ones, then tril
    assert len(free) == 3 and table.output_bytes[mask] == 8 * 8  # one bool per pair
    problem = build_problem(table, micro_batches=2, schedule="1f1b")
    made_from = free
    assert problem.transfer[mask][0] == round(sum(table.fwd_time[n][0] for n in made_from) * 1e9), \
        "crossing costs the reading stage its making of the mask, not a transfer"
    assert problem.buffer_mem[mask] == 0 and problem.send_mem[mask][0] == 0
    assert problem.recv_mem[mask][1] == problem.act_mem[mask][1], "the reader holds its own copy as the maker does"
    assert problem.transfer[max(n for n in range(len(table.nodes)) if n not in free)][0] > 0, "other values are sent"


class Written(torch.nn.Module):
    """A constant written in place through a view after a first read: a later read sees the write."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(8, dtype=x.dtype)
        h = self.a(x) * scale
        scale[:4].mul_(3.0)
        return self.b(h) * scale


def test_a_value_written_in_place_is_sent_as_written_not_made_again():
    model, x = Written().double(), torch.randn(4, 8, dtype=torch.float64)
    traced = _traced(model, x)
    gm = traced.captured.gm
    assert not input_free(gm), "the constant and its view are written: a stage after the write must receive them"
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    last_read = max(i for i, n in enumerate(nodes) if n.op == "call_function" and "ones" in {u.name for u in n.all_input_nodes})
    assignment = {n.name: int(i >= last_read) for i, n in enumerate(nodes)}  # the last product on stage 1
    chain = generate_chain(traced.captured, assignment, 2, [x])
    assert "ones" in chain.crossings[0], "the written constant crosses, written"
    torch.testing.assert_close(chain.output(chain.stages[1](*chain.stages[0](x=x), x=x)), model(x), rtol=0, atol=1e-12)
