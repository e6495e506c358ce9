"""FP8 linears, costed (``float8=``): which linears convert, one linear's seconds checked by hand, the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.devices import PRESETS
from autosplit.errors import CodegenError, ConstraintError
from autosplit.passes.annotate import annotate
from autosplit.passes.annotations import node_info
from autosplit.passes.capture import capture, flat_inputs
from autosplit.passes.float8 import CAST_KERNELS, CAST_TRAFFIC, float8_linears, float8_times
from tests.helpers import says


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.odd, self.head = nn.Linear(256, 512), nn.Linear(512, 100), nn.Linear(100, 64)

    def forward(self, x):
        return self.head(torch.relu(self.odd(torch.relu(self.up(x)))))


def _annotated(method: str = "symbolic_trace"):
    x = torch.randn(128, 256)
    captured = capture(_Net(), (x,), method=method)
    return annotate(captured, flat_inputs(captured, (x,), {}), precision="bf16-mixed")


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_every_linear_but_the_head_and_odd_shapes_converts(method):
    """``up`` converts; ``odd`` (100 outputs: not a multiple of 16) and ``head`` (the last linear) stay bf16."""
    gm = _annotated(method)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    (chosen,) = [nodes[i] for i in float8_linears(gm, nodes)]
    assert (str(chosen.target) if chosen.op == "call_module" else str(chosen.args[1].target)) in ("up", "up.weight")


def test_one_fp8_linear_costs_its_gemms_at_the_fp8_peak_and_its_casts_at_the_bandwidth():
    """By hand, on an H100: 2·128·256·512 FLOPs forward at 1,979 TF × 0.6 (compute-bound: it moves 0.5 MB),
    the casts 2.5 bytes per bf16 byte of input and weight at 3.35 TB/s × 0.6, and two launches per cast operand."""
    gm = _annotated()
    (up,) = [node_info(n) for n in gm.graph.nodes if n.op == "call_module" and n.target == "up"]
    h100 = PRESETS["H100-80GB"]
    fwd, bwd = float8_times(up, h100, "tensorwise")
    bandwidth, launch = 3.35e12 * 0.6, 5e-6
    gemm = max(2 * 128 * 256 * 512 / (1979e12 * 0.6), (up.input_bytes + up.output_bytes) / bandwidth) + launch
    assert fwd == pytest.approx(gemm + 2.5 * up.input_bytes / bandwidth + 2 * CAST_KERNELS * launch)
    assert up.bwd_flops == up.fwd_flops and bwd > fwd  # the input needs no gradient: the weight's GEMM only
    assert CAST_TRAFFIC["mxfp8"][0] < CAST_TRAFFIC["tensorwise"][0]  # one pass per cast, no separate amax read


def test_a_float8_plan_is_faster_where_gemms_dominate_and_says_so():
    model, x = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.Linear(4096, 4096)), torch.randn(8192, 4096)
    planner = autosplit.Planner(model, ["H100-80GB"], example_inputs=(x,), precision="bf16-mixed")
    bf16, fp8 = planner.plan(), planner.with_options(float8="tensorwise").plan()
    assert fp8.float8 == "tensorwise" and bf16.float8 is None
    # two of three linears at twice the peak, their casts (2.5 bytes per input byte) and the optimizer step paid as before
    assert 0.5 < fp8.step_time / bf16.step_time < 0.95
    assert planner.with_options(float8="mxfp8").plan().step_time < fp8.step_time  # one pass per cast
    with pytest.raises(CodegenError) as e:
        planner.build(dataclasses.replace(bf16, float8="tensorwise"))
    says(e, "costed in FP8 (float8='tensorwise')", "plan with float8=None")


@pytest.mark.parametrize("devices, options, named", [
    (["A100-80GB"], {"precision": "bf16-mixed", "float8": "tensorwise"}, "A100-80GB has no FP8 tensor cores"),
    (["cpu"], {"precision": "bf16-mixed", "float8": "mxfp8"}, "cpu has no FP8 tensor cores"),
    (["H100-80GB"], {"precision": "fp32", "float8": "tensorwise"}, "on top of precision 'bf16-mixed' or 'bf16-fsdp'"),
    (["H100-80GB"], {"precision": "bf16-mixed", "float8": "e4m3"}, "option float8='e4m3' is out of range"),
])
def test_float8_is_refused_where_it_cannot_be_costed(devices, options, named):
    model, x = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), torch.randn(32, 64)
    with pytest.raises(ConstraintError) as e:
        autosplit.Planner(model, devices, example_inputs=(x,), **options).plan()
    says(e, named)
