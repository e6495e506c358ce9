"""Measured costs: profiles, their cache, overrides, given tables, calibration, measurements."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import assert_trains_like

import autosplit
from autosplit.calibration.efficiency import fit
from autosplit.calibration.link import measure_link
from autosplit.calibration.stages import measure_stages
from autosplit.costtable import CostTable
from autosplit.devices import resolve_devices
from autosplit.errors import CostModelError
from autosplit.passes import profile as profile_module
from autosplit.passes.annotate import annotate
from autosplit.passes.capture import capture, flat_inputs
from autosplit.passes.costs import estimate, roofline
from autosplit.timers import MemoryTracker, pinned, timed

FAST = dict(warmup=1, repeats=2)


class Net(nn.Module):
    """A big and a small layer, BatchNorm (state profiling must not disturb) and dropout (RNG)."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(256, 256)
        self.bn = nn.BatchNorm1d(256)
        self.small = nn.Linear(256, 4)

    def forward(self, x):
        return self.small(nn.functional.dropout(torch.relu(self.bn(self.big(x))), 0.1))


def _plan(model, x, tmp_path, **options):
    costs = autosplit.options.ProfileOptions(cache_dir=str(tmp_path), **FAST)
    return autosplit.plan(model, ["cpu"] * 2, example_inputs=(x,), costs=costs, micro_batches=2, **options)


def test_measured_plan_profiles_once_then_reads_the_cache(tmp_path, monkeypatch):
    model, x = Net(), torch.randn(64, 256)
    plan = _plan(model, x, tmp_path)
    assert plan.costs == "measured on cpu"
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
    # A restart must not profile again: make measuring impossible and plan once more.
    monkeypatch.setattr(profile_module._Profiler, "_measure", lambda *a: pytest.fail("profiled twice"))
    again = _plan(model, x, tmp_path)
    assert again.costs == "measured on cpu (cache: 1 of 1)"
    assert again.assignment == plan.assignment
    # Another input shape is another key.
    monkeypatch.undo()
    _plan(model, torch.randn(32, 256), tmp_path)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2


def test_profile_measures_real_work_and_leaves_the_model_as_it_was(tmp_path):
    model, x = Net(), torch.randn(512, 256)
    model_before = copy.deepcopy(model.state_dict())
    rng_before = torch.get_rng_state()
    captured = capture(model, (x,))
    inputs = flat_inputs(captured, (x,), {})
    # Five repeats: a median over two is a mean, which one preemption on a busy machine spoils.
    prof = profile_module.profile(
        captured, inputs, "cpu", fingerprint="test", options=autosplit.options.ProfileOptions(use_cache=False, warmup=1, repeats=5)
    )
    assert torch.equal(torch.get_rng_state(), rng_before)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, model_before[name], msg=f"profiling changed {name}")
    big, small = prof.nodes["big"], prof.nodes["small"]
    assert big.fwd > 0 and big.bwd > 0 and small.fwd > 0
    assert big.fwd + big.bwd > small.fwd + small.bwd  # 64× the FLOPs
    # ReLU keeps its output for backward: one 512 × 256 float32 tensor.
    assert prof.nodes["relu"].saved_bytes == 512 * 256 * 4


