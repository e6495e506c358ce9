"""The hybrid planner's models, by hand: ring and hierarchical all-reduce and all-gather (an embedding
table's gradient as its rows), statistical efficiency
from a noise scale or a table of epochs to target, and that table's checks."""

from __future__ import annotations

import dataclasses
import math

import pytest

import autosplit
from autosplit.compiler.hybrid import Cluster
from autosplit.errors import ConstraintError
from autosplit.plans import StageReport
from autosplit.solver.hybrid import (
    efficiency_points,
    examples_factor,
    hierarchical_allgather,
    hierarchical_allreduce,
    ring_allgather,
    ring_allreduce,
)
from tests.helpers import says


def test_allreduce_models_by_hand():
    assert ring_allreduce(8e9, 1, 1e9, 1e-3) == 0
    assert ring_allreduce(8e9, 4, 1e9, 1e-3) == pytest.approx(2 * 3 / 4 * 8 + 6e-3)
    intra, inter = (100e9, 1e-6), (10e9, 1e-5)
    assert hierarchical_allreduce(8e9, local=4, nodes=1, intra=intra, inter=inter) == pytest.approx(ring_allreduce(8e9, 4, *intra))
    assert hierarchical_allreduce(8e9, local=1, nodes=4, intra=intra, inter=inter) == pytest.approx(ring_allreduce(8e9, 4, *inter))
    both = ring_allreduce(8e9, 4, *intra) + ring_allreduce(2e9, 8, *inter)
    assert hierarchical_allreduce(8e9, local=4, nodes=8, intra=intra, inter=inter) == pytest.approx(both)
    dgx = Cluster.dgx1(nodes=4)  # 32 V100s; one stage's copies on every GPU (k = 1): 8 per node, 4 nodes
    share = (dgx.inter_bandwidth / 8, dgx.inter_latency)
    assert dgx.allreduce(1e9, 1, 32) == pytest.approx(ring_allreduce(1e9, 8, *dgx.intra) + ring_allreduce(1e9 / 8, 4, *share))
    assert dgx.allreduce(1e9, 16, 2) == pytest.approx(ring_allreduce(1e9, 2, *share))  # each copy on its own node


def test_allgather_models_by_hand():
    assert ring_allgather(1e9, 1, 1e9, 1e-3) == 0
    assert ring_allgather(1e9, 4, 1e9, 1e-3) == pytest.approx(3 * 1 + 3e-3)  # each peer receives 3 pieces
    intra, inter = (100e9, 1e-6), (10e9, 1e-5)
    both = ring_allgather(1e9, 8, *inter) + ring_allgather(8e9, 4, *intra)  # across the nodes, then inside each
    assert hierarchical_allgather(1e9, local=4, nodes=8, intra=intra, inter=inter) == pytest.approx(both)
    dgx = Cluster.dgx1(nodes=4)
    share = (dgx.inter_bandwidth / 8, dgx.inter_latency)
    assert dgx.allreduce(1e6, 16, 2, gather=True) == pytest.approx(ring_allgather(1e6, 2, *share))


def test_an_embedding_tables_gradient_is_gathered_as_rows_only_where_that_is_faster():
    dgx = Cluster.dgx1(nodes=16)
    table, rows = 3.2e9, 10e6  # a 793k × 1024 fp32 softmax table, and the rows one replica looked up
    stage = StageReport("gpu", 1, 0, (), 0.0, 0.0, 0.0, 0, 0, 0, 0, 0, param_bytes=int(table) + 4000,
                        sparse_param_bytes=int(table), row_grad_bytes=int(rows))
    dense = dgx.allreduce(4000, 1, 128)
    gathered = dgx.allreduce(rows, 1, 128, gather=True)
    assert gathered < dgx.allreduce(table, 1, 128)
    assert dgx.gradient_sync(stage, 1, 128) == pytest.approx(dense + gathered)
    crowded = dataclasses.replace(stage, row_grad_bytes=int(table))  # every row looked up: all-reducing is cheaper
    assert dgx.gradient_sync(crowded, 1, 128) == pytest.approx(dense + dgx.allreduce(table, 1, 128))
    plain = dataclasses.replace(stage, sparse_param_bytes=0, row_grad_bytes=0)
    assert dgx.gradient_sync(plain, 1, 128) == dgx.allreduce(table + 4000, 1, 128)


