"""Engine profiles: the fitted parameters in one table, put on a device, and quoted in a plan's report."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.engine_profiles import ENGINES, FITTED, profiled, trust
from autosplit.errors import ConstraintError
from autosplit.gpu_presets import GPU_PRESETS
from autosplit.report.text import plan_report
from tests.helpers import says

ROOT = Path(__file__).resolve().parents[1]


def test_a_profile_puts_its_fitted_efficiencies_on_a_device_and_names_itself():
    h100 = profiled(GPU_PRESETS["H100-80GB"], "megatron-te")
    assert h100.efficiency == FITTED["megatron-te.gemm"].value and h100.memory_efficiency == FITTED["memory"].value
    assert h100.name == "H100-80GB (megatron-te)" and h100.peak_flops_half == GPU_PRESETS["H100-80GB"].peak_flops_half
    cluster = autosplit.Cluster.of("GB200", 72, engine="torch-compile")
    assert cluster.device.efficiency == FITTED["torch-compile.gemm"].value
    assert cluster.device.attention_share == FITTED["torch-compile.attention"].value
    assert profiled(GPU_PRESETS["H100-80GB"], "torch-eager").attention_share == FITTED["torch-compile.attention"].value
    with pytest.raises(ConstraintError) as e:
        profiled(GPU_PRESETS["H100-80GB"], "jax")
    says(e, "engine profile 'jax' is not known", "megatron-te")


def test_every_fitted_parameter_lives_in_the_one_table():
    """Each profile reads its figures from FITTED, every FITTED entry says what it fits and over what, and no
    module of the package writes an efficiency literal into a DeviceSpec but the presets' spec-sheet defaults."""
    assert all(f.fits and f.over for f in FITTED.values())
    overlaps = {"megatron-te.tp_overlap", "torch-compile.tp_overlap", "megatron-te.ep_overlap"}
    attention = {f"{e.attention_kernel or e.kernels or e.name}.attention" for e in ENGINES.values()}
    assert attention == {"megatron-te.attention", "torch-compile.attention"}  # torch's eager and compiled runs: one kernel
    assert {f"{e.kernels or e.name}.gemm" for e in ENGINES.values()} | {"memory", "float8.rowwise"} | overlaps | attention == set(FITTED)
    for path in (ROOT / "autosplit").rglob("*.py"):
        if path.name in ("engine_profiles.py", "device_spec.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            fitted = ("efficiency", "memory_efficiency", "tp_overlap", "ep_overlap", "attention_share")
            if isinstance(node, ast.keyword) and node.arg in fitted and isinstance(node.value, ast.Constant):
                assert path.name == "devices.py", f"{path}: a literal {node.arg} outside the fitted table"


def test_a_plan_on_a_profiled_cluster_says_how_far_to_trust_it():
    model, x = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)), torch.randn(64, 256)
    cluster = autosplit.Cluster.of("H100", 8, engine="megatron-te")
    plan = autosplit.Planner(model, cluster.replica_devices(2), example_inputs=(x,)).plan()
    report = plan_report(plan, width=400)
    assert "engine profile megatron-te" in report and "device preset H100-80GB" in report
    assert re.search(r"(median \d+%.* over \d+ runs|has no run on H100 with megatron-te)", report)
    unprofiled = trust((GPU_PRESETS["B200-180GB"],))
    assert unprofiled is not None and "nobody fitted" in unprofiled and trust(autosplit.devices.resolve_devices(["cpu"])) is None


def test_megatrons_distributed_optimizer_and_in_flight_buffers_in_the_memory():
    """Over dp_shard 4 under bf16-fsdp a linear of n values holds, with FSDP2 (torch): 16n/4 sharded (fp32 weight,
    gradient shard, moments) + 2n gathered bf16 + 4n fp32 gradients accumulated whole = 10n; with Megatron's
    distributed optimizer the gradient is the whole buffer only, in bf16 as its performance recipes reduce it:
    12n/4 + 2n bf16 weights + 2n = 7n; Megatron-FSDP gathers each layer per micro-batch, holding its 16n/4 shard
    alone. Torch's PipelineStage holds a buffer for every micro-batch; Megatron's p2p one per send, which the
    schedule's in-flight count covers."""
    from autosplit.compiler.costs import cost_table
    from autosplit.solver.build import pipeline_buffers

    model, x = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)), torch.randn(64, 256)
    n = 256 * 256 + 256
    held = {}
    for engine in ("torch-eager", "megatron-te", "megatron-fsdp"):
        device = profiled(GPU_PRESETS["H100-80GB"], engine)
        planner = autosplit.Planner(model, [device], example_inputs=(x,), precision="bf16-fsdp")
        options = planner.options.replace(data_parallel=4, replicate="fully_shard")
        table = cost_table(planner.traced, (device,), options, micro_batches=4)[0]
        held[engine] = table.state_bytes[table.param_bytes.index(4 * n)]
        buffers = pipeline_buffers(table, "1f1b", 4)
        assert (buffers is None) == engine.startswith("megatron")
    assert (held["torch-eager"], held["megatron-te"], held["megatron-fsdp"]) == (10 * n, 7 * n, 4 * n)


def test_megatrons_stages_free_what_they_send_a_tensor_the_next_stage_saves_is_held_once():
    """Two stages, 1F1B over 4 micro-batches: the ReLU's output (rows × 256 bf16) crosses to the second linear,
    which saves it. Torch's PipelineStage keeps it on the sender until its backward, and the receiver holds a
    buffer and its gradient for every micro-batch; Megatron's sender frees it (deallocate_pipeline_outputs), so
    it is held once, where the memory model charges it: the sender's saved activations, and nothing received."""
    model, x = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)), torch.randn(64, 256)
    received = {}
    for engine in ("torch-eager", "megatron-te"):
        devices = [profiled(GPU_PRESETS["H100-80GB"], engine)] * 2
        planner = autosplit.Planner(model, devices, example_inputs=(x,), precision="bf16-mixed")
        recipe = autosplit.Recipe([["0", "1"], ["2"]], options={"precision": "bf16-mixed", "schedule": "1f1b", "micro_batches": 4})
        plan = planner.manual(recipe, check_memory=False)
        received[engine] = plan.stages[1].memory_received + plan.stages[1].memory_buffers
        assert plan.stages[0].memory_activations >= 64 // 4 * 256 * 2  # the saved ReLU output, a micro-batch of it at least
    assert received["megatron-te"] == 0 and received["torch-eager"] >= 2 * 64 * 256 * 2  # every micro-batch's, and its gradient


def test_the_record_a_report_quotes_is_the_one_the_benchmark_wrote():
    """RECORD (what a plan's report quotes) holds the per-GPU-kind and engine errors of the last full run of
    benchmarks/published.py, as its results file has them."""
    import json

    from autosplit.engine_profiles import RECORD

    written = json.loads((ROOT / "benchmarks" / "results" / "published.json").read_text())["summary"]["by_kind"]
    assert {tuple(k.split(" ")) for k in written} == set(RECORD)
    for key, figures in written.items():
        kind, engine = key.split(" ")
        median, p90, runs = RECORD[kind, engine]
        assert (median, p90, runs) == pytest.approx((figures["median"], figures["p90"], figures["runs"]), abs=5e-4)