class Lookup(nn.Module):
    """An embedding (its backward zero-fills a whole table's gradient) before a wide and a narrow layer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4000, 64)
        self.wide = nn.Linear(64, 1024)
        self.narrow = nn.Linear(1024, 4)

    def forward(self, tokens):
        return self.narrow(torch.relu(self.wide(self.emb(tokens))))


def test_cpu_profile_times_nodes_inside_whole_passes():
    """Per-node times come from passes of all micro-batches: they add up to the pass as timed
    on its own, each backward lands on the node whose forward made it, and gradients are untouched."""
    model, tokens = Lookup(), torch.randint(0, 4000, (64, 16))
    captured = capture(model, (tokens,))
    micro = flat_inputs(captured, (tokens[:16],), {})
    options = autosplit.options.ProfileOptions(use_cache=False, warmup=1, repeats=3, threads=1)
    prof = profile_module.profile(captured, micro, "cpu", fingerprint="test", options=options, micro_batches=4,
                                  forwards_first=True)
    assert all(p.grad is None for p in model.parameters())
    nodes = prof.nodes
    assert nodes["wide"].bwd > nodes["narrow"].bwd  # 16× the FLOPs
    assert nodes["emb"].bwd > 0  # the table's gradient is made in the embedding's backward, not in its neighbour's

    def four_micro_batches():
        outs = [model(chunk) for chunk in tokens.chunk(4)]
        for out in outs:
            out.backward(torch.ones_like(out))

    with pinned(1, None):
        whole = timed(four_micro_batches, warmup=2, repeats=5)
    per_node = 4 * sum(n.fwd + n.bwd for n in nodes.values())
    assert 0.5 * whole < per_node < 2 * whole, (per_node, whole)


def test_the_optimizer_step_is_measured_and_spread_over_the_nodes_by_their_parameters():
    model, tokens = Lookup(), torch.randint(0, 4000, (16, 16))
    captured = capture(model, (tokens,))
    inputs = flat_inputs(captured, (tokens,), {})
    options = autosplit.options.ProfileOptions(use_cache=False, warmup=1, repeats=3)
    before = copy.deepcopy(model.state_dict())
    adam = profile_module.profile(captured, inputs, "cpu", fingerprint="test", options=options, optimizer="adam")
    sgd = profile_module.profile(captured, inputs, "cpu", fingerprint="test", options=options, optimizer="sgd")
    none = profile_module.profile(captured, inputs, "cpu", fingerprint="test", options=options, optimizer="none")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=f"timing the optimizer changed {name}")
    assert adam.optimizer_step > 0 and sgd.optimizer_step > 0 and none.optimizer_step == 0
    annotate(captured, inputs)
    table = estimate(captured.gm, resolve_devices(["cpu"]), optimizer="adam", profiles=[adam])
    per_node = {name: row[0] for name, row in zip(table.nodes, table.optimizer_time)}
    assert sum(per_node.values()) == pytest.approx(adam.optimizer_step)
    assert per_node["emb"] > per_node["narrow"]  # 256 000 parameters against 4 100


def test_split_planned_on_measured_costs_trains_like_the_model(tmp_path):
    costs = autosplit.options.ProfileOptions(cache_dir=str(tmp_path), **FAST)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    assert_trains_like(model, ["cpu"] * 3, (torch.randn(8, 16),), costs=costs, micro_batches=4)


def test_measured_costs_need_a_device_present():
    with pytest.raises(CostModelError, match="plan-only presets"):
        autosplit.plan(Net(), ["A100-80GB"] * 2, example_inputs=(torch.randn(8, 256),), costs="measured")


def test_micro_batches_must_divide_the_profiled_batch(tmp_path):
    with pytest.raises(autosplit.errors.ConstraintError, match="micro_batches=4 does not divide the batch of 6 rows"):
        autosplit.plan(Net(), ["cpu"] * 2, example_inputs=(torch.randn(6, 256),), micro_batches=4,
                       costs=autosplit.options.ProfileOptions(cache_dir=str(tmp_path), **FAST))


def test_overrides_set_a_node_and_spread_a_module_total():
    model, x = Net(), torch.randn(8, 256)
    base = autosplit.plan(model, ["cpu"] * 2, example_inputs=(x,))
    heavy = autosplit.plan(model, ["cpu"] * 2, example_inputs=(x,), cost_overrides={"small": {"fwd": 5.0, "bwd": 5.0}})
    assert heavy.costs == "analytic (uncalibrated for cpu) + 1 override"
    # 10 s of work in the last layer: it gets a stage of its own, and the prediction says so.
    assert heavy.stage_of["small"] == 1 and all(s == 0 for n, s in heavy.stage_of.items() if n != "small")
    assert heavy.stages[1].compute == pytest.approx(10.0, abs=1e-3)  # + the optimizer step of its parameters
    assert base.stages[1].compute < 1.0


def test_module_override_total_is_kept_and_bad_overrides_are_named():
    from autosplit.passes.costs import with_overrides

    table = CostTable(
        devices=resolve_devices(["cpu"]), nodes=("a", "b", "c"), module_paths=("m.x", "m.y", "n"),
        fwd_time=((1.0,), (3.0,), (1.0,)), bwd_time=((0.0,), (0.0,), (1.0,)), state_bytes=(0, 0, 0),
        saved_bytes=(10, 30, 5), output_bytes=(1, 1, 1), edges=((0, 1), (1, 2)), order_edges=(), colocate=(),
        param_counts=(0, 0, 0),
    )
    out = with_overrides(table, {"m": {"fwd": 8.0, "saved_bytes": 4}, "c": {"bwd": 0.5}})
    assert out.fwd_time == ((2.0,), (6.0,), (1.0,))  # 8 s shared 1 : 3
    assert out.saved_bytes == (1, 3, 5) and out.bwd_time[2] == (0.5,)
    with pytest.raises(CostModelError, match="'blocks.9', which is neither a node nor a module"):
        with_overrides(table, {"blocks.9": {"fwd": 1.0}})
    with pytest.raises(CostModelError, match="unknown fields \\['flops'\\]"):
        with_overrides(table, {"a": {"flops": 1.0}})


def test_a_saved_cost_table_plans_like_the_original_and_a_foreign_one_is_refused(tmp_path):
    from autosplit.passes.annotate import annotate
    from autosplit.passes.capture import capture, flat_inputs
    from autosplit.passes.costs import estimate, with_overrides

    model, x = Net(), torch.randn(8, 256)
    captured = capture(model, (x,))
    annotate(captured, flat_inputs(captured, (x,), {}))
    table = with_overrides(estimate(captured.gm, resolve_devices(["cpu"] * 2)), {"small": {"fwd": 5.0}})
    table.save(tmp_path / "costs.json")
    assert CostTable.load(tmp_path / "costs.json") == table
    plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=(x,), costs=tmp_path / "costs.json")
    assert plan.costs.startswith("given table") and plan.stage_of["small"] == 1
    with pytest.raises(CostModelError, match="belongs to another model"):
        autosplit.plan(nn.Linear(256, 4), ["cpu"] * 2, example_inputs=(x,), costs=table)


def test_fit_recovers_known_efficiencies():
    spec = resolve_devices(["cpu"])[0]
    # Factors on the fit's log grid (20 points a decade), so the exact answer is reachable.
    truth = autosplit.calibration.Calibration(efficiency=0.1, memory_efficiency=10**-0.3, launch_overhead=20e-6, samples=0,
                                  median_error=0, total_error=0).apply(spec)
    gen = torch.Generator().manual_seed(0)
    flops = torch.logspace(4, 10, 40).tolist()
    nbytes = (torch.rand(40, generator=gen) * 1e8).tolist()
    samples = [(f, b, roofline(f, b, truth)) for f, b in zip(flops, nbytes)]
    got = fit(samples, spec)
    assert got.efficiency == pytest.approx(0.1, rel=1e-6)
    assert got.memory_efficiency == pytest.approx(10**-0.3, rel=1e-6)
    assert got.launch_overhead == pytest.approx(20e-6, rel=1e-6)
    assert got.median_error < 1e-6


def test_calibrate_returns_a_spec_that_plans_without_profiling(tmp_path):
    model, x = Net(), torch.randn(64, 256)
    spec = autosplit.calibrate(model, "cpu", example_inputs=(x,),
                               options=autosplit.options.ProfileOptions(cache_dir=str(tmp_path), **FAST))
    assert spec.torch_device == "cpu" and spec.efficiency > 0 and spec.memory_efficiency > 0
    assert spec != resolve_devices(["cpu"])[0]
    plan = autosplit.plan(model, [spec] * 2, example_inputs=(x,))
    assert plan.costs == "analytic" and plan.devices[0].efficiency == spec.efficiency


def test_memory_tracker_counts_storages_once_and_sees_them_freed():
    with MemoryTracker() as mem:
        a = torch.zeros(1024, 256)  # 1 MiB
        view = a[:10]
        b = a + 1
        del b
    assert mem.peak == 2 * 2**20
    assert mem.current == 2**20
    del a, view
    assert mem.current == 0


def test_measure_stages_times_and_sizes_every_stage():
    model, x = Net(), torch.randn(16, 256)
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(x,), micro_batches=2)
    micro = [((c,), {}) for c in x.chunk(2)]
    got = measure_stages(split, micro, steps=1, warmup=0)
    assert len(got) == 2 and all(m.forward > 0 and m.backward > 0 for m in got)
    # Adam: parameter, gradient and two moments in float32, at least.
    big = sum(p.numel() for p in [*model.big.parameters(), *model.bn.parameters()])
    assert got[split.plan.stage_of["big"]].peak_bytes >= 4 * 4 * big


def test_measure_link_fits_bandwidth_and_latency_over_gloo():
    link = measure_link(sizes=(1 << 10, 1 << 16, 8 << 20), repeats=5)
    assert link.backend == "gloo" and len(link.samples) == 3
    assert 1e6 < link.bandwidth < 1e12 and 0 <= link.latency < 0.1
    spec = link.apply(resolve_devices(["cpu"])[0])
    assert (spec.link_bandwidth, spec.link_latency) == (link.bandwidth, link.latency)
    with pytest.raises(CostModelError, match="two distinct message sizes"):
        measure_link(sizes=(1 << 10,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_on_cuda_uses_events_and_allocator_statistics(tmp_path):
    model, x = Net(), torch.randn(64, 256)
    plan = autosplit.plan(model, ["cuda:0", "cpu"], example_inputs=(x,),
                          costs=autosplit.options.ProfileOptions(cache_dir=str(tmp_path), **FAST))
    assert plan.costs == "measured on cpu, cuda:0"


class _InPlaceBlock(nn.Module):
    """torchvision's pattern: BN then ReLU(inplace=True), twice with one shape; `out += x`."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.b1(self.c1(x)))
        out = self.b2(self.c2(out))
        out += x
        return self.relu(out)


