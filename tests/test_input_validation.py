"""Every input checked up front (issue #21): a typed error naming the field and the value found,
in the what → why → try shape, before any planning or measuring runs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.api.hybrid import measure_noise_scale, plan_hybrid
from autosplit.compiler.hybrid import Cluster
from autosplit.errors import ConstraintError, CostModelError
from autosplit.solver.hybrid import efficiency_points, examples_factor

SHAPE = r"(?s).+\. Likely cause: .+\. Try: .+\."


def _mlp(device: str | None = None) -> nn.Module:
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64, device=device), nn.ReLU())])


def _says(excinfo, *names: str) -> None:
    text = str(excinfo.value)
    assert excinfo.match(SHAPE), f"message without what → why → try: {text!r}"
    for name in names:
        assert name in text, f"{name!r} not named in: {text}"


# -- the cluster ----------------------------------------------------------------------------------
GPU = dataclasses.replace(autosplit.devices.PRESETS["V100-16GB"], name="gpu")
GOOD = {"name": "test", "device": GPU, "nodes": 2, "per_node": 4, "intra": (150e9, 5e-6), "inter_bandwidth": 50e9,
        "inter_latency": 5e-6}


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("nodes", 0, "nodes=0 is not an integer ≥ 1"),
        ("nodes", -2, "nodes=-2"),
        ("nodes", "two", "nodes='two'"),
        ("nodes", 1.5, "nodes=1.5"),
        ("nodes", True, "nodes=True"),
        ("per_node", 0, "per_node=0 is not an integer ≥ 1"),
        ("intra", (0.0, 5e-6), "intra[0] (bandwidth)=0.0 is not a positive number of bytes/s"),
        ("intra", (150e9, -1e-6), "intra[1] (latency)=-1e-06 is not a finite number of seconds ≥ 0"),
        ("intra", (150e9,), "intra=(150000000000.0,) is not a (bandwidth, latency) pair"),
        ("inter_bandwidth", "fast", "inter_bandwidth='fast' is not a positive number"),
        ("inter_bandwidth", -1.0, "inter_bandwidth=-1.0"),
        ("inter_latency", math.nan, "inter_latency=nan"),
        ("device", "V100-16GB", "device='V100-16GB' is not a DeviceSpec"),
    ],
)
def test_a_cluster_is_checked_when_it_is_made(field, value, named):
    with pytest.raises(ConstraintError) as e:
        Cluster(**{**GOOD, field: value})
    _says(e, "Cluster 'test'", named)


@pytest.mark.parametrize("make", [lambda: Cluster.dgx1(nodes=0), lambda: Cluster.dgx_a100(nodes=-1),
                                  lambda: Cluster.dgx_h100(nodes="two"), lambda: dataclasses.replace(Cluster.dgx1(), per_node=0)])
def test_presets_and_replaced_clusters_are_checked_too(make):
    with pytest.raises(ConstraintError) as e:
        make()
    _says(e, "is not an integer ≥ 1")


def test_a_good_cluster_is_unchanged():
    cluster = Cluster(**{**GOOD, "intra": [150e9, 0.0]})
    assert cluster.intra == (150e9, 0.0) and cluster.size == 8 and hash(cluster)
    assert Cluster.dgx1(nodes=2).size == 16


# -- plan_hybrid ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "batches, named",
    [
        ({"per_device_batch": 0}, "per_device_batch=0 is not a whole number of examples ≥ 1"),
        ({"per_device_batch": -8}, "per_device_batch=-8"),
        ({"per_device_batch": 8.5}, "per_device_batch=8.5"),
        ({"per_device_batch": "8"}, "per_device_batch='8'"),
        ({"per_device_batch": [8, 0]}, "per_device_batch=[8, 0]"),
        ({"per_device_batch": []}, "per_device_batch=[]"),
        ({"global_batch": 0}, "global_batch=0 is not a whole number of examples ≥ 1"),
        ({"global_batch": 7, "replica_sizes": [1, 2]}, "global_batch=7 splits evenly over none of the worker counts [8, 4]"),
        ({"per_device_batch": 8, "noise_scale": "4000"}, "noise_scale='4000' is not a positive number"),
        ({"per_device_batch": 8, "noise_scale": -math.inf}, "noise_scale=-inf"),
        ({"per_device_batch": 8, "min_examples": 0}, "min_examples=0 is not a positive number"),
        ({"per_device_batch": 8, "efficiency_table": {256: 10.0}}, "has 1 entry, fewer than 2"),
        ({"per_device_batch": 8, "efficiency_table": {256: 10.0, 1024: 8.0}}, "8 at batch 1024 < 10 at batch 256"),
    ],
)
def test_bad_hybrid_batches_and_statistics_are_refused_before_any_plan(monkeypatch, batches, named):
    import autosplit.api.planner

    def no_planning(*args, **kwargs):
        raise AssertionError("a bad input must be refused before any worker is planned")

    monkeypatch.setattr(autosplit.api.planner, "Planner", no_planning)
    with pytest.raises(ConstraintError) as e:
        plan_hybrid(_mlp(), Cluster.dgx1(), example_inputs=(torch.randn(8, 64),), **batches)
    _says(e, named)


@pytest.mark.parametrize(
    "table, named",
    [
        ({}, "has 0 entries, fewer than 2"),
        ({256: 10.0}, "efficiency_table {256: 10.0} has 1 entry"),
        ({256: 10.0, 1024: 12.0, 4096: 11.0, 8192: 9.0}, "11 at batch 4096 < 12 at batch 1024; 9 at batch 8192 < 11 at batch 4096"),
        ({0: 1.0, 256: 2.0}, "entries {0: 1.0} are not positive finite numbers"),
        ({256: -1.0, 512: 2.0}, "entries {256: -1.0}"),
        ({"256": 1.0, 512: 2.0}, "entries {'256': 1.0}"),
        ({256: math.inf, 512: 2.0}, "entries {256: inf}"),
    ],
)
def test_an_efficiency_table_needs_two_positive_entries_never_falling(table, named):
    with pytest.raises(ConstraintError) as e:
        examples_factor(1024, table=table)
    _says(e, named)


def test_a_good_efficiency_table_reads_in_batch_order():
    assert efficiency_points({1024: 12, 256: 10.0, 4096: 12.0}) == [(256.0, 10.0), (1024.0, 12.0), (4096.0, 12.0)]
    assert examples_factor(8192, table={256: 10.0, 1024: 12.0, 4096: 12.0}) == pytest.approx(1.2)  # a flat end stays flat


def test_a_meta_model_plans_with_cpu_example_inputs_as_its_cpu_twin_does():
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = _mlp()
    x = torch.randn(8, 64)
    kwargs = {"example_inputs": (x,), "per_device_batch": 8, "replica_sizes": [1, 2], "time_limit": 2}
    on_meta = plan_hybrid(meta, Cluster.dgx1(), **kwargs)
    on_cpu = plan_hybrid(_mlp(), Cluster.dgx1(), **kwargs)
    assert all(r.feasible for r in on_meta.rows) and len(on_meta.rows) == 3
    assert [(r.k, r.worker_batch, r.step, r.memory) for r in on_meta.rows] == [
        (r.k, r.worker_batch, r.step, r.memory) for r in on_cpu.rows]
    assert x.device.type == "cpu" and all(p.is_meta for p in meta.parameters())


def test_when_every_worker_plan_fails_alike_the_cause_leads_not_memory():
    half = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64, device="meta"))  # parameters on two devices
    with pytest.raises(CostModelError) as e:
        plan_hybrid(half, Cluster.dgx1(), example_inputs=(torch.randn(8, 64),), per_device_batch=8, replica_sizes=[1, 2],
                    time_limit=2)
    text = str(e.value)
    assert text.startswith("could not run node") and "cpu and meta" in text
    assert "memory" not in text and "larger replica sizes" not in text
    assert "every one of the 3 worker plans tried, replica sizes [1, 2], failed this way" in " ".join(e.value.__notes__)


# -- measure_noise_scale --------------------------------------------------------------------------
@pytest.mark.parametrize("small", [0, -4, 2.5, "8", True])
def test_small_batch_is_checked_before_anything_runs(small):
    model = nn.Linear(4, 1)
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    batches = [(torch.randn(16, 4), torch.randn(16))]
    with pytest.raises(ConstraintError) as e:
        measure_noise_scale(model, batches, lambda out, y: ((out.squeeze(-1) - y) ** 2).mean(), small_batch=small)
    _says(e, f"small_batch={small!r} is not an integer ≥ 1")
    assert not calls and all(p.grad is None for p in model.parameters())


def test_small_batch_not_below_the_big_batch_is_named():
    with pytest.raises(ConstraintError) as e:
        measure_noise_scale(nn.Linear(4, 1), [(torch.randn(16, 4), torch.randn(16))], lambda out, y: out.mean(), small_batch=16)
    _says(e, "a batch of 16 examples", "small_batch=16")
