"""Activation checkpointing in the generated stages (``Plan.recompute``): each recomputed block's
nodes in a stage run as one region under ``torch.utils.checkpoint``, train exactly as the unsplit
model (float64; dropout draws the forward's mask again), keep fewer activations for the backward
(a block that keeps some micro-batches: only the others), and a block whose rerun would differ or
update state twice is refused by name."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.errors import CodegenError
from autosplit.microbatch import split_batch
from autosplit.passes.chain import generate_chain
from autosplit.passes.codegen import generate
from autosplit.passes.recompute_regions import micro_batch, written_inputs
from autosplit.plans import PartialRecompute
from tests.helpers import (
    NO_SEARCH,
    ExampleCode,
    as_float64,
    assert_same_step,
    assert_trains_like,
    gpt_case,
    reference_step,
    says,
    seeded_gpt,
    where,
)

STEPS = 3


def _planner(model, inputs, devices: int = 2, **options):
    return autosplit.Planner(model, ["cpu"] * devices, example_inputs=inputs, **NO_SEARCH, **options)


def _recomputing(planner, *blocks: str):
    return dataclasses.replace(planner.plan(), recompute=blocks)


def _blocks(model) -> tuple[str, ...]:
    return tuple(f"blocks.{i}" for i in range(len(model.blocks)))


def test_stage_code_calls_each_block_region_under_checkpoint():
    model, inputs = seeded_gpt(3)
    planner = _planner(model, inputs)
    plain = planner.build(planner.plan())
    split = planner.build(_recomputing(planner, "blocks.1"))
    assert split.plan.recompute == ("blocks.1",)
    codes = [stage.code.replace(" ", "") for stage in split.stages]
    assert any("torch.utils.checkpoint.checkpoint(recompute_blocks_1," in code for code in codes)
    assert all("use_reentrant=False" in code for code in codes if "checkpoint(" in code)
    for stage, before in zip(split.stages, plain.stages):
        # The region holds no state of its own: the stage's parameters and state dict keep the model's names.
        assert set(stage.state_dict()) == set(before.state_dict())
        assert {n for n, _ in stage.named_parameters()} == {n for n, _ in before.named_parameters()}
    stage = next(s for s in split.stages if hasattr(s, "recompute_blocks_1"))
    region = stage.recompute_blocks_1
    assert "blocks_1_attn_qkv" in region.code and region.blocks is stage.blocks
    twin = copy.deepcopy(stage)  # a copy's region reads the copy's modules
    assert twin.recompute_blocks_1.blocks is twin.blocks is not stage.blocks


def test_recomputed_gpt_trains_like_the_unsplit_model():
    model, inputs = seeded_gpt(3)
    model = model.double()
    plan = _recomputing(_planner(model, inputs), *_blocks(model))
    split = assert_trains_like(model, ["cpu"] * 2, inputs, plan=plan, steps=STEPS)
    assert split.plan.recompute == _blocks(model)
    assert sum(hasattr(stage, "recompute_blocks_0") for stage in split.stages) == 1


class DropoutBlocks(nn.Module):
    """Residual blocks with dropout: a recomputed block must draw the forward's mask again."""

    def __init__(self, width: int = 16, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.5)) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_recomputed_dropout_draws_the_forward_mask_again():
    torch.manual_seed(0)
    model, x = DropoutBlocks().double(), torch.randn(8, 16, dtype=torch.float64)
    reference = copy.deepcopy(model)
    plan = _recomputing(_planner(model, (x,)), *_blocks(model))
    split = autosplit.autosplit(model, None, example_inputs=(x,), plan=plan)
    assert sum("checkpoint(" in stage.code for stage in split.stages) == 2
    opt, ref_opt = torch.optim.Adam(split.parameters(), lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(STEPS):
        torch.manual_seed(step)
        out = split(x)
        torch.manual_seed(step)
        assert_same_step(out, reference(x), split.named_parameters(), reference.parameters())
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for (name, p), q in zip(split.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=where(f"{name} after {STEPS} steps"))


def _saved_bytes(stage: torch.nn.Module, received: tuple, inputs: dict) -> tuple[int, tuple]:
    """Bytes of the tensors autograd keeps for the backward of one run of ``stage``, and what it returns."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(*received, **inputs)
    return saved, out


def test_a_block_that_keeps_some_micro_batches_checkpoints_only_the_others():
    model, inputs = seeded_gpt(4)
    planner = _planner(model, inputs)
    plan, captured = planner.plan(), planner.traced.captured
    micro = split_batch(planner.traced.inputs, None, 1)[0][0]
    blocks = _blocks(model)
    chain = generate_chain(captured, plan.stage_of, 2, micro, recompute=blocks,
                           partial=[PartialRecompute(b, 2, 3) for b in blocks])  # of every 3 micro-batches, 2 keep
    full = generate_chain(captured, plan.stage_of, 2, micro, recompute=blocks)
    assert "keep=2,window=3" in chain.stages[0].code.replace(" ", "")
    named = dict(zip(chain.input_names, micro))
    recomputing, expected = _saved_bytes(full.stages[0], (), named)
    for i in range(6):
        with micro_batch(i):
            saved, out = _saved_bytes(chain.stages[0], (), named)
        torch.testing.assert_close(out, expected)
        assert (saved > recomputing) == (i % 3 < 2), f"micro-batch {i}: {saved} bytes saved, {recomputing} when recomputing"
    assert _saved_bytes(chain.stages[0], (), named)[0] == recomputing, "outside a pipeline stage every micro-batch recomputes"
    assert [PartialRecompute("b", 2, 3).recomputes(i) for i in range(7)] == [False, False, True] * 2 + [False]
    assert all(sum(not PartialRecompute("b", k, w).recomputes(i) for i in range(j, j + w)) == k
               for w in range(1, 6) for k in range(w + 1) for j in range(10)), "any window of consecutive micro-batches keeps k"


def test_recomputing_every_block_keeps_fewer_activations_in_each_stage():
    model, inputs = seeded_gpt(4)
    planner = _planner(model, inputs)
    plan, captured = planner.plan(), planner.traced.captured
    micro = split_batch(planner.traced.inputs, None, 1)[0][0]
    chains = [generate_chain(captured, plan.stage_of, 2, micro, recompute=blocks) for blocks in ((), _blocks(model))]
    named = dict(zip(chains[0].input_names, micro))
    received: list[tuple] = [(), ()]  # [without, with recompute]: what the previous stage returned
    for s in range(2):
        saved = [0, 0]
        for i, chain in enumerate(chains):
            saved[i], received[i] = _saved_bytes(chain.stages[s], received[i], named)
        assert saved[1] < saved[0], f"stage {s}: {saved[1]} bytes kept with every block recomputed, {saved[0]} without"
        torch.testing.assert_close(received[1], received[0])


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x.add_(1.0)
        return self.lin(x)


class InPlaceBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.writer = WritesItsInput()
        self.norm = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))

    def forward(self, x):
        return self.norm(self.writer(self.first(x)))


def _generate(planner, *blocks: str):
    """The stages of the planner's plan with ``blocks`` recomputed, made by codegen itself (planning
    checks the blocks a saved plan names before codegen is reached)."""
    plan = planner.plan()
    return generate(planner.traced.captured, plan.stage_of, ["cpu"] * len(plan.stage_devices), recompute=blocks)


@pytest.mark.parametrize("block", ["blocks.9", "wpe.weight", "block.1", ""])
def test_a_block_of_no_node_is_a_typed_error_naming_it(block):
    model, inputs = seeded_gpt(3)
    with pytest.raises(CodegenError) as excinfo:
        _generate(_planner(model, inputs), "blocks.1", block)
    says(excinfo, repr(block), "blocks.")


def test_a_module_forward_never_calls_holds_no_block():
    planner = _planner(ExampleCode(), (torch.randn(4, 8),), devices=1)  # ExampleCode never calls lin1
    with pytest.raises(CodegenError) as excinfo:
        _generate(planner, "lin1")
    says(excinfo, "'lin1'", "lin0")


def test_writes_read_from_the_code_know_pythons_operators_from_torchs_in_place_ones():
    """Where no annotation recorded what a node writes, its code says: ``x.add_(y)`` and
    ``relu(x, inplace=True)`` write ``x``; ``a & b`` (``operator.and_``, a trailing underscore too) writes nothing."""

    class Ops(nn.Module):
        def forward(self, x, mask):
            both = mask & (x > 0)
            x = x.clone()
            x.add_(1.0)
            return torch.nn.functional.relu(x * both, inplace=True)

    gm = torch.fx.symbolic_trace(Ops())
    written = {n.name: [w.name for w in written_inputs(gm, n)] for n in gm.graph.nodes}
    assert written["and_"] == [] and written["add_"] == ["clone"] and written["relu"] == ["mul"], written


def test_blocks_that_would_change_state_twice_are_refused():
    torch.manual_seed(0)
    model, x = InPlaceBlocks(), torch.randn(4, 8)
    planner = _planner(model, (x,), devices=1)
    with pytest.raises(CodegenError) as excinfo:
        _generate(planner, "norm")
    says(excinfo, "'norm'", "norm.1", "BatchNorm1d", "running statistics", "leave 'norm' out of recompute")
    with pytest.raises(CodegenError) as excinfo:
        _generate(planner, "writer")
    says(excinfo, "'writer'", "add_", "first", "in place", "leave 'writer' out of recompute")
    # What neither writes what it reads nor holds running statistics recomputes; so does BatchNorm in eval mode.
    assert "checkpoint(" in _generate(planner, "first", "writer.lin").stages[0].code
    model.eval()
    assert "checkpoint(" in _generate(planner, "norm").stages[0].code


class WritesAfter(nn.Module):
    """``h.mul_`` writes, after ``second`` ran, the value ``second`` read."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.first(x)
        y = self.second(h)
        h.mul_(2)
        return y + h


