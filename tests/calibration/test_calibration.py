"""Calibration: efficiencies fitted from samples, a calibrated device that plans without profiling,
stages measured alone, the link and the all-reduce over gloo, and the runtime's overhead measured once and cached."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autosplit
from autosplit import schedules
from autosplit.calibration.efficiency import fit
from autosplit.calibration.link import fit_allreduce, measure_link
from autosplit.calibration.overhead import fit_overhead
from autosplit.calibration.stages import measure_stages
from autosplit.devices import resolve_devices
from autosplit.errors import CostModelError
from autosplit.passes.time_model import roofline
from autosplit.solver.hybrid import ring_allreduce
from autosplit.solver.replay import StageWork, replay
from tests.helpers import FAST_PROFILE, ProfiledNet


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
    model, x = ProfiledNet(), torch.randn(64, 256)
    spec = autosplit.calibrate(model, "cpu", example_inputs=(x,),
                               options=autosplit.options.ProfileOptions(cache_dir=str(tmp_path), **FAST_PROFILE))
    assert spec.torch_device == "cpu" and spec.efficiency > 0 and spec.memory_efficiency > 0
    assert spec != resolve_devices(["cpu"])[0]
    plan = autosplit.plan(model, [spec] * 2, example_inputs=(x,))
    assert plan.costs == "analytic" and plan.devices[0].efficiency == spec.efficiency


def test_measure_stages_times_and_sizes_every_stage():
    model, x = ProfiledNet(), torch.randn(16, 256)
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


def test_measured_runtime_overhead_is_cached(tmp_path, monkeypatch):
    first = autosplit.calibration.measure_runtime(cache_dir=str(tmp_path))
    assert first.link.bandwidth > 0 and first.microbatch_overhead >= 0 and len(first.samples) == 1
    monkeypatch.setattr(autosplit.calibration.overhead, "run_pair", lambda *_, **__: (_ for _ in ()).throw(AssertionError("cached")))
    assert autosplit.calibration.measure_runtime(cache_dir=str(tmp_path)) == first
    spec = first.apply(autosplit.devices.resolve_devices(["cpu"])[0])
    assert spec.microbatch_overhead == first.microbatch_overhead and spec.link_latency == first.link.latency
    assert first.allreduce is not None and len(first.allreduce.samples) == len(first.link.samples)
    assert spec.allreduce_link(spec) == (first.allreduce.bandwidth, first.allreduce.latency)


def test_allreduce_is_fitted_per_hop_of_a_ring_of_two_and_used_where_measured():
    # Planted: t = 3 ms + bytes / 2 GB/s — a ring of two pays bytes / bw + 2 · latency.
    rows = [(n, 3e-3 + n / 2e9) for n in (4 << 10, 1 << 20, 16 << 20)]
    hop = fit_allreduce(rows, "gloo", 5)
    assert hop.bandwidth == pytest.approx(2e9) and hop.latency == pytest.approx(1.5e-3)
    assert ring_allreduce(8 << 20, 2, hop.bandwidth, hop.latency) == pytest.approx(3e-3 + (8 << 20) / 2e9)
    cpu = resolve_devices(["cpu"])[0]
    assert cpu.allreduce_link(cpu) == cpu.link_to(cpu)  # not measured: the link's figures
    measured = dataclasses.replace(cpu, allreduce_bandwidth=hop.bandwidth, allreduce_latency=hop.latency)
    assert measured.allreduce_link(measured) == (hop.bandwidth, hop.latency)
    assert measured.allreduce_link(cpu) == cpu.link_to(cpu)  # only where both ends were measured
    elsewhere = measured.on_island("other")
    assert measured.allreduce_link(elsewhere) == measured.link_to(elsewhere)  # across islands: the network


def test_the_runtime_overhead_is_what_the_replay_of_a_steps_own_spans_leaves_out():
    # Planted: every action spends 0.5 ms of the runtime's own before its compute; fitted back from the spans alone.
    actions = schedules.lookup("gpipe").actions(2, 4)
    o, delay = 0.5e-3, [0.1e-3]
    work = [StageWork(2e-3 * (1 + s) + o, 4e-3 * (1 + s) + o, 0.0) for s in (0, 1)]  # F, and B = I + W
    run = replay(actions, rank_of=(0, 1), durations=work, delay=delay)
    spans = [(a.kind, a.stage, a.micro, s + o, e) for r, acts in enumerate(run.actions)
             for a, s, e in zip(acts, run.start[r], run.end[r])]
    assert fit_overhead(actions, (0, 1), spans, 0.0, delay) == pytest.approx(o, rel=1e-6)
    assert fit_overhead(actions, (0, 1), spans, 0.0, [1.0]) == 0.0  # a replay already later than the step: nothing left out
