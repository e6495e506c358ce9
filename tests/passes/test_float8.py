"""FP8 linears, costed (``float8=``): which linears convert and why, one linear's seconds checked by hand, the refusals."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.devices import PRESETS
from autosplit.errors import ConstraintError, PlanFileError, PlanMismatchError
from autosplit.passes.annotate import annotate
from autosplit.passes.annotations import node_info
from autosplit.passes.capture import capture, flat_inputs
from autosplit.passes.float8 import CAST_KERNELS, CAST_TRAFFIC, float8_linears, float8_times
from autosplit.report import plan_report, write_html
from tests.helpers import says


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.odd, self.head = nn.Linear(256, 512), nn.Linear(512, 100), nn.Linear(100, 64)

    def forward(self, x):
        return self.head(torch.relu(self.odd(torch.relu(self.up(x)))))


class _Wide(nn.Module):
    """A linear FP8 pays for (4096 → 4096 on 8192 rows), one it does not (4096 → 64: its casts outweigh its GEMM), one of
    an odd shape and the head."""

    def __init__(self):
        super().__init__()
        self.big, self.small, self.odd, self.head = nn.Linear(4096, 4096), nn.Linear(4096, 64), nn.Linear(64, 100), nn.Linear(100, 4096)

    def forward(self, x):
        return self.head(torch.relu(self.odd(self.small(torch.relu(self.big(x))))))


def _annotated(method: str = "symbolic_trace"):
    x = torch.randn(128, 256)
    captured = capture(_Net(), (x,), method=method)
    return annotate(captured, flat_inputs(captured, (x,), {}), precision="bf16-mixed")


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_every_linear_is_named_by_its_module_path(method):
    gm = _annotated(method)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert [path for path, _ in float8_linears(gm, nodes).values()] == ["up", "odd", "head"]


def test_each_linear_is_decided_by_its_cost_its_shape_and_the_filters(tmp_path):
    """On an H100 under ``"auto"``: ``big`` runs FP8; ``small`` would take longer with its casts than in bf16; ``odd`` has
    100 outputs (not a multiple of 16); the head is the output layer. The plan says why for each. A recipe converts as the
    engines do (no cost rule), and a filter replaces the default."""
    model, x = _Wide(), torch.randn(8192, 4096)
    plan = autosplit.plan(model, ["H100-80GB"], example_inputs=(x,), precision="bf16-mixed", float8="auto")
    kept = dict(plan.float8_kept)
    assert plan.float8 == "tensorwise" and plan.float8_linears == ("big",) and list(kept) == ["small", "odd", "head"]
    assert "the GEMM time saved is less than the casts cost" in kept["small"] and "100 × 64" in kept["odd"]
    assert "output layer" in kept["head"]
    filtered = autosplit.plan(model, ["H100-80GB"], example_inputs=(x,), precision="bf16-mixed", float8="tensorwise",
                              float8_exclude=["bi"])
    kept = dict(filtered.float8_kept)  # a recipe converts as the engines do: every linear of FP8's shapes not filtered
    assert filtered.float8_linears == ("small",) and kept["big"] == "float8_exclude names 'bi'"
    assert "4096 × 100" in kept["head"]  # judged once the default filter is replaced: its shape keeps it
    report = plan_report(plan)
    assert "FP8 linears (tensorwise): 1 of 4: big" in report and "bf16: small: FP8 would take" in report
    html = write_html(tmp_path / "report.html", plan).read_text()
    assert '<p class="float8">FP8 linears (tensorwise): 1 of 4<br>bf16: <code>small</code>: FP8 would take' in html


def test_a_cpu_converts_nothing_under_auto_and_every_eligible_linear_when_asked():
    """A CPU has no FP8 tensor cores: ``auto`` converts nothing; an explicit recipe converts for torchao's emulation, costed
    as the bf16 GEMM and its casts (slower)."""
    model, x = _Wide(), torch.randn(64, 4096)
    auto = autosplit.plan(model, ["cpu"], example_inputs=(x,), precision="bf16-mixed", float8="auto")
    assert auto.float8 is None and auto.float8_linears == () and dict(auto.float8_kept)["big"] == "cpu has no FP8 tensor cores"
    asked = autosplit.plan(model, ["cpu"], example_inputs=(x,), precision="bf16-mixed", float8="tensorwise")
    assert asked.float8_linears == ("big", "small") and asked.step_time > auto.step_time


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


def test_a_float8_plan_is_faster_where_gemms_dominate_and_round_trips():
    model, x = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.Linear(4096, 4096)), torch.randn(8192, 4096)
    planner = autosplit.Planner(model, ["H100-80GB"], example_inputs=(x,), precision="bf16-mixed")
    bf16, fp8 = planner.plan(), planner.with_options(float8="tensorwise").plan()
    assert fp8.float8 == "tensorwise" and fp8.float8_linears == ("0", "2") and bf16.float8 is None
    # two of three linears at twice the peak, their casts (2.5 bytes per input byte) and the optimizer step paid as before
    assert 0.5 < fp8.step_time / bf16.step_time < 0.95
    assert planner.with_options(float8="mxfp8").plan().step_time < fp8.step_time  # one pass per cast
    again = autosplit.Plan.from_dict(json.loads(json.dumps(fp8.to_dict())))
    assert (again.float8, again.float8_linears, again.float8_kept) == (fp8.float8, fp8.float8_linears, fp8.float8_kept)
    older = {k: v for k, v in fp8.to_dict().items() if k not in ("float8_linears", "float8_kept")}  # costed, never run
    with pytest.raises(PlanFileError, match="by an autosplit that did not record which"):
        autosplit.Plan.from_dict(older)
    # a saved plan converts its own linears, whatever the planner's float8 options: an "auto" plan's cost decisions too
    assert planner.with_options(float8="rowwise", float8_exclude=("2",)).plan(again).float8_linears == ("0", "2")
    auto = planner.with_options(float8="auto", float8_exclude=("0",)).plan()
    assert planner.plan(autosplit.Plan.from_dict(auto.to_dict())).float8_linears == auto.float8_linears == ("2", "3")
    with pytest.raises(PlanMismatchError) as e:  # a plan whose linears these options do not convert (another model, a hand edit)
        planner.plan(dataclasses.replace(again, float8_linears=("0",)))
    says(e, "only in the plan [], only under these options ['2']")


@pytest.mark.parametrize("devices, options, named", [
    (["A100-80GB"], {"precision": "bf16-mixed", "float8": "tensorwise"}, "A100-80GB has no FP8 tensor cores"),
    (["H100-80GB"], {"precision": "bf16-mixed", "float8_exclude": "head"}, "option float8_exclude='head' is out of range"),
    (["H100-80GB"], {"precision": "fp32", "float8": "tensorwise"}, "on top of precision 'bf16-mixed' or 'bf16-fsdp'"),
    (["H100-80GB"], {"precision": "bf16-mixed", "float8": "e4m3"}, "option float8='e4m3' is out of range"),
])
def test_float8_is_refused_where_it_cannot_be_costed(devices, options, named):
    model, x = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), torch.randn(32, 64)
    with pytest.raises(ConstraintError) as e:
        autosplit.Planner(model, devices, example_inputs=(x,), **options).plan()
    says(e, named)


def test_fsdp_gathers_tensorwise_fp8_weights_in_a_byte_each():
    """By hand: three 4096 × 4096 linears (and biases), two of them FP8 under tensorwise: sharded in bf16-mixed, FSDP2 moves
    the fp32 bytes of the head and ¼ of them for the FP8 weights; rowwise or unsharded, the fp32 bytes throughout; under its
    bf16 policy, ½ throughout (the runtime gathers the policy's bf16 copy there)."""
    from autosplit.compiler.costs import cost_table
    from autosplit.passes.sharding import gathered_share

    model, x = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.Linear(4096, 4096)), torch.randn(64, 4096)
    planner = autosplit.Planner(model, ["H100-80GB"], example_inputs=(x,), precision="bf16-mixed")
    specs = planner.specs()

    def share(float8, dp_shard: int = 2, precision: str = "bf16-mixed") -> float:
        options = planner.options.replace(float8=float8, precision=precision)
        table, _ = cost_table(planner.traced_for(options), specs, options, micro_batches=1, laid=False)
        return gathered_share(table, specs, precision, dp_shard)

    assert share("tensorwise") == pytest.approx((2 * 0.25 + 1) / 3)
    assert share("rowwise") == share(None) == share("tensorwise", dp_shard=1) == 1.0
    assert share("tensorwise", precision="bf16-fsdp") == 0.5


