"""The loss: costed as the last stage runs it — on fake tensors of the model's output (analytic) or
timed on real ones (measured) — and charged to the node that makes the output, every micro-batch's;
refused clearly when it cannot run on that output."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autosplit
from autosplit.compiler.costs import cost_table
from autosplit.compiler.trace import trace
from autosplit.devices import resolve_devices
from autosplit.errors import ConstraintError, CostModelError
from autosplit.options import PlanOptions
from autosplit.passes.loss import Loss, cost_loss, output_like

VOCAB, ROWS, SEQ = 2000, 8, 16


class TinyLM(nn.Module):
    """Embedding, a layer, and logits over a vocabulary: what the loss reads is large."""

    def __init__(self, as_dict: bool = False):
        super().__init__()
        self.as_dict = as_dict
        self.emb = nn.Embedding(VOCAB, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens):
        logits = self.head(torch.relu(self.mid(self.emb(tokens))))
        return {"logits": logits} if self.as_dict else logits


def lm_loss(out, target):
    logits = out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _data():
    torch.manual_seed(0)
    return torch.randint(0, VOCAB, (ROWS, SEQ)), torch.randint(0, VOCAB, (ROWS, SEQ))


def test_the_loss_is_charged_to_the_node_that_makes_the_output_for_every_micro_batch_in_its_input_pass():
    model, (tokens, target) = TinyLM(), _data()
    specs, options, M = resolve_devices(["cpu"] * 2), PlanOptions(micro_batches=4), 4
    without, _ = cost_table(trace(model, (tokens,), {}, method="auto"), specs, options, micro_batches=M)
    traced = trace(model, (tokens,), {}, method="auto", loss=Loss(lm_loss, target))
    table, source = cost_table(traced, specs, options, micro_batches=M)
    assert "loss" in source
    captured, micro = traced.at_micro_batch(M)
    cost = cost_loss(traced.loss, output_like(captured, micro), M, specs)
    assert all(t > 0 for t in cost.fwd + cost.bwd)
    # cross_entropy keeps its log-softmax for backward: one micro-batch's logits in fp32
    assert cost.saved_bytes >= ROWS // M * SEQ * VOCAB * 4
    head = table.nodes.index("head")
    for i, name in enumerate(table.nodes):
        if i == head:
            for d in range(2):
                assert table.fwd_time[i][d] == pytest.approx(without.fwd_time[i][d] + M * cost.fwd[d])
                assert table.bwd_time[i][d] == pytest.approx(without.bwd_time[i][d] + M * cost.bwd[d])
            assert table.saved_bytes[i] == without.saved_bytes[i] + M * cost.saved_bytes
            # the loss's backward is the output's gradient, input-pass work: the weight pass keeps its seconds
            assert 0 < table.wgrad_share[i] < without.wgrad_share[i]
            assert sum(table.bwd_time[i]) * table.wgrad_share[i] == pytest.approx(sum(without.bwd_time[i]) * without.wgrad_share[i])
        else:
            assert (table.fwd_time[i], table.bwd_time[i], table.saved_bytes[i]) == (
                without.fwd_time[i], without.bwd_time[i], without.saved_bytes[i]), name


def test_the_loss_sees_the_models_own_output_structure_from_an_exported_graph_and_is_timed_on_the_cpu():
    model, (tokens, target) = TinyLM(as_dict=True), _data()
    traced = trace(model, (tokens,), {}, method="export", loss=Loss(lm_loss, target))
    captured, micro = traced.at_micro_batch(2)
    output = output_like(captured, micro)
    assert isinstance(output, dict) and output["logits"].shape == (ROWS // 2, SEQ, VOCAB) and output["logits"].is_meta
    measured = cost_loss(traced.loss, output, 2, resolve_devices(["cpu"]), measure=True)
    assert measured.fwd[0] > 0 and measured.bwd[0] > 0


def test_planning_with_the_loss_leaves_the_model_and_target_as_they_were():
    model, (tokens, target) = TinyLM(), _data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    target_before = target.clone()
    plan = autosplit.plan(model, ["cpu"] * 2, example_inputs=(tokens,), micro_batches=2, loss_fn=lm_loss, example_target=target,
                          time_limit=2, seed=0)
    assert plan.step_time > 0
    assert torch.equal(target, target_before)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_a_loss_that_cannot_run_on_the_output_is_refused_by_name():
    model, (tokens, target) = TinyLM(), _data()
    with pytest.raises(ConstraintError, match="loss_fn was given without example_target"):
        autosplit.Planner(model, ["cpu"] * 2, example_inputs=(tokens,), loss_fn=lm_loss)
    with pytest.raises(ConstraintError, match="example_target was given without loss_fn"):
        autosplit.Planner(model, ["cpu"] * 2, example_inputs=(tokens,), example_target=target)
    with pytest.raises(CostModelError, match="not a scalar tensor"):
        autosplit.plan(model, ["cpu"] * 2, example_inputs=(tokens,), micro_batches=2, example_target=target,
                       loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="none"))
    with pytest.raises(CostModelError, match="could not run the loss function"):
        autosplit.plan(model, ["cpu"] * 2, example_inputs=(tokens,), micro_batches=2, loss_fn=lm_loss, example_target=target[:, :3])