def test_a_block_whose_input_a_later_node_writes_is_refused():
    planner = _planner(WritesAfter(), (torch.randn(4, 8),), devices=1)
    with pytest.raises(CodegenError) as excinfo:
        _generate(planner, "second")
    says(excinfo, "'second'", "mul_", "after it", "first")
    assert "checkpoint(" in _generate(planner, "first").stages[0].code  # a write into a block's output is harmless


class SizedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x, n: int):
        return self.lin(x).reshape(n, 2, 3)


class PassesSizes(nn.Module):
    """A block reading a Python int computed outside it (and on another stage)."""

    def __init__(self):
        super().__init__()
        self.a, self.block = nn.Linear(6, 6), SizedBlock()

    def forward(self, x):
        return self.block(self.a(x), x.size(0))


def test_a_region_takes_python_values_from_outside_it():
    torch.manual_seed(0)
    model, x = PassesSizes().double(), torch.randn(8, 6, dtype=torch.float64)
    reference = copy.deepcopy(model)
    captured = _planner(model, (x,)).traced.captured
    names = [n.name for n in captured.gm.graph.nodes if n.op not in ("placeholder", "output")]
    assignment = {name: int(name.startswith(("block", "reshape"))) for name in names}  # the size on stage 0
    program = generate(captured, assignment, ["cpu"] * 2, recompute=("block",))
    assert_same_step(program.program(x), reference(x), model.named_parameters(), reference.parameters())
    chain = generate_chain(captured, assignment, 2, [x[:4]], recompute=("block",))
    assert "checkpoint(recompute_block,a,4,use_reentrant=False)" in chain.stages[1].code.replace(" ", ""), "a constant per micro-batch"
    torch.testing.assert_close(chain(x[:4]), reference(x[:4]))


