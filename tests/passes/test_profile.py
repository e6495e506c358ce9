"""Profiles: per-node times and memory measured on real work, the model and the RNG left as they
were, each backward and the optimizer step landing on the nodes they belong to."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import resource
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.devices import resolve_devices
from autosplit.errors import CostModelError
from autosplit.passes import profile as profile_module
from autosplit.passes.annotate import annotate
from autosplit.passes.capture import capture, flat_inputs
from autosplit.passes.costs import estimate
from autosplit.passes.in_context import beside, flat
from autosplit.passes.split_backward import cut_at_frontier, split_backward
from autosplit.timers import pinned, timed
from tests.helpers import FAST_PROFILE, ProfiledNet


def test_profile_measures_real_work_and_leaves_the_model_as_it_was(tmp_path):
    model, x = ProfiledNet(), torch.randn(512, 256)
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

    def four_micro_batches():
        outs = [model(chunk) for chunk in tokens.chunk(4)]
        for out in outs:
            out.backward(torch.ones_like(out))

    # The other test worker shares the 2 cores: a profile or a pass timed while its processes run took
    # twice as long or more (CI), either one, and a preempted node's backward can outlast a 16× bigger one.
    # A profile that misses, doubles or misplaces a node's time is off every time, so one clean try of three passes.
    tries = []
    for _ in range(3):
        prof = profile_module.profile(captured, micro, "cpu", fingerprint="test", options=options, micro_batches=4,
                                      forwards_first=True)
        assert all(p.grad is None for p in model.parameters())
        nodes = prof.nodes
        assert nodes["emb"].bwd > 0  # the table's gradient is made in the embedding's backward, not in its neighbour's
        with pinned(1, None):
            whole = timed(four_micro_batches, warmup=2, repeats=5)
        model.zero_grad(set_to_none=True)  # the whole passes' gradients, before the next try's profile is checked for none
        per_node = 4 * sum(n.fwd + n.bwd for n in nodes.values())
        tries.append((nodes["wide"].bwd, nodes["narrow"].bwd, per_node, whole))
        if nodes["wide"].bwd > nodes["narrow"].bwd and 0.5 * whole < per_node < 2 * whole:  # 16× the FLOPs
            break
    else:
        pytest.fail(f"no try of three timed the wide layer's backward above the narrow one's and the nodes' sum "
                    f"within 2× of the whole pass: (wide bwd, narrow bwd, nodes' sum, whole) = {tries}")


def test_a_mixed_precision_profile_runs_the_forward_under_autocast():
    """bf16-mixed is profiled as the runtime runs it, every forward under autocast: the ReLU after a
    Linear saves a bf16 output (half the fp32 profile's bytes); such a profile is cached apart, and a
    plan in bf16-mixed takes measured costs."""
    model, tokens = Lookup(), torch.randint(0, 4000, (16, 16))
    captured = capture(model, (tokens,))
    inputs = flat_inputs(captured, (tokens,), {})
    options = autosplit.options.ProfileOptions(use_cache=False, warmup=0, repeats=1, threads=1)
    fp32 = profile_module.profile(captured, inputs, "cpu", fingerprint="test", options=options, micro_batches=2)
    mixed = profile_module.profile(captured, inputs, "cpu", fingerprint="test", options=options, micro_batches=2,
                                   precision="bf16-mixed")
    assert (fp32.nodes["relu"].saved_bytes, mixed.nodes["relu"].saved_bytes) == (16 * 16 * 1024 * 4, 16 * 16 * 1024 * 2)
    assert mixed.key["precision"] == "bf16-mixed" and "precision" not in fp32.key
    assert all(n.fwd > 0 for n in mixed.nodes.values()) and all(p.grad is None for p in model.parameters())
    plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=(tokens,), precision="bf16-mixed", time_limit=2,
                          costs=autosplit.options.ProfileOptions(use_cache=False, **FAST_PROFILE))
    assert plan.costs.startswith("measured") and plan.precision == "bf16-mixed"


def _children() -> set[int]:
    """This process's child processes, zombies included (a test file's gloo group may be among them)."""
    return {int(pid) for task in Path("/proc/self/task").iterdir() for pid in (task / "children").read_text().split()}


def _reaped_cpu() -> float:
    """CPU seconds of this process's reaped children, to the microsecond (``os.times()`` counts whole clock ticks,
    and a child that ran 5 ms of a loaded machine's time may have been charged none)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


