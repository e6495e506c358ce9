"""The hybrid planner (issue #11): all-reduce models, statistical efficiency, the noise-scale
estimator on a closed form, and choices with known answers."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.api.hybrid import measure_noise_scale, plan_hybrid
from autosplit.compiler.hybrid import Cluster
from autosplit.solver.hybrid import examples_factor, hierarchical_allreduce, ring_allreduce


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


def test_statistical_efficiency():
    assert examples_factor(1024, None) == 1 and examples_factor(1024, math.inf) == 1
    assert examples_factor(1024, 512.0) == pytest.approx(3.0)
    table = {256: 10.0, 1024: 12.0, 4096: 20.0}  # epochs to target at three global batches
    assert examples_factor(128, table=table) == 1 and examples_factor(1024, table=table) == pytest.approx(1.2)
    assert examples_factor(512, table=table) == pytest.approx(math.sqrt(1.0 * 1.2))  # log-log midpoint
    assert examples_factor(8192, table=table) == pytest.approx((20 + 8 / 3072 * 4096) / 10)  # the last segment, extended
    with pytest.raises(autosplit.errors.ConstraintError, match="noise_scale=-1"):
        examples_factor(64, -1.0)


def test_noise_scale_estimator_on_linear_regression():
    """Linear regression, x ~ N(0, I_d), y = w*·x + ε, ε ~ N(0, σ²), loss ½(w·x − y)², at w = w* + δ:
    G = δ, tr Σ = E|g|² − |G|² = |δ|²(d + 2) + σ²d − |δ|², so B_simple = d + 1 + σ²d / |δ|²."""
    torch.manual_seed(0)
    d, sigma = 10, 1.0
    w_star = torch.randn(d, dtype=torch.float64)
    delta = torch.randn(d, dtype=torch.float64)
    delta /= delta.norm()  # |δ|² = 1
    model = nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    expected = d + 1 + sigma**2 * d / 1.0

    def batches(n, size):
        for _ in range(n):
            x = torch.randn(size, d, dtype=torch.float64)
            yield x, x @ w_star + sigma * torch.randn(size, dtype=torch.float64)

    loss_fn = lambda out, y: 0.5 * ((out.squeeze(-1) - y) ** 2).mean()  # noqa: E731
    found = measure_noise_scale(model, batches(200, 256), loss_fn, small_batch=8)
    assert found.noise_scale == pytest.approx(expected, rel=0.1)
    assert found.grad_sq == pytest.approx(1.0, rel=0.1) and found.trace == pytest.approx(d + 1 + d, rel=0.1)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(autosplit.errors.ConstraintError, match="does not split into more than one chunk"):
        measure_noise_scale(model, batches(1, 8), loss_fn, small_batch=8)

    # BatchNorm in training mode would normalise each chunk of 8 by its own statistics and
    # couple its examples; it is measured with its running statistics (at init the identity, up to eps).
    normed = nn.Sequential(nn.BatchNorm1d(d, affine=False), model).double().train()
    torch.manual_seed(0)
    found = measure_noise_scale(normed, batches(200, 256), loss_fn, small_batch=8)
    assert found.noise_scale == pytest.approx(expected, rel=0.1)
    assert normed[0].training and torch.equal(normed[0].running_mean, torch.zeros(d, dtype=torch.float64))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.ReLU())]), (torch.randn(64, 512),)


def _cluster(intra: float, inter: float, per_node: int = 2, nodes: int = 8) -> Cluster:
    gpu = dataclasses.replace(autosplit.devices.PRESETS["V100-16GB"], name="gpu")
    return Cluster("test", gpu, nodes, per_node, (intra, 0.0), inter, 0.0)


def test_free_allreduce_and_flat_efficiency_mean_data_parallelism_alone():
    model, inputs = _mlp()
    # A batch large enough that compute, not the optimizer step (which a split worker shares out), dominates.
    hp = plan_hybrid(model, _cluster(1e18, 1e18), example_inputs=inputs, per_device_batch=4096, replica_sizes=[1, 2, 4],
                     time_limit=2)
    assert hp.choice.k == 1 and hp.gain == 0 and hp.crossover is None
    assert {(r.k, r.worker_batch) for r in hp.rows} == {(1, 4096), (2, 4096), (2, 8192), (4, 4096), (4, 16384)}
    assert all(r.allreduce == 0 for r in hp.rows)
    assert "◀ choice" in str(hp)
    several = plan_hybrid(model, _cluster(1e18, 1e18), example_inputs=inputs, per_device_batch=[2048, 4096],
                          replica_sizes=[1, 2], time_limit=2)
    assert {(r.k, r.worker_batch) for r in several.rows} == {(1, 2048), (1, 4096), (2, 2048), (2, 4096), (2, 8192)}


def test_small_noise_scale_and_a_slow_network_make_the_hybrid_win_at_the_crossover_by_hand():
    model, inputs = _mlp()
    # Two devices per node, a network between nodes slower than NVLink; a global batch past the noise scale.
    cluster, noise, b = _cluster(300e9, 50e9), 32768.0, 4096
    hp = plan_hybrid(model, cluster, example_inputs=inputs, per_device_batch=b, noise_scale=noise, replica_sizes=[1, 2],
                     time_limit=2)
    one = next(r.plan for r in hp.rows if (r.k, r.worker_batch) == (1, b))
    two = next(r.plan for r in hp.rows if (r.k, r.worker_batch) == (2, b))
    share = cluster.inter_bandwidth / cluster.per_node

    def ring(nbytes, n, bw):
        return 2 * (n - 1) / n * nbytes / bw if n > 1 else 0.0

    def dp(n):  # every device a worker: all-reduce inside the node pair, then across n/2 nodes on half the bytes
        st = one.stages[0]
        allreduce = ring(st.param_bytes, min(n, 2), 300e9) + ring(st.param_bytes / min(n, 2), math.ceil(n / 2), share)
        step = one.step_time + max(0.0, allreduce - st.backward)
        return (1 + n * b / noise) / (n * b) * step

    def hybrid(n):  # a node pair per worker: each stage's copies, one per node, all-reduce across n/2 nodes
        exposed = max(max(0.0, ring(st.param_bytes, n // 2, share) - st.backward / two.micro_batches) for st in two.stages)
        return (1 + n // 2 * b / noise) / (n // 2 * b) * (two.step_time + exposed)

    by_hand = next(n for n in (2, 4, 8, 16) if hybrid(n) < dp(n))
    assert hp.crossover == by_hand and by_hand > 2, "data parallelism alone wins inside one node, the hybrid beyond it"
    assert hp.choice.k == 2 and hp.gain > 0
    assert hp.best_data_parallel.time_to_target == pytest.approx(dp(16))
    pair = next(r for r in hp.rows if (r.k, r.worker_batch) == (2, b))
    assert pair.time_to_target == pytest.approx(hybrid(16))
    assert hp.choice.time_to_target == min(r.time_to_target for r in hp.rows)
    assert [p.devices for p in hp.scaling] == [1, 2, 4, 8, 16]
    for p in hp.scaling:
        assert p.data_parallel.time_to_target == pytest.approx(dp(p.devices))
        assert (p.hybrid is None) == (p.devices == 1)
    assert hp.with_statistics(noise_scale=noise).to_dict() == hp.to_dict()
    assert all(r.examples_factor == 1 for r in hp.with_statistics().rows)
    assert "devices" in hp.scaling_report() and json.loads(json.dumps(hp.to_dict()))["scaling"][-1]["devices"] == 16


def test_bad_hybrid_input_is_refused():
    model, inputs = _mlp()
    with pytest.raises(autosplit.errors.ConstraintError, match="exactly one of per_device_batch and global_batch"):
        plan_hybrid(model, Cluster.dgx1(), example_inputs=inputs)
    with pytest.raises(autosplit.errors.ConstraintError, match=r"replica sizes \[3\] do not divide"):
        plan_hybrid(model, Cluster.dgx1(), example_inputs=inputs, per_device_batch=8, replica_sizes=[3])
    tiny = dataclasses.replace(Cluster.dgx1(), device=dataclasses.replace(autosplit.devices.PRESETS["V100-16GB"], memory=1 << 20))
    with pytest.raises(autosplit.errors.InfeasiblePlanError, match=r"k = 1, worker batch 8: .* needs .* MiB"):
        plan_hybrid(model, tiny, example_inputs=inputs, per_device_batch=8, replica_sizes=[1])
    with pytest.raises(autosplit.errors.ConstraintError, match="objective='sideways'"):
        plan_hybrid(model, Cluster.dgx1(), example_inputs=inputs, per_device_batch=8, objective="sideways")


def test_workers_may_be_planned_for_the_makespan():
    model, inputs = _mlp()
    hp = plan_hybrid(model, _cluster(300e9, 50e9), example_inputs=inputs, per_device_batch=64, objective="makespan",
                     replica_sizes=[1, 2], time_limit=2)
    assert {r.plan.schedule for r in hp.rows} == {"makespan"} and all(r.micro_batches == 1 for r in hp.rows)
    # A chain has no parallel branches: splitting a worker only adds transfers.
    assert hp.choice.k == 1


def _cpu_cluster() -> Cluster:
    cpu = dataclasses.replace(autosplit.devices.PRESETS["cpu"], torch_device="cpu")
    return Cluster("2 × 2 CPU processes", cpu, 2, 2, (cpu.link_bandwidth, cpu.link_latency), 1e9, 1e-4)


def _mesh_worker(rank: int, init: str, out: str) -> None:
    import sys
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
    from test_distributed import _double, _gpt, _local, _reference_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=4, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model, args, kwargs, target, loss_fn = _gpt()  # a global batch of 8
        model = model.double()
        reference = copy.deepcopy(model)
        box = [None]
        if rank == 0:  # the hybrid planner's choice: 2 workers × 2 stages, each worker 4 of the 8 rows
            box = [plan_hybrid(model, _cpu_cluster(), example_inputs=tuple(a[:4] for a in args),
                               example_kwargs={k: v[:4] for k, v in kwargs.items()}, global_batch=8, replica_sizes=[2],
                               noise_scale=1e3, time_limit=2).choice]
        dist.broadcast_object_list(box, src=0)
        choice = box[0]
        assert (choice.k, choice.replicas, choice.worker_batch) == (2, 2, 4)
        mine = slice((rank % 2) * 4, (rank % 2 + 1) * 4)
        my_args, my_kwargs = tuple(a[mine] for a in args), {k: v[mine] for k, v in kwargs.items()}
        pipe = autosplit.distribute(model, None, example_inputs=my_args, example_kwargs=my_kwargs, loss_fn=loss_fn,
                                    data_parallel=choice.replicas, plan=choice.plan)
        opt, ref_opt = torch.optim.Adam(pipe.parameters(), lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
        ref_params = dict(reference.named_parameters())
        for step in range(3):
            pipe.step(*my_args, target=target[mine], **my_kwargs)
            _reference_step(reference, tuple(_double(a) for a in args), kwargs, target, loss_fn, chunks=1)
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(_local(p.grad), ref_params[name].grad, msg=lambda m: f"step {step} {name}: {m}")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(_local(p), ref_params[name])
        Path(out, f"rank{rank}.ok").write_text("ok")
    finally:
        dist.destroy_process_group()


def test_the_chosen_hybrid_trains_like_the_unsplit_model_on_a_2x2_mesh(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_mesh_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=4, join=True)
    assert sorted(p.name for p in tmp_path.glob("*.ok")) == [f"rank{r}.ok" for r in range(4)]
