"""The chain form of a plan (DESIGN §4.6): neighbours only, tensors only, contiguous, fixed order.

Run in one process, the chain must compute what the model computes (outputs and gradients,
float64); its crossings must be what ``torch.distributed.pipelining`` can send.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autosplit
from autosplit.examples import GPT
from autosplit.microbatch import split_batch
from autosplit.passes.chain import generate_chain
from tests.helpers import NO_SEARCH, ZOO, assert_same_step, padding_mask


def _chain(model, devices, inputs, kwargs, micro_batches=1):
    planner = autosplit.Planner(model, ["cpu"] * devices, example_inputs=inputs, example_kwargs=kwargs, **NO_SEARCH)
    plan = planner.plan()
    traced = planner.traced
    micro = split_batch(traced.inputs, None, micro_batches)[0][0]
    return generate_chain(traced.captured, plan.stage_of, devices, micro), traced, plan


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_chain_computes_what_the_model_computes(name, devices):
    model, inputs, kwargs = ZOO[name]()
    model = model.double()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    reference = copy.deepcopy(model)
    chain, traced, _ = _chain(model, devices, inputs, kwargs)
    assert_same_step(chain(*traced.inputs), reference(*inputs, **kwargs), model.named_parameters(), reference.parameters())


def test_crossings_are_neighbour_only_contiguous_tensors_in_a_recorded_order():
    model = GPT(vocab=40, d_model=16, n_layers=4, n_heads=2, max_len=8)
    tokens, mask = torch.randint(0, 40, (4, 8)), padding_mask(4, 8)
    chain, traced, _ = _chain(model, 4, (tokens,), {"attention_mask": mask}, micro_batches=2)
    inputs = dict(zip(chain.input_names, split_batch(traced.inputs, None, 2)[0][0]))
    received: tuple = ()
    for s, stage in enumerate(chain.stages):
        assert len(received) == len(chain.inputs_meta[s])
        for t, meta in zip(received, chain.inputs_meta[s]):
            assert isinstance(t, torch.Tensor) and t.is_contiguous()
            assert (t.shape, t.dtype, t.requires_grad) == (meta.shape, meta.dtype, meta.requires_grad)
        received = stage(*received, **inputs)
        assert len(received) == len(chain.outputs_meta[s])
        if s < len(chain.stages) - 1:
            assert len(received) == len(chain.crossings[s])
    assert received[0].shape == (2, 8, 40), "shapes are per micro-batch"
    # The tied embedding lives on stage 0 and is relayed to the head's stage (sent per micro-batch).
    assert all("wte_weight" in names for names in chain.crossings)


def test_python_values_crossing_a_boundary_become_constants_per_micro_batch():
    class Reshaper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

        def forward(self, x):
            n = x.size(0)  # a Python int computed on stage 0, used on the last stage
            h = self.a(x).t()  # a transposed (non-contiguous) tensor crossing a boundary
            return self.b(h.t()).reshape(n, 2, 3)

    model = Reshaper()
    x = torch.randn(8, 6)
    traced = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(x,)).traced
    names = [n.name for n in traced.captured.gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert names == ["size", "a", "t", "t_1", "b", "reshape"]
    assignment = {name: int(name in ("t_1", "b", "reshape")) for name in names}  # size and t on stage 0
    chain = generate_chain(traced.captured, assignment, 2, [x[:4]])
    assert chain.crossings == (("t",),)
    assert all(m.dtype.is_floating_point for m in chain.inputs_meta[1]), "only tensors cross"
    sent = chain.stages[0](x=x[:4])
    assert all(t.is_contiguous() for t in sent)
    torch.testing.assert_close(chain.output(chain.stages[1](*sent, x=x[:4])), model(x[:4]))
    assert "reshape(4, 2, 3)" in chain.stages[1].code, "the micro-batch's row count is a constant of stage 1"