@pytest.mark.skipif(not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2 cores")
def test_a_profile_taken_beside_other_ranks_runs_them_and_leaves_no_process_behind(tmp_path):
    """``beside`` cores run the same passes in forked processes while the profile is timed: they
    compute (their CPU time shows when reaped), none outlives the profile, the model and its
    gradients stay as they were, and the profile is cached apart from the idle one."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # the GPU tests before it, in this process
        with pytest.raises(CostModelError, match="this process has initialised CUDA"):
            with beside(capture(Lookup(), (torch.zeros(2, 2, dtype=torch.long),)).gm, [], [0], 1):
                pass
        pytest.skip("forked passes beside a profile need a process that has not used CUDA")
    model, tokens = Lookup(), torch.randint(0, 4000, (64, 16))
    before = copy.deepcopy(model.state_dict())
    captured = capture(model, (tokens,))
    micro = flat_inputs(captured, (tokens[:16],), {})
    cores = sorted(os.sched_getaffinity(0))
    options = autosplit.options.ProfileOptions(warmup=1, repeats=3, threads=1, cores=(cores[0],), beside=(cores[1],),
                                               cache_dir=str(tmp_path))
    children_cpu, children = _reaped_cpu(), _children()
    prof = profile_module.profile(captured, micro, "cpu", fingerprint="test", options=options, micro_batches=4)
    assert _reaped_cpu() > children_cpu
    assert _children() == children, "a process the profile forked is still alive, or unreaped"
    assert all(p.grad is None for p in model.parameters())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=f"profiling changed {name}")
    assert prof.key["beside"] == [cores[1]] and all(n.fwd > 0 for n in prof.nodes.values())
    idle = profile_module.profile(captured, micro, "cpu", fingerprint="test", micro_batches=4,
                                  options=dataclasses.replace(options, beside=()))
    assert not idle.cached and "beside" not in idle.key and len(list(tmp_path.rglob("*.json"))) == 2


_PROFILING_PROCESS = os.getpid()


@torch.fx.wrap
def _fails_in_a_fork(x):
    if os.getpid() != _PROFILING_PROCESS:
        raise RuntimeError("not in the profiling process")
    return x


class _ForkFails(nn.Module):
    def forward(self, x):
        return _fails_in_a_fork(torch.relu(x))


@pytest.mark.skipif(not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2 cores")
def test_a_profile_whose_passes_beside_it_failed_is_refused():
    import time

    gm = torch.fx.symbolic_trace(_ForkFails())
    x = torch.randn(4, 4, requires_grad=True)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # no fork then (the GPU tests before it)
    with pytest.raises(CostModelError, match="this process has initialised CUDA" if cuda else r"stopped on an error on cores \[\d+\]"):
        with beside(gm, [x], (sorted(os.sched_getaffinity(0))[1],), 1):
            time.sleep(0.5)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_on_cuda_uses_events_and_allocator_statistics(tmp_path):
    model, x = ProfiledNet(), torch.randn(64, 256)
    plan = autosplit.plan(model, ["cuda:0", "cpu"], example_inputs=(x,),
                          costs=autosplit.options.ProfileOptions(cache_dir=str(tmp_path), **FAST_PROFILE))
    assert plan.costs == "measured on cpu, cuda:0"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_profile_times_nodes_inside_whole_passes_plain_split_and_mixed():
    """On a GPU the nodes are timed inside whole passes by CUDA events: they add up to the passes,
    a split backward's I and W are apart, bf16-mixed runs under autocast, gradients stay untouched."""
    model, tokens = Lookup().cuda(), torch.randint(0, 4000, (64, 16), device="cuda")
    captured = capture(model, (tokens,))
    micro = flat_inputs(captured, (tokens[:16],), {})
    options = autosplit.options.ProfileOptions(use_cache=False, warmup=1, repeats=3)
    run = functools.partial(profile_module.profile, captured, micro, "cuda:0", fingerprint="test", options=options, micro_batches=4)
    plain, split, mixed = run(), run(split_backward=True), run(precision="bf16-mixed")
    assert all(p.grad is None for p in model.parameters())
    for prof in (plain, split, mixed):
        assert all(n.fwd > 0 and n.bwd > 0 for n in prof.nodes.values()), prof.nodes
    assert 0 < split.nodes["wide"].wgrad_share < 1 and split.nodes["emb"].wgrad_share == 1.0
    assert mixed.nodes["relu"].saved_bytes * 2 == plain.nodes["relu"].saved_bytes

    def four_micro_batches():
        for out in [model(chunk) for chunk in tokens.chunk(4)]:
            out.backward(torch.ones_like(out))

    whole = timed(four_micro_batches, device="cuda:0", warmup=2, repeats=5)
    per_node = 4 * sum(n.fwd + n.bwd for n in plain.nodes.values())
    assert 0.5 * whole < per_node < 2 * whole, (per_node, whole)


def test_an_exported_model_with_keyword_inputs_is_profiled():
    """torch.export's graph rebuilds the model's (args, kwargs) in its own forward; the profiler's
    plain pass calls it with the placeholders' values, as the per-node pass does."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=60, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=16, use_cache=False)
    cfg._attn_implementation = "eager"
    ids = torch.randint(0, 60, (2, 8))
    plan = autosplit.plan(LlamaForCausalLM(cfg), ["cpu"] * 2, example_inputs=(ids,), example_kwargs={"attention_mask": torch.ones(2, 8)},
                          costs=autosplit.options.ProfileOptions(use_cache=False, **FAST_PROFILE), time_limit=2)
    assert plan.capture == "export" and plan.costs.startswith("measured") and plan.step_time > 0


def test_a_split_backward_profile_runs_torchs_input_and_weight_passes_to_the_same_gradients():
    """Zero-bubble schedules are profiled with torch's I and W passes from the graph's first
    activations (:func:`_cut_at_frontier`), which must give the gradients a plain backward gives;
    the two passes are timed apart and give each node its weight pass's share; such a profile is
    cached apart from the plain one."""
    model, tokens = Lookup(), torch.randint(0, 4000, (16, 16))
    captured = capture(model, (tokens,))
    inputs = flat_inputs(captured, (tokens,), {})
    cut = cut_at_frontier(flat(captured.gm), inputs)
    assert cut is not None
    params = list(captured.gm.parameters())
    out, values, leaves = cut(*inputs)
    assert [v.grad_fn.name() for v in values] == ["EmbeddingBackward0"] and all(leaf.is_leaf for leaf in leaves)
    split_backward([out], values, leaves, params)
    split = [p.grad.clone() for p in params]
    captured.gm.zero_grad(set_to_none=True)
    plain = flat(captured.gm)(*inputs)
    plain.backward(torch.ones_like(plain))
    for p, g in zip(params, split):
        torch.testing.assert_close(g, p.grad)
    captured.gm.zero_grad(set_to_none=True)

    options = autosplit.options.ProfileOptions(use_cache=False, warmup=0, repeats=1, threads=1)
    annotate(captured, inputs)
    # What splitting costs is the split passes' time beyond a whole backward, never below 0: on a busy
    # machine one try can clock the split passes no slower than the whole one. One try of three must show it.
    for _ in range(3):
        prof = profile_module.profile(captured, inputs, "cpu", fingerprint="test", options=options, micro_batches=2,
                                      split_backward=True)
        if any(n.split_cost for n in prof.nodes.values()):
            break
    assert prof.key["split_backward"] is True and all(p.grad is None for p in params)
    # each node's I and W timed apart: a layer's backward divides between them, the embedding's is all W
    # (before the cut, torch's first stage runs it in W), the ReLU's all I (it has no weight to run again)
    nodes = prof.nodes
    assert nodes["wide"].bwd > 0 and 0 < nodes["wide"].wgrad_share < 1
    assert (nodes["emb"].wgrad_share, nodes["relu"].wgrad_share) == (1.0, 0.0)
    table = estimate(captured.gm, resolve_devices(["cpu"]), profiles=[prof], micro_batches=2)
    assert table.wgrad_share[table.nodes.index("wide")] == nodes["wide"].wgrad_share
    # what splitting costs, beside a whole backward, is part of each node's backward
    assert table.split_cost and all(abs(c) < sum(b) for c, b in zip((row[0] for row in table.split_cost), table.bwd_time) if c)
    whole = profile_module.profile(captured, inputs, "cpu", fingerprint="test", options=options).nodes["wide"]
    assert (whole.wgrad_share, whole.split_cost) == (None, 0.0)