# -- the distributed form: 2 gloo processes -----------------------------------------------------------------


def _run_case(schedule: str, partial: bool = False, selective: bool = False, *, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    model = model.double()
    args, kwargs = tuple(as_float64(a) for a in args), {k: as_float64(v) for k, v in kwargs.items()}
    reference = copy.deepcopy(model)
    planner = autosplit.Planner(model, ["cpu"] * world, example_inputs=args, example_kwargs=kwargs, micro_batches=2,
                                schedule=schedule, **NO_SEARCH)
    some = tuple(PartialRecompute(b, 1, 2) for b in _blocks(model)) if partial else ()  # micro-batch 0 keeps, 1 recomputes
    plan = dataclasses.replace(planner.plan(), recompute=_blocks(model), recompute_partial=some, recompute_selective=selective)
    pipe = autosplit.distribute(model, None, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn, plan=plan)
    assert pipe.plan.recompute == _blocks(model) and pipe.plan.recompute_partial == some
    called = "selective=True" if partial and selective else "recompute_unless_kept(" if partial else (
        "recompute_selectively(" if selective else "checkpoint(")
    assert all(isinstance(m, torch.fx.GraphModule) and called in m.code.replace(" ", "") for m in pipe.stage_modules.values())
    opt, ref_opt = torch.optim.Adam(pipe.parameters(), lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    for step in range(STEPS):
        loss = pipe.step(*args, target=target, **kwargs)
        expected = reference_step(reference, args, kwargs, target, loss_fn, chunks=1)
        if pipe.is_last:
            torch.testing.assert_close(loss, expected, msg=where(f"{schedule} step {step} loss"))
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, msg=where(f"{schedule} rank {rank} step {step} grad {name}"))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref_params[name], msg=where(f"{schedule} {name} after {STEPS} steps"))


def test_recomputing_pipeline_trains_like_the_unsplit_model_on_two_processes(gloo):
    gloo(2).run(_run_case, [("gpipe",), ("1f1b",), ("1f1b", True), ("1f1b", False, True), ("gpipe", True, True)])
