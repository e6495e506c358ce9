"""A Cluster, the hardware the hybrid planner plans for, is checked when it is made: a typed error
naming the field and the value found, in the what → why → try shape."""

from __future__ import annotations

import dataclasses
import math

import pytest

import autosplit
from autosplit.compiler.hybrid import Cluster
from autosplit.errors import ConstraintError
from tests.helpers import says

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
    says(e, "Cluster 'test'", named)


@pytest.mark.parametrize("make", [lambda: Cluster.dgx1(nodes=0), lambda: Cluster.dgx_a100(nodes=-1),
                                  lambda: Cluster.dgx_h100(nodes="two"),  # type: ignore[arg-type]  # the wrong type under test
                                  lambda: dataclasses.replace(Cluster.dgx1(), per_node=0)])
def test_presets_and_replaced_clusters_are_checked_too(make):
    with pytest.raises(ConstraintError) as e:
        make()
    says(e, "is not an integer ≥ 1")


def test_a_good_cluster_is_unchanged():
    cluster = Cluster(**{**GOOD, "intra": [150e9, 0.0]})
    assert cluster.intra == (150e9, 0.0) and cluster.size == 8 and hash(cluster)
    assert Cluster.dgx1(nodes=2).size == 16


@pytest.mark.parametrize("gpu, gpus, nodes, per_node, nic", [
    ("H100", 64, 8, 8, 50e9), ("h100-500w", 256, 32, 8, 50e9), ("B300", 16, 2, 8, 100e9),
    ("GB200", 256, 4, 64, 50e9),   # four racks of 64: the most whole trays of 4 that divide the job and fit 72
    ("GB200", 144, 2, 72, 50e9), ("GB300", 8, 1, 8, 100e9), ("GB200", 2, 1, 2, 50e9),
])
def test_cluster_of_a_record_gpu_fills_its_nvlink_domains(gpu, gpus, nodes, per_node, nic):
    cluster = Cluster.of(gpu, gpus)
    assert (cluster.nodes, cluster.per_node, cluster.inter_bandwidth / cluster.per_node) == (nodes, per_node, nic)
    assert cluster.intra[0] == cluster.device.link_bandwidth and cluster.source


@pytest.mark.parametrize("gpu, gpus, named", [("TPU", 8, "'TPU'"), ("H100", 0, "0 × 'H100'"),
                                              ("GB200", 74, "74 × GB200 NVL72 GPUs do not fill NVLink domains evenly")])
def test_cluster_of_refuses_unknown_kinds_and_uneven_jobs(gpu, gpus, named):
    with pytest.raises(ConstraintError) as e:
        Cluster.of(gpu, gpus)
    says(e, named)


@pytest.mark.parametrize("nbytes", [1e6, 1e9])
def test_a_collective_on_a_record_cluster_by_hand_inside_a_domain_and_across(nbytes):
    """An all-reduce of ``nbytes`` over a GB200 rack's 64 GPUs rides NVLink 5 (900 GB/s a way): a ring,
    2·63/64 of the bytes and 2·63 latencies; over 128 GPUs in two racks of 64, NCCL's hierarchy: the ring
    inside each rack, then each GPU's 1/64 shard across the racks on its own 400 Gb/s NIC. Small messages
    pay the latencies, large ones the bandwidth."""
    from autosplit.passes.sharding import group_time

    rack = Cluster.of("GB200", 64).replica_devices(64)[0]
    inside = 2 * 63 / 64 * nbytes / 900e9 + 2 * 63 * 5e-6
    assert group_time(nbytes, 64, rack, allreduce=True) == pytest.approx(inside)
    two = Cluster.of("GB200", 128).replica_devices(128)[0]
    across = 2 * 1 / 2 * (nbytes / 64) / 50e9 + 2 * 1 * 5e-6
    assert group_time(nbytes, 128, two, allreduce=True) == pytest.approx(inside + across)
    assert (inside < 1e-3) == (nbytes < 1e8)  # 1 MB: 0.63 ms, nearly all latency; 1 GB: 2.2 ms of bandwidth + 0.63 ms
