"""Planning a model built on the meta device, whatever the example inputs: CPU tensors, meta tensors
or shapes alone (``autosplit.Spec``); nothing is allocated for the weights."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.compiler.hybrid import Cluster
from autosplit.errors import CaptureError, ConstraintError, CostModelError
from autosplit.examples import GPT

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _meta_gpt() -> nn.Module:
    with torch.device("meta"):
        return GPT(vocab=128, d_model=32, n_layers=4, max_len=16)


@pytest.mark.parametrize("inputs", ["cpu", "meta", "spec"])
def test_a_meta_model_plans_like_the_real_one_from_any_example(inputs):
    torch.manual_seed(0)
    real = GPT(vocab=128, d_model=32, n_layers=4, max_len=16)
    tokens = torch.randint(0, 128, (8, 16))
    expected = autosplit.plan(real, ["cpu"] * 2, example_inputs=(tokens,), time_limit=2)
    example = {"cpu": tokens, "meta": tokens.to("meta"), "spec": autosplit.Spec((8, 16), torch.long)}[inputs]
    model = _meta_gpt()
    got = autosplit.plan(model, ["cpu"] * 2, example_inputs=(example,), time_limit=2)
    assert got.assignment == expected.assignment and got.step_time == pytest.approx(expected.step_time)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_a_real_model_plans_from_shapes_alone():
    torch.manual_seed(0)
    real = GPT(vocab=128, d_model=32, n_layers=4, max_len=16)
    tokens = torch.randint(0, 128, (8, 16))
    expected = autosplit.plan(real, ["cpu"] * 2, example_inputs=(tokens,), time_limit=2)
    got = autosplit.plan(real, ["cpu"] * 2, example_inputs=(autosplit.Spec((8, 16), torch.long),), time_limit=2)
    assert got.assignment == expected.assignment


def test_compare_and_the_hybrid_planner_take_a_meta_model():
    spec = autosplit.Spec((8, 16), torch.long)
    cmp = autosplit.compare(_meta_gpt(), ["cpu"] * 2, example_inputs=(spec,), manual={"even": [4, 4]}, time_limit=2)
    assert [c.name for c in cmp.candidates][1:] == ["even"] and cmp.autosplit.step_time <= cmp.candidates[1].plan.step_time + 1e-12
    hp = autosplit.plan_hybrid(_meta_gpt(), Cluster.dgx1(nodes=1), example_inputs=(spec,), per_device_batch=8, replica_sizes=[1, 2],
                               time_limit=1)
    assert {r.k for r in hp.rows} == {1, 2}


def test_what_a_meta_model_cannot_do_is_refused_with_what_to_pass():
    spec = autosplit.Spec((8, 16), torch.long)
    with pytest.raises(CostModelError, match=r"meta device.*costs='analytic'"):
        autosplit.plan(_meta_gpt(), ["cpu"] * 2, example_inputs=(spec,), costs="measured", time_limit=1)
    with pytest.raises(ConstraintError, match=r"meta device.*autosplit\.distribute"):
        autosplit.autosplit(_meta_gpt(), ["cpu"] * 2, example_inputs=(spec,), time_limit=1)
    half = _meta_gpt()
    half.head = nn.Linear(32, 128, bias=False)  # real, beside meta layers
    with pytest.raises(CaptureError, match="partly on the meta device"):
        autosplit.plan(half, ["cpu"] * 2, example_inputs=(spec,), time_limit=1)


def test_planning_a_meta_model_allocates_nothing_for_its_weights():
    code = """
import resource, torch, autosplit
from autosplit.examples import GPT
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.device("meta"):
    model = GPT(vocab=50257, d_model=2048, n_layers=6, n_heads=16, max_len=1024)   # 1.6 GB of fp32 weights, in few layers
plan = autosplit.plan(model, ["A100-80GB"] * 4, example_inputs=(autosplit.Spec((8, 1024), torch.long),), time_limit=2)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, sum(p.numel() for p in model.parameters()) * 4)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    grown, weights = map(int, out.stdout.split())
    assert weights > 1.3e9 and grown < 0.3 * weights, f"planning grew the process by {grown / 1e9:.2f} GB"
