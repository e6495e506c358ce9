"""torch's multi-stage schedules through ``distribute``: two stages per rank (a loop or a V), float64,
three Adam steps, against the unsplit model trained in one process — losses, gradients and parameters."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F

from autosplit.errors import DistributedError
from autosplit.runtime.stage import EarlyReceivingStage, message_tag
from tests.helpers import NO_SEARCH, as_float64, full_tensor, gpt_case, padding_mask, reference_step, where

STEPS = 3
MULTI = ["interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev"]


def _llama():
    """A transformers Llama (rotary tables as non-persistent buffers, RMSNorm, SwiGLU, grouped-query attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=60, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, attention_dropout=0.0, use_cache=False,
    )
    cfg._attn_implementation = "eager"
    ids = torch.randint(0, 60, (8, 8))
    return LlamaForCausalLM(cfg), (ids,), {"attention_mask": padding_mask(8, 8)}, torch.randint(0, 60, (8, 8)), (
        lambda out, t: F.cross_entropy(out["logits"].flatten(0, 1), t.flatten()))


MODELS = {"gpt": gpt_case, "llama": _llama}


def _run_case(name: str, schedule: str, dp: int, micro: int, v: int, rank: int, world: int) -> None:
    import autosplit

    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = MODELS[name]()
    model = model.double()
    args, kwargs = tuple(as_float64(a) for a in args), {k: as_float64(v) for k, v in kwargs.items()}
    reference = copy.deepcopy(model)
    replica, rows = rank % dp, args[0].shape[0] // dp
    mine = slice(replica * rows, (replica + 1) * rows)
    my_args, my_kwargs = tuple(a[mine] for a in args), {k: v[mine] for k, v in kwargs.items()}
    pipe = autosplit.distribute(
        model, ["cpu"] * world, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn,
        data_parallel=dp, schedule=schedule, stages_per_rank=v, micro_batches=micro, **NO_SEARCH,
    )
    assert pipe.plan.stages_per_rank == v and len(pipe.layout.held) == v
    # On gloo every stage posts its step's receives at the start, matched by tag (several streams per neighbour).
    assert all(isinstance(st, EarlyReceivingStage) for st in pipe._stages), where(f"{name} {schedule}")
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    for step in range(STEPS):
        loss = pipe.step(*my_args, target=target[mine], **my_kwargs)
        expected = reference_step(reference, args, kwargs, target, loss_fn, chunks=1)
        if pipe.is_last and dp == 1:
            torch.testing.assert_close(loss, expected, msg=where(f"{name} {schedule} step {step} loss"))
        assert (loss is None) == (not pipe.is_last)
        for pname, p in pipe.named_parameters():
            torch.testing.assert_close(
                full_tensor(p.grad), ref_params[pname].grad, msg=where(f"{name} {schedule} rank {rank} step {step} grad {pname}")
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for pname, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p), ref_params[pname], msg=where(f"{name} {schedule} {pname} after {STEPS} steps"))


@pytest.mark.parametrize("schedule", MULTI)
def test_two_stages_per_rank_train_like_the_unsplit_model(gloo, schedule):
    pytest.importorskip("transformers")
    gloo(2).run(_run_case, [(name, schedule, 1, 4, 2) for name in MODELS])


@pytest.mark.smoke  # the fast tier's case of this runtime path
def test_one_stage_per_rank_on_the_multi_stage_classes_trains_like_the_unsplit_model(gloo):
    gloo(2).run(_run_case, [("gpt", schedule, 1, 4, 1) for schedule in ("interleaved1f1b", "interleavedzerobubble")])


def test_interleaved_with_data_parallelism_trains_like_the_unsplit_model(gloo):
    gloo(4).run(_run_case, [("gpt", "interleaved1f1b", 2, 2, 2)])


def _trace_case(schedule: str, v: int, micro: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    import autosplit
    from autosplit import schedules
    from autosplit.solver.replay import measured_durations, replay

    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    pipe = autosplit.distribute(model, ["cpu"] * world, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn,
                                schedule=schedule, stages_per_rank=v, micro_batches=micro, **NO_SEARCH)
    pipe.step(*args, target=target, **kwargs)
    dist.barrier()
    start = time.perf_counter()
    with pipe.tracing() as spans:
        pipe.step(*args, target=target, **kwargs)
    pipe.step(*args, target=target, **kwargs)  # outside the context: nothing more recorded
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (start, list(spans)))
    entry = schedules.lookup(schedule)
    actions = entry.actions(world, micro, v)
    for r, (_, mine) in enumerate(gathered):
        ran = [(k, s, m) for k, s, m, *_ in mine if k != "L"]
        assert [(a.kind, a.stage, a.micro) for a in actions[r]] == ran, where(f"{schedule} rank {r}")
        losses = [(s, m) for k, s, m, *_ in mine if k == "L"]
        holds_last = entry.rank_of(world * v - 1, world * v, world) == r
        assert losses == ([(world * v - 1, m) for m in range(micro)] if holds_last else [])
        assert all(e >= s for *_, s, e in mine)
    if entry.split_backward:  # torch's first stage runs its whole backward in W (what the cost model charges it)
        first = {k: sum(e - s for kind, stage, _, s, e in (x for _, mine in gathered for x in mine) if (kind, stage) == (k, 0))
                 for k in "IW"}
        assert first["I"] < 0.5 * first["W"], where(f"{schedule}: the first stage's I {first['I']} s, W {first['W']} s")
    # Every action starts after its rank's last one and its inputs ended: replaying the measured
    # durations with free transfers can only end sooner than the step did.
    every = [x for _, mine in gathered for x in mine]
    seconds = measured_durations(every)
    rank_of = [entry.rank_of(s, world * v, world) for s in range(world * v)]
    replayed = replay(actions, rank_of=rank_of, durations=seconds).step
    measured = max(e for *_, e in every) - min(s for s, _ in gathered)
    assert 0 < replayed <= measured + 1e-6, where(f"{schedule}: replayed {replayed} > measured {measured}")


def test_tracing_records_each_action_as_the_schedule_orders_it(gloo):
    """``DistributedModel.tracing()``: every rank's spans follow its schedule's action list, the loss once per
    micro-batch on the last stage's rank, and the replay of their durations is a lower bound on the step."""
    gloo(2).run(_trace_case, [("1f1b", 1, 4), ("zbvzerobubble", 2, 4)])


def test_message_tags_are_unique_and_fit_in_31_bits():
    """Every message of a step (receiving stage, direction, micro-batch, place) has a tag of its own."""
    corners = [(st, kind, mb, i) for st in (0, 1, 2, 255) for kind in ("forward", "backward")
               for mb in (0, 1, 4095) for i in (0, 1, 1023)]
    tags = [message_tag(*c) for c in corners]
    assert len(set(tags)) == len(tags)
    assert 0 <= min(tags) and max(tags) < 2**31
    with pytest.raises(DistributedError, match="4096 micro-batches"):
        message_tag(0, "forward", 4096, 0)