def test_torchaos_fp8_linears_under_autocast_keep_no_bf16_weight_copy():
    """A torchao FP8 linear casts its fp32 weight to FP8 itself: under autocast it saves the fp32 weight (the parameter, no
    copy), where an nn.Linear saves autocast's bf16 copy; the costs hold the copy for the bf16 linear only."""
    from autosplit.compiler.costs import cost_table

    float8 = pytest.importorskip("torchao.float8")
    model, x = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 64)), torch.randn(32, 256)

    def saved_dtypes(module: nn.Module) -> set[tuple[tuple[int, ...], torch.dtype]]:
        seen: set[tuple[tuple[int, ...], torch.dtype]] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen.add((tuple(t.shape), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            module(x)
        return seen

    converted = float8.convert_to_float8_training(copy.deepcopy(model), module_filter_fn=lambda _, fqn: fqn == "2",
                                                  config=float8.Float8LinearConfig.from_recipe_name("tensorwise"))
    # the second linear's weight, saved for its input's gradient: autocast's bf16 copy (transposed), or nothing bf16
    assert ((512, 64), torch.bfloat16) in saved_dtypes(model) and ((512, 64), torch.bfloat16) not in saved_dtypes(converted)
    planner = autosplit.Planner(model, ["cpu"], example_inputs=(x,), precision="bf16-mixed", float8_exclude=())
    copies = {}
    for recipe in (None, "tensorwise"):
        options = planner.options.replace(float8=recipe)
        table, _ = cost_table(planner.traced_for(options), planner.specs(), options, micro_batches=1, laid=False)
        copies[recipe] = dict(zip(table.module_paths, table.weight_copy_bytes or (0,) * len(table.nodes)))  # () where none
    assert copies[None]["2"] == 64 * 512 * 2 and copies["tensorwise"]["2"] == 0