def test_in_place_writes_are_seen_from_version_counters():
    from autosplit.passes.annotate import annotate, node_info

    model = nn.Sequential(_InPlaceBlock(), _InPlaceBlock())
    x = torch.randn(2, 4, 8, 8)
    captured = capture(model, (x,))
    gm = annotate(captured, flat_inputs(captured, (x,), {}))  # the second block's nodes repeat the first's
    mutates = {n.name: node_info(n).mutates for n in gm.graph.nodes if n.op != "output"}
    written = {name: by for name, by in mutates.items() if by}
    assert written["_0_relu"] == ("_0_b1",) and written["_1_relu"] == ("_1_b1",), written  # a repeated node too
    assert all(len(by) == 1 for by in written.values())
    assert_trains_like(model, ["cpu"] * 3, (x,))


def test_build_problem_caches_the_arrays_its_tuples_hold():
    import numpy as np

    from autosplit.examples import GPT
    from autosplit.passes.annotate import annotate
    from autosplit.passes.costs import estimate
    from autosplit.solver.problem import Problem, build_problem

    model, ids = GPT(vocab=50, d_model=16, n_layers=2, n_heads=2, max_len=8), torch.randint(0, 50, (2, 8))
    captured = capture(model, (ids,))
    annotate(captured, flat_inputs(captured, (ids,), {}))
    problem = build_problem(estimate(captured.gm, resolve_devices(["cpu"] * 3)), micro_batches=6, schedule="1f1b")
    derived = Problem.arrays.func(problem)  # from the tuples, as a Problem made by hand gets them
    for field in ("compute", "transfer", "state", "act", "recv", "send", "producer", "consumer"):
        assert np.array_equal(getattr(problem.arrays, field), getattr(derived, field)), field


def test_analytic_costs_count_the_fused_lstm_kernel():
    from autosplit.passes.annotate import annotate, node_info

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(64, 128, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0]

    model, x = Recurrent(), torch.randn(4, 10, 64)
    captured = capture(model, (x,))
    gm = annotate(captured, flat_inputs(captured, (x,), {}))
    info = node_info(next(n for n in gm.graph.nodes if n.name == "lstm"))
    gates = 2 * 4 * 10 * (4 * 128 * 64 + 4 * 128 * 128)  # tokens × (|W_ih| + |W_hh|), multiply-adds
    assert info.fwd_flops == gates and info.bwd_flops == 2 * gates
