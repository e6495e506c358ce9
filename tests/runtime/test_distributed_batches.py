"""The distributed runtime on batches of other sizes than the planned one, and state dicts that
hold the whole model (gloo, 2 processes, float64, seeded).

A data loader's last batch has fewer rows: the stages rebuild their static metadata for its
micro-batch shape and train exactly as the unsplit model does on the same batches. Ranks given
different batches, or a batch no stage can run, raise a typed error on every rank before any
stage computes — never a loss from receive buffers of another shape, never a hang. A parameter
``forward`` never reads is still in the pipeline's state dicts and parameters.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import NO_SEARCH, where

TIMEOUT = 60
ROWS, MICRO, SEQ, VOCAB = 8, 2, 8, 40


def _gpt():
    from autosplit.examples import GPT

    torch.manual_seed(0)
    return GPT(vocab=VOCAB, d_model=16, n_layers=2, n_heads=2, max_len=SEQ).double()


def _batch(rows: int, seed: int, seq: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, seq), generator=g)
    mask = torch.ones_like(tokens)
    mask[-1, -3:] = 0
    return tokens, mask, torch.randint(0, VOCAB, (rows, seq), generator=g)


def _loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


class ExampleCode(nn.Module):
    """torch's pipelining test model (test/distributed/pipelining/model_registry.py), with
    ``mm_param2``, a parameter ``forward`` never reads."""

    def __init__(self, d_hid: int):
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(d_hid, d_hid))
        self.mm_param1 = nn.Parameter(torch.randn(d_hid, d_hid))
        self.mm_param2 = nn.Parameter(torch.randn(d_hid, d_hid))
        self.cval = nn.Buffer(torch.randn((d_hid,), requires_grad=False))
        self.lin0 = nn.Linear(d_hid, d_hid)
        self.lin1 = nn.Linear(d_hid, d_hid)

    def forward(self, x):
        x = torch.mm(x, self.mm_param0)
        x = torch.relu(x)
        a_constant = self.cval.clone()  # a value that needs no gradient, crossing the stages
        x = self.lin0(x)
        x = torch.relu(x) + a_constant
        x = torch.mm(x, self.mm_param1)
        x = self.lin1(x)
        return torch.relu(x)


def _reference_step(model, opt, tokens, mask, target) -> torch.Tensor:
    loss = _loss(model(tokens, attention_mask=mask), target)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _same_parameters(pipe, reference, what: str) -> None:
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref[name], msg=where(f"{what}: {name}"))


# -- batches of other sizes train as the unsplit model does --------------------------------------------


def _sizes_case(*, rank: int, world: int) -> None:
    import autosplit

    for schedule in ("gpipe", "1f1b"):
        model = _gpt()
        reference = copy.deepcopy(model)
        tokens, mask, target = _batch(ROWS, 0)
        pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(tokens,), example_kwargs={"attention_mask": mask},
                                    loss_fn=_loss, schedule=schedule, micro_batches=MICRO, **NO_SEARCH)
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
        ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
        # A planned batch, two partial ones that divide into M = 2, a repeat (cached), and
        # on GPipe a batch of 5 rows, which only M' = 1 divides (1F1B needs M' ≥ 2 stages).
        sizes = [8, 6, 4, 6] + ([5] if schedule == "gpipe" else [])
        for step, rows in enumerate(sizes):
            tokens, mask, target = _batch(rows, step + 1)
            loss = pipe.step(tokens, attention_mask=mask, target=target)
            opt.step()
            opt.zero_grad()
            expected = _reference_step(reference, ref_opt, tokens, mask, target)
            if pipe.is_last:
                torch.testing.assert_close(loss, expected, msg=where(f"{schedule} step {step} loss"))
            _same_parameters(pipe, reference, f"{schedule} after step {step} ({rows} rows)")
            if step == 1:
                six = pipe._runs[6, "train"]
        assert pipe._runs[6, "train"] is six, "the repeated size reuses its stage and schedule"
        micro = {rows: run.micro_batches for (rows, kind), run in pipe._runs.items() if kind == "train"}
        assert micro == ({8: 2, 6: 2, 4: 2, 5: 1} if schedule == "gpipe" else {8: 2, 6: 2, 4: 2}), micro
        if schedule == "1f1b":
            # 5 rows: no count from 2 (stages) to 2 (M) divides it. Refused on every rank before compute.
            tokens, mask, target = _batch(5, 9)
            refused = r"a batch of 5 rows cannot run .* no micro-batch count from 2 to 2 divides 5"
            with pytest.raises(autosplit.errors.DistributedError, match=refused):
                pipe.step(tokens, attention_mask=mask, target=target)
            assert all(p.grad is None for p in pipe.parameters())
            _same_parameters(pipe, reference, "after the refused batch")
        dist.barrier()

    # A stage code that fixes the rows (torch.export bakes them into view sizes): a batch of
    # other micro-batch rows is refused, one whose micro-batches keep the planned rows runs.
    model = _gpt()
    reference = copy.deepcopy(model)
    tokens, mask, target = _batch(ROWS, 0)
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(tokens,), example_kwargs={"attention_mask": mask},
                                loss_fn=_loss, micro_batches=MICRO, **NO_SEARCH, capture="export")
    sgd = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    tokens, mask, target = _batch(6, 1)
    with pytest.raises(autosplit.errors.DistributedError, match=r"a batch of 6 rows cannot run .*code fixes the micro-batch rows"):
        pipe.step(tokens, attention_mask=mask, target=target)
    _same_parameters(pipe, reference, "export, after the refused batch")
    tokens, mask, target = _batch(4, 2)  # one micro-batch of the planned 4 rows
    loss = pipe.step(tokens, attention_mask=mask, target=target)
    sgd.step()
    sgd.zero_grad()
    expected = _reference_step(reference, ref_sgd, tokens, mask, target)
    if pipe.is_last:
        torch.testing.assert_close(loss, expected)
    _same_parameters(pipe, reference, "export, after 4 rows in one micro-batch")
    assert pipe._runs[4, "train"].micro_batches == 1


def test_batches_of_other_sizes_train_as_the_unsplit_model(gloo):
    gloo(2, timeout=TIMEOUT).run(_sizes_case, [()])


# -- ranks that disagree: a typed error on every rank, before any compute -------------------------------


def _disagree_case(*, rank: int, world: int) -> None:
    import autosplit
    from autosplit.errors import DistributedError

    model = _gpt()
    reference = copy.deepcopy(model)
    tokens, mask, target = _batch(4, 0)
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(tokens,), example_kwargs={"attention_mask": mask},
                                loss_fn=_loss, micro_batches=MICRO, **NO_SEARCH)
    before = {name: p.detach().clone() for name, p in pipe.named_parameters()}
    start = time.monotonic()
    rows = 4 if rank == 0 else 2  # a DataLoader whose last batch reached one rank only
    tokens, mask, target = _batch(rows, 1)
    with pytest.raises(DistributedError, match=r"different sizes: rank 0: 4 rows, rank 1: 2 rows"):
        pipe.step(tokens, attention_mask=mask, target=target)
    seq = SEQ if rank == 0 else SEQ - 2
    tokens, mask, target = _batch(4, 2, seq=seq)
    with pytest.raises(DistributedError, match=r"ranks \[1\] were given inputs of other shapes"):
        pipe.step(tokens, attention_mask=mask, target=target)
    tokens, mask, target = _batch(4, 3, seq=SEQ - 2)  # all ranks agree, on a shape the stages do not run
    with pytest.raises(DistributedError, match=r"input 'idx' is int64 \[4, 6\] where .* has int64 \[4, 8\]"):
        pipe.step(tokens, attention_mask=mask, target=target)
    tokens, mask, target = _batch(4, 4)
    with pytest.raises(DistributedError, match=r"needs a target with the batch's 4 rows .* rank 1: none"):
        pipe.step(tokens, attention_mask=mask, target=None)
    with pytest.raises(DistributedError, match=r"needs a target with the batch's 4 rows .* rank 1: 2 rows"):
        pipe.step(tokens, attention_mask=mask, target=target[:2])
    assert time.monotonic() - start < TIMEOUT / 2, "an error waited for the process group's timeout"
    for name, p in pipe.named_parameters():
        assert p.grad is None, name
        torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)
    # Nothing ran, so the pipeline is still usable, and trains as the unsplit model.
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss = pipe.step(tokens, attention_mask=mask, target=target)
    opt.step()
    expected = _reference_step(reference, ref_opt, tokens, mask, target)
    if pipe.is_last:
        torch.testing.assert_close(loss, expected)
    _same_parameters(pipe, reference, "after the refusals")

    # The asynchronous path takes every mini-batch at the example's shape, and refuses others.
    mlp = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    async_pipe = autosplit.distribute(mlp, ["cpu"] * 2, example_inputs=(x,), loss_fn=F.mse_loss, schedule="pipedream",
                                      micro_batches=MICRO, **NO_SEARCH)
    before = {name: p.detach().clone() for name, p in async_pipe.named_parameters()}
    with pytest.raises(DistributedError, match=r"mini-batch 1 of 2 has inputs .*\[6, 6\].* where the example has .*\[8, 6\]"):
        async_pipe.run([(x, y), (x[:6], y[:6])], optimizer=torch.optim.SGD(async_pipe.parameters(), lr=0.1))
    for name, p in async_pipe.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)


def test_ranks_that_disagree_on_the_batch_fail_together_before_any_compute(gloo):
    gloo(2, timeout=TIMEOUT).run(_disagree_case, [()])


# -- the whole model's state, unused parameters included ------------------------------------------------


def _state_case(*, rank: int, world: int) -> None:
    import autosplit

    torch.manual_seed(0)
    model = ExampleCode(8).double()
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, 8, dtype=torch.float64)
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(x,), loss_fn=F.mse_loss, micro_batches=MICRO,
                                **NO_SEARCH)
    own = pipe.state_dict()
    assert ("mm_param2" in own) == (pipe.stage_index == 0), sorted(own)
    names = [name for name, _ in pipe.named_parameters()]
    assert names == [n for n, _ in reference.named_parameters() if n in names], "the model's order"
    assert ("mm_param2" in names) == (pipe.stage_index == 0)
    everything: list[list[str]] = [[], []]
    dist.all_gather_object(everything, [*own])
    assert sorted(key for part in everything for key in part) == sorted(reference.state_dict())

    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for step, rows in enumerate([8, 8, 6]):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(rows, 8, generator=g, dtype=torch.float64), torch.randn(rows, 8, generator=g, dtype=torch.float64)
        loss = pipe.step(x, target=y)
        opt.step()
        opt.zero_grad()
        expected = F.mse_loss(reference(x), y)
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if pipe.is_last:
            torch.testing.assert_close(loss, expected.detach(), msg=f"step {step}")

    full = pipe.full_state_dict()
    assert list(full) == list(reference.state_dict()) or set(full) == set(reference.state_dict())
    fresh = ExampleCode(8).double()
    fresh.load_state_dict(full, strict=True)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key], value, msg=key)

    # A whole model's state dict loads into the stages, the unused parameter included.
    torch.manual_seed(1)
    other = ExampleCode(8).double()
    pipe.load_state_dict(other.state_dict())
    for key, value in pipe.full_state_dict().items():
        torch.testing.assert_close(value, other.state_dict()[key], msg=key)


def test_state_dicts_hold_parameters_forward_never_reads(gloo):
    gloo(2, timeout=TIMEOUT).run(_state_case, [()])


# -- replicas: gradients accumulated over steps survive a new batch size --------------------------------


def _replicas_case(*, rank: int, world: int) -> None:
    import autosplit

    for replicate in ("fully_shard", "replicate"):
        # One stage, two replicas (each its half of the rows). torch's pipelining clears FSDP2
        # gradients when a schedule first prepares its stage; the runtime adds them back.
        model = _gpt()
        reference = copy.deepcopy(model)
        tokens, mask, _ = _batch(ROWS, 0)
        pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(tokens,), example_kwargs={"attention_mask": mask},
                                    loss_fn=_loss, micro_batches=MICRO, data_parallel=2, replicate=replicate, **NO_SEARCH)
        for step, rows in enumerate([8, 4]):  # no zero_grad between: the gradients accumulate
            tokens, mask, target = _batch(rows, step + 1)
            half = slice(rank * rows // 2, (rank + 1) * rows // 2)
            pipe.step(tokens[half], attention_mask=mask[half], target=target[half])
            _loss(reference(tokens, attention_mask=mask), target).backward()
        ref = dict(reference.named_parameters())
        for name, p in pipe.named_parameters():
            assert p.grad is not None, name
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, ref[name].grad, msg=where(f"{replicate} {name}"))
        dist.barrier()


def test_gradients_accumulated_on_replicas_survive_a_new_batch_size(gloo):
    gloo(2, timeout=TIMEOUT).run(_replicas_case, [()])