def test_a_workers_stages_share_their_nodes_network_up_to_each_nic():
    """k = 2 on DGX-1s: a 4 GB stage beside a 0.4 GB one. Each alone on its even share (1/8 of the
    node's 50 GB/s) takes its `gradient_sync`; syncing at once, the node moves both at its full
    bandwidth, the heavy stage at most at its NIC's 12.5 GB/s (2 shares): by hand below."""
    dgx = Cluster.dgx1(nodes=16)
    heavy, light = (StageReport("gpu", 1, 0, (), 0.0, 0.0, 0.0, 0, 0, 0, 0, 0, param_bytes=n) for n in (4_000_000_000, 400_000_000))
    share = (dgx.inter_bandwidth / 8, dgx.inter_latency)
    across = [ring_allreduce(n / 4, 16, *share) for n in (4e9, 4e8)]  # 4 copies of each stage per node, 16 nodes
    inside = [ring_allreduce(n, 4, *dgx.intra) for n in (4e9, 4e8)]
    assert [dgx.gradient_sync(st, 2, 64) for st in (heavy, light)] == pytest.approx([i + a for i, a in zip(inside, across)])
    node = (across[0] + across[1]) / 2  # the node's 8 devices' bytes at 8 shares
    expected = [inside[0] + max(node, across[0] / 2), inside[1] + across[1]]  # the light stage cannot beat its own share's time
    assert dgx.gradient_syncs([heavy, light], 2, 64) == pytest.approx(expected)
    assert expected[0] < 0.65 * dgx.gradient_sync(heavy, 2, 64)  # its part across the nodes halved
    # data parallelism alone (k = 1), or a NIC per device: every device on its even share, as before
    assert dgx.gradient_syncs([heavy], 1, 128) == [dgx.gradient_sync(heavy, 1, 128)]
    even = dataclasses.replace(dgx, nic_bandwidth=None)
    assert even.gradient_syncs([heavy, light], 2, 64) == [even.gradient_sync(st, 2, 64) for st in (heavy, light)]
    with pytest.raises(ConstraintError, match=r"nic_bandwidth=1000000000.0 is not between the even share"):
        dataclasses.replace(dgx, nic_bandwidth=1e9)


def test_statistical_efficiency():
    assert examples_factor(1024, None) == 1 and examples_factor(1024, math.inf) == 1
    assert examples_factor(1024, 512.0) == pytest.approx(3.0)
    table = {256: 10.0, 1024: 12.0, 4096: 20.0}  # epochs to target at three global batches
    assert examples_factor(128, table=table) == 1 and examples_factor(1024, table=table) == pytest.approx(1.2)
    assert examples_factor(512, table=table) == pytest.approx(math.sqrt(1.0 * 1.2))  # log-log midpoint
    assert examples_factor(8192, table=table) == pytest.approx((20 + 8 / 3072 * 4096) / 10)  # the last segment, extended
    with pytest.raises(autosplit.errors.ConstraintError, match="noise_scale=-1"):
        examples_factor(64, -1.0)


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
    says(e, named)


def test_a_good_efficiency_table_reads_in_batch_order():
    assert efficiency_points({1024: 12, 256: 10.0, 4096: 12.0}) == [(256.0, 10.0), (1024.0, 12.0), (4096.0, 12.0)]
    assert examples_factor(8192, table={256: 10.0, 1024: 12.0, 4096: 12.0}) == pytest.approx(1.2)  # a flat end stays flat
