"""The hybrid planner: the noise-scale estimator on a closed form, choices with known answers, and
its inputs checked up front, in the what → why → try shape, before any worker is planned; an
embedding's gradient synced as the rows it looked up."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.api.hybrid import measure_noise_scale, plan_hybrid
from autosplit.compiler.hybrid import Cluster, sync_windows
from autosplit.errors import CaptureError, ConstraintError
from tests.helpers import says


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


class _Towers(nn.Module):
    """Two unequal towers side by side: a makespan worker runs them on two devices at once."""

    def __init__(self):
        super().__init__()
        self.big = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
        self.small = nn.Linear(512, 512)

    def forward(self, x):
        return self.big(x) + self.small(x)


def test_a_makespan_workers_device_syncs_until_the_whole_worker_is_done():
    """The window a device's gradient sync hides in runs from its first backward task to the end
    of the worker's step, less its optimizer step: at least its own backward, exactly that on one
    device, and longer for the device with the small tower, which finishes first."""
    hp = plan_hybrid(_Towers(), _cluster(300e9, 1e9), example_inputs=(torch.zeros(64, 512),), per_device_batch=64,
                     objective="makespan", replica_sizes=[1, 2], time_limit=2)
    for r in hp.rows:
        windows = sync_windows(r.plan)
        assert all(w >= st.backward * (1 - 1e-9) for w, st in zip(windows, r.plan.stages))
        syncs = hp.cluster.gradient_syncs(r.plan.stages, r.k, r.replicas)
        assert r.allreduce == pytest.approx(max(max(0.0, t - w) for t, w in zip(syncs, windows)))
        if r.k == 1:
            assert windows == pytest.approx([r.plan.stages[0].backward], rel=1e-4)  # tasks are timed in whole nanoseconds
    split = next(r for r in hp.rows if r.k == 2 and len(r.plan.stages) == 2)
    assert max(w - st.backward for w, st in zip(sync_windows(split.plan), split.plan.stages)) > 0.2 * split.plan.step_time


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved1f1b"])
def test_a_pipeline_stages_sync_hides_behind_the_last_backwards_down_the_line(schedule):
    """GPipe and 1F1B end on the last micro-batch's backward running from the last stage to the
    first: stage s syncs behind its own and those of the stages before it. An interleaved loop
    keeps each stage's own."""
    model, inputs = _mlp()
    hp = plan_hybrid(model, _cluster(300e9, 1e9), example_inputs=inputs, per_device_batch=64, replica_sizes=[2],
                     schedule=schedule, micro_batches=4, time_limit=2, **({"stages_per_rank": 2} if schedule == "interleaved1f1b" else {}))
    plan = hp.rows[0].plan
    own = [st.backward / plan.micro_batches for st in plan.stages]
    assert sync_windows(plan) == pytest.approx(own if schedule == "interleaved1f1b" else [own[0], own[0] + own[1]])


def _mlp64(device: str | None = None) -> nn.Module:
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64, device=device), nn.ReLU())])


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
        plan_hybrid(_mlp64(), Cluster.dgx1(), example_inputs=(torch.randn(8, 64),), **batches)
    says(e, named)


def test_a_meta_model_plans_with_cpu_example_inputs_as_its_cpu_twin_does():
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = _mlp64()
    x = torch.randn(8, 64)
    kwargs = {"example_inputs": (x,), "per_device_batch": 8, "replica_sizes": [1, 2], "time_limit": 2}
    on_meta = plan_hybrid(meta, Cluster.dgx1(), **kwargs)
    on_cpu = plan_hybrid(_mlp64(), Cluster.dgx1(), **kwargs)
    assert all(r.feasible for r in on_meta.rows) and len(on_meta.rows) == 3
    assert [(r.k, r.worker_batch, r.step, r.memory) for r in on_meta.rows] == [
        (r.k, r.worker_batch, r.step, r.memory) for r in on_cpu.rows]
    assert x.device.type == "cpu" and all(p.is_meta for p in meta.parameters())


def test_when_every_worker_plan_fails_alike_the_cause_leads_not_memory():
    half = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64, device="meta"))  # parameters on two devices
    with pytest.raises(CaptureError) as e:
        plan_hybrid(half, Cluster.dgx1(), example_inputs=(torch.randn(8, 64),), per_device_batch=8, replica_sizes=[1, 2],
                    time_limit=2)
    text = str(e.value)
    assert text.startswith("the model is partly on the meta device and partly real")
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
    says(e, f"small_batch={small!r} is not an integer ≥ 1")
    assert not calls and all(p.grad is None for p in model.parameters())


def test_small_batch_not_below_the_big_batch_is_named():
    with pytest.raises(ConstraintError) as e:
        measure_noise_scale(nn.Linear(4, 1), [(torch.randn(16, 4), torch.randn(16))], lambda out, y: out.mean(), small_batch=16)
    says(e, "a batch of 16 examples", "small_batch=16")


class _SharedLookup(nn.Module):
    """An embedding looked up at each position's token and at a set of ids shared by the whole batch
    (a sampled softmax's candidates, shaped (1, n) so that the batch is never cut through them)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50_000, 64)
        self.out = nn.Linear(64, 64)

    def forward(self, tokens, shared):
        rows = self.emb(torch.cat([tokens.flatten(), shared.flatten()]))
        return self.out(rows[: tokens.numel()]).view(*tokens.shape, -1) + rows[tokens.numel():].mean(0)


def test_an_embeddings_gradient_is_synced_as_the_rows_looked_up_and_a_shared_input_keeps_its_shape():
    cluster = Cluster.dgx1(nodes=2)
    hp = plan_hybrid(_SharedLookup(), cluster, example_inputs=(torch.zeros(8, 4, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long)),
                     per_device_batch=8, replica_sizes=[1, 2], time_limit=2)
    assert {r.worker_batch for r in hp.rows} == {8, 16}
    for r in hp.rows:
        (table,) = [st for st in r.plan.stages if st.sparse_param_bytes]
        assert table.sparse_param_bytes == 50_000 * 64 * 4
        # Each position's row and the 16 shared ones (not resized with the batch), with a 64-bit index each.
        assert table.row_grad_bytes == (r.worker_batch * 4 + 16) * (64 * 4 + 8)
        synced = cluster.gradient_syncs(r.plan.stages, r.k, r.replicas)
        assert r.allreduce == pytest.approx(max(max(0.0, t - w) for t, w in zip(synced, sync_windows(r.plan))))
        if r.replicas > 1:
            assert cluster.gradient_sync(table, r.k, r.replicas) < cluster.allreduce(table.param_bytes, r.k, r.replicas)
