"""``precision="bf16-fsdp"`` (FSDP2's ``MixedPrecisionPolicy``) before anything runs distributed: the
capture with bf16 parameters, what the cost model holds for it, and what is refused.

The runs themselves (2 and 4 gloo processes, against the unsplit model under the policy) are in
``tests/runtime/test_sharded_layouts.py``.
"""

from __future__ import annotations

import pytest
import torch

import autosplit
from autosplit.compiler.costs import cost_table
from autosplit.compiler.trace import trace
from autosplit.devices import PRESETS
from autosplit.errors import ConstraintError
from autosplit.passes.capture import capture
from autosplit.passes.sharding import data_parallel_time
from tests.helpers import NO_SEARCH, gpt_case, says
from tests.layouts import forward_in, llama_case

H100 = PRESETS["H100-80GB"]


def test_an_exported_llama_captured_with_bf16_parameters_computes_as_the_eager_model_under_the_policy():
    """torch.export bakes dtypes: captured so, the graph is the eager model's function once FSDP2 hands it
    bf16 parameters (its RMSNorm's cast back to the input's dtype is a cast to bf16), and the model is
    left as it was — the same fp32 ``Parameter`` objects, which the graph holds."""
    pytest.importorskip("transformers")
    model, (tokens,), *_ = llama_case()
    before = {name: (p, p.data.clone()) for name, p in model.named_parameters()}
    captured = capture(model, (tokens[:2],), {}, method="export", param_dtype=torch.bfloat16)
    assert captured.method == "export" and captured.param_dtype is torch.bfloat16
    for name, (p, data) in before.items():
        assert p.dtype == torch.float32 and torch.equal(p.data, data), name
        assert captured.gm.get_parameter(name) is p, name
    cast = {name: p.to(torch.bfloat16) for name, p in model.named_parameters()}
    graph_out = torch.func.functional_call(captured.gm, cast, (tokens[:2],), {"use_cache": False})
    eager_out = forward_in(model, "bf16-fsdp", (tokens[:2],), {"use_cache": False})
    graph_logits = graph_out["logits"] if isinstance(graph_out, dict) else graph_out[0]
    assert graph_logits.dtype is torch.bfloat16 and torch.equal(graph_logits, eager_out.logits)


def test_the_policy_holds_a_bf16_copy_and_fp32_gradients_where_autocast_holds_fp32_parameters_too():
    """Per parameter byte of fp32 master weights (P), a stage gathered for the step holds, beyond its
    sharded model state: under bf16-mixed the fp32 parameters and gradients whole (2P) and autocast's
    bf16 copy of the matmuls' weights; under bf16-fsdp the bf16 copy of every weight (P/2) and the fp32
    gradients FSDP2 accumulates (P). Its all-gather moves bf16: half the bytes."""
    model, args, kwargs, _, _ = gpt_case()
    held: dict[tuple[str, int], tuple] = {}
    for precision in ("bf16-mixed", "bf16-fsdp"):
        planner = autosplit.Planner(model, [H100] * 2, example_inputs=args, example_kwargs=kwargs, precision=precision,
                                    micro_batches=2, **NO_SEARCH)
        for D in (1, 4):
            options = planner.options.replace(data_parallel=D, replicate="fully_shard")
            held[precision, D] = cost_table(planner.traced, (H100,), options, micro_batches=2)[0]
    P = sum(held["bf16-fsdp", 1].param_bytes)
    assert P == sum(held["bf16-mixed", 1].param_bytes) == 4 * sum(p.numel() for p in model.parameters())  # fp32 master weights
    mixed_copy, buffers = sum(held["bf16-mixed", 1].weight_copy_bytes), sum(held["bf16-mixed", 1].buffer_bytes)
    assert sum(held["bf16-fsdp", 1].weight_copy_bytes) == P // 2 > mixed_copy  # every weight, norms and embeddings too
    adam = 4 * P  # parameters, gradients and AdamW's two moments, fp32
    assert sum(held["bf16-mixed", 1].state_bytes) == adam + mixed_copy + buffers
    assert sum(held["bf16-fsdp", 1].state_bytes) == adam + P // 2 + P + buffers
    assert sum(held["bf16-mixed", 4].state_bytes) == pytest.approx(adam / 4 + mixed_copy + 2 * P + buffers, abs=len(model.state_dict()))
    assert sum(held["bf16-fsdp", 4].state_bytes) == pytest.approx(adam / 4 + P // 2 + P + buffers, abs=len(model.state_dict()))
    kw = dict(replicas=1, shards=8, waits=[0.0], drains=[0.0])
    gather_and_reduce = data_parallel_time([8e9], [H100], **kw)
    assert data_parallel_time([8e9], [H100], **kw, gathered=0.5) == pytest.approx(gather_and_reduce * 3 / 4, rel=1e-3)
    # Megatron's bf16 gradients: the reduction moves half the bytes too
    assert data_parallel_time([8e9], [H100], **kw, gathered=0.5, reduced=0.5) == pytest.approx(data_parallel_time([4e9], [H100], **kw))


def test_the_policy_is_refused_where_it_cannot_run_or_was_not_captured():
    pytest.importorskip("transformers")
    model, args, kwargs, *_ = gpt_case()
    with pytest.raises(ConstraintError) as e:  # one process: no process group for FSDP2
        autosplit.autosplit(model, ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, precision="bf16-fsdp", **NO_SEARCH)
    says(e, "precision='bf16-fsdp'", "FSDP2 needs a process group", "autosplit.distribute")
    llama, (tokens,), *_ = llama_case()
    traced = trace(llama, (tokens,), {}, method="auto")  # exported with its fp32 parameters baked in
    assert traced.captured.method == "export"
    with pytest.raises(ConstraintError) as e:
        traced.annotated("bf16-fsdp", "cpu")
    says(e, "precision='bf16-fsdp' computes with the parameters in torch.bfloat16", "exported with them in their own dtype",
         "Planner made with precision='bf16-fsdp'")
    policy = trace(llama, (tokens,), {}, method="auto", precision="bf16-fsdp")
    assert policy.annotated("bf16-fsdp", "cpu") is policy.captured.gm
    with pytest.raises(ConstraintError):
        policy.annotated("bf16-mixed", "cpu")


def test_a_planner_captures_an_exported_model_again_for_the_policy_and_a_traced_one_once():
    pytest.importorskip("transformers")
    llama, (tokens,), *_ = llama_case()
    planner = autosplit.Planner(llama, ["cpu"] * 2, example_inputs=(tokens,), micro_batches=2, **NO_SEARCH)
    fsdp = planner.with_options(precision="bf16-fsdp")
    assert fsdp.traced is not planner.traced and fsdp.traced.captured.param_dtype is torch.bfloat16
    assert planner.traced.captured.param_dtype is None and fsdp.traced_for(planner.options) is planner.traced  # kept, shared
    recipe = planner.manual(autosplit.Recipe([["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]],
                                             options={"precision": "bf16-fsdp"}))
    assert recipe.precision == "bf16-fsdp" and recipe.fingerprint == fsdp.traced.fingerprint
    gpt, args, kwargs, *_ = gpt_case()
    traced = autosplit.Planner(gpt, ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, **NO_SEARCH)
    assert traced.with_options(precision="bf16-fsdp").traced is traced.traced  # a traced graph records no dtypes
