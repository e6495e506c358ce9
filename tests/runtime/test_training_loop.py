"""The training loop around ``step``, on gloo processes, against the unsplit model in float64.

What users do between steps: accumulate gradients over several ``step`` calls before the
optimizer, clip by the whole model's norm, evaluate (forward only, ``eval()`` mode) and go back
to training. Every case runs the pipeline and, beside it in the same process, the unsplit model on
the same batches; gradients, norms, losses and outputs must agree.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import NO_SEARCH, as_float64, full_tensor, gpt_case, where

SCHEDULES = {  # schedule → stages per rank
    "gpipe": 1, "1f1b": 1, "interleaved1f1b": 2, "loopedbfs": 2, "interleavedzerobubble": 2, "zbvzerobubble": 2,
    "dualpipev": 2,
}


class DropoutNet(nn.Module):
    """An MLP with dropout: eval mode must switch it off."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.drop(torch.tanh(self.b(self.drop(torch.tanh(self.a(x)))))))


def _dropout_case():
    x = torch.randn(8, 6)
    return DropoutNet(), (x,), {}, torch.randint(0, 3, (8,)), F.cross_entropy


def _setup(name: str, rank: int, dp: int):
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = {"gpt": gpt_case, "dropout": _dropout_case}[name]()
    model = model.double()
    args, kwargs = tuple(as_float64(a) for a in args), {k: as_float64(v) for k, v in kwargs.items()}
    rows = args[0].shape[0] // dp
    mine = slice((rank % dp) * rows, (rank % dp + 1) * rows)
    return model, args, kwargs, target, loss_fn, mine


def _pipe(model, args, kwargs, loss_fn, mine, *, world: int, dp: int, schedule: str, **options):
    import autosplit

    options = {"stages_per_rank": SCHEDULES.get(schedule), "micro_batches": 4 // dp, **NO_SEARCH, **options}
    return autosplit.distribute(
        model, ["cpu"] * world, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn, data_parallel=dp,
        schedule=schedule, **options,
    )


def _batches(args, kwargs, target, count: int):
    """``count`` batches of the example's shape, each other data."""
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(100 + i)
        perm = torch.randperm(args[0].shape[0], generator=g)
        out.append((tuple(a[perm] for a in args), {k: v[perm] for k, v in kwargs.items()}, target[perm]))
    return out


def _grads_equal(pipe, reference, label: str) -> None:
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p.grad), ref[name].grad, msg=where(f"{label} grad {name}"))


def _accumulate_and_clip(schedule: str, dp: int, precision: str, replicate: str = "replicate", *, rank: int, world: int) -> None:
    """Two steps, then clipping by the global norm, then the optimizer, twice over: the unsplit model
    runs two ``backward()`` calls and torch's ``clip_grad_norm_``."""
    model, args, kwargs, target, loss_fn, mine = _setup("gpt", rank, dp)
    reference = copy.deepcopy(model)
    pipe = _pipe(model, args, kwargs, loss_fn, mine, world=world, dp=dp, schedule=schedule, precision=precision,
                 replicate=replicate)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    label = f"{schedule} dp {dp} ({replicate}) {precision} rank {rank}"
    batches = _batches(args, kwargs, target, 4)
    for round, norm_type in enumerate((2.0, math.inf)):
        for a, k, t in batches[2 * round: 2 * round + 2]:
            pipe.step(*(x[mine] for x in a), target=t[mine], **{n: v[mine] for n, v in k.items()})
            loss_fn(reference(*a, **k), t).backward()
        # fp16-mixed: autocast leaves float64 ops as they are, so only the loss scaling differs.
        _grads_equal(pipe, reference, f"{label} accumulated over 2 steps, round {round}")
        norm = pipe.clip_grad_norm_(0.05, norm_type=norm_type)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type=norm_type)
        torch.testing.assert_close(norm, expected, msg=where(f"{label} norm {norm_type}"))
        _grads_equal(pipe, reference, f"{label} clipped ({norm_type})")
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p), ref[name], msg=where(f"{label} {name} after 2 optimizer steps"))


def _forward_only(schedule: str, dp: int, *, rank: int, world: int) -> None:
    """``pipe(...)`` and ``eval_step`` equal the unsplit model's output and loss, touch no gradient,
    and leave training as it was; accumulated gradients survive them."""
    model, args, kwargs, target, loss_fn, mine = _setup("gpt", rank, dp)
    reference = copy.deepcopy(model)
    pipe = _pipe(model, args, kwargs, loss_fn, mine, world=world, dp=dp, schedule=schedule)
    my_args, my_kwargs = tuple(a[mine] for a in args), {k: v[mine] for k, v in kwargs.items()}
    label = f"{schedule} dp {dp} rank {rank}"
    pipe.step(*my_args, target=target[mine], **my_kwargs)
    loss_fn(reference(*args, **kwargs), target).backward()
    before = {name: full_tensor(p.grad).clone() for name, p in pipe.named_parameters()}
    with torch.no_grad():
        expected_out = reference(*my_args, **my_kwargs)
        expected_loss = loss_fn(reference(*my_args, **my_kwargs), target[mine])
    for mode in ("train", "eval"):
        getattr(pipe, mode)()
        out = pipe(*my_args, **my_kwargs)
        loss = pipe.eval_step(*my_args, target=target[mine], **my_kwargs)
        assert (out is None) == (loss is None) == (not pipe.is_last), where(label)
        if pipe.is_last:
            assert type(out) is type(expected_out) and not out.requires_grad
            torch.testing.assert_close(out, expected_out, msg=where(f"{label} {mode} output"))
            torch.testing.assert_close(loss, expected_loss, msg=where(f"{label} {mode} eval loss"))
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(full_tensor(p.grad), before[name], msg=where(f"{label} {mode} left grad {name}"))
    half = slice(0, my_args[0].shape[0] // 2)  # a batch of other rows, as step() takes it
    loss = pipe.eval_step(*(a[half] for a in my_args), target=target[mine][half], **{k: v[half] for k, v in my_kwargs.items()})
    if pipe.is_last:
        with torch.no_grad():
            expected = loss_fn(reference(*(a[half] for a in my_args), **{k: v[half] for k, v in my_kwargs.items()}),
                               target[mine][half])
        torch.testing.assert_close(loss, expected, msg=where(f"{label} eval loss of half a batch"))
    pipe.train()
    pipe.step(*my_args, target=target[mine], **my_kwargs)  # training after evaluation: still accumulates
    loss_fn(reference(*args, **kwargs), target).backward()
    _grads_equal(pipe, reference, f"{label} a step after evaluating")


def _modes(*, rank: int, world: int) -> None:
    """``train()``/``eval()`` return the pipeline and switch dropout on every stage of the rank: the
    eval loss equals ``model.eval()``'s; in train mode dropout is on."""
    model, args, kwargs, target, loss_fn, mine = _setup("dropout", rank, 1)
    reference = copy.deepcopy(model).eval()
    pipe = _pipe(model, args, kwargs, loss_fn, mine, world=world, dp=1, schedule="1f1b")
    assert pipe.training and pipe.eval() is pipe and not pipe.training
    assert not any(m.training for stage in pipe.stage_modules.values() for m in stage.modules())
    loss = pipe.eval_step(*args, target=target)
    with torch.no_grad():
        expected = loss_fn(reference(*args), target)
        expected_out = reference(*args)
    if pipe.is_last:
        torch.testing.assert_close(loss, expected, msg=where("eval loss with dropout off"))
    assert pipe.train() is pipe and pipe.training
    assert all(m.training for stage in pipe.stage_modules.values() for m in stage.modules())
    out = pipe(*args)
    if pipe.is_last:
        assert not torch.allclose(out, expected_out), "dropout is on in train mode"
    model.eval()  # the user's model: its mode is the pipeline's business only through the pipeline
    assert pipe.train(False) is pipe and not pipe.training


def _asynchronous(*, rank: int, world: int) -> None:
    """An asynchronous pipeline evaluates between its runs: the output and loss of the weights it has
    then (the unsplit model given its full state dict), and runs on afterwards."""
    model, args, kwargs, target, loss_fn, mine = _setup("gpt", rank, 1)
    pipe = _pipe(model, args, kwargs, loss_fn, mine, world=world, dp=1, schedule="xpipe", stages_per_rank=1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    batches = [((a[0],), k, t) for a, k, t in _batches(args, kwargs, target, 2)]
    pipe.run(batches, optimizer=opt)
    reference = copy.deepcopy(model)
    reference.load_state_dict(pipe.full_state_dict())
    with torch.no_grad():
        expected_out = reference(*args, **kwargs)
        expected_loss = loss_fn(expected_out, target)
    out, loss = pipe(*args, **kwargs), pipe.eval_step(*args, target=target, **kwargs)
    if pipe.is_last:
        torch.testing.assert_close(out, expected_out, msg=where("xpipe output between runs"))
        torch.testing.assert_close(loss, expected_loss, msg=where("xpipe eval loss between runs"))
    assert len(pipe.run(batches, optimizer=opt)) == 2


def _fixed_mode(*, rank: int, world: int) -> None:
    """A graph that torch.export captured with dropout as an ATen op cannot leave training mode: eval()
    refuses on every rank, naming the node, rather than evaluate with dropout on."""
    from autosplit.errors import DistributedError

    model, args, kwargs, _, loss_fn, mine = _setup("dropout", rank, 1)
    pipe = _pipe(model, args, kwargs, loss_fn, mine, world=world, dp=1, schedule="gpipe", capture="export")
    with pytest.raises(DistributedError, match=r"cannot switch to evaluation mode.*dropout"):
        pipe.eval()
    assert pipe.training and pipe.train() is pipe


def _run_case(kind: str, *case, rank: int, world: int) -> None:
    cases: dict[str, Callable[..., None]] = {
        "accumulate": _accumulate_and_clip, "forward": _forward_only, "modes": _modes, "async": _asynchronous, "fixed": _fixed_mode,
    }
    cases[kind](*case, rank=rank, world=world)


def test_two_processes_accumulate_clip_and_evaluate_like_the_unsplit_model(gloo):
    cases = [("accumulate", schedule, 1, "fp32") for schedule in SCHEDULES]
    cases += [("accumulate", "1f1b", 1, "fp16-mixed")]
    cases += [("forward", schedule, 1) for schedule in ("gpipe", "1f1b", "interleaved1f1b", "zbvzerobubble")]
    cases += [("modes",), ("async",), ("fixed",)]
    gloo(2).run(_run_case, cases)


def test_two_stages_by_two_replicas_accumulate_clip_and_evaluate(gloo):
    cases = [("accumulate", "1f1b", 2, "fp32", replicate) for replicate in ("replicate", "fully_shard")]
    gloo(4).run(_run_case, [*cases, ("forward", "gpipe", 2)])


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_clip_refuses_a_norm_type_that_is_not_a_norm(bad):
    from autosplit.errors import DistributedError
    from autosplit.runtime.gradients import global_grad_norm

    with pytest.raises(DistributedError, match="norm_type"):
        global_grad_norm([torch.ones(3)], norm_type=bad, device=torch.device("cpu"))


def test_a_split_module_accumulates_clips_and_evaluates_with_torch_own_functions():
    """One process: ``SplitModule`` holds the model's own parameters, so two backward() calls,
    ``torch.nn.utils.clip_grad_norm_`` and ``eval()`` are the unsplit model's."""
    import autosplit

    model, args, kwargs, target, loss_fn, _ = _setup("gpt", 0, 1)
    reference = copy.deepcopy(model)
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, **NO_SEARCH)
    for a, k, t in _batches(args, kwargs, target, 2):
        loss_fn(split(*a, **k), t).backward()
        loss_fn(reference(*a, **k), t).backward()
    for norm_type in (2.0, math.inf):
        norm = torch.nn.utils.clip_grad_norm_(split.parameters(), 0.05, norm_type=norm_type)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type=norm_type))
    _grads_equal(split, reference, "split module")
    assert split.eval() is split and not split.training
    with torch.no_grad():
        torch.testing.assert_close(split(*args, **kwargs), reference.eval()(*args, **kwargs))


def test_clip_refuses_a_norm_that_is_not_finite_when_asked():
    from autosplit.errors import DistributedError
    from autosplit.runtime.gradients import clip_by_global_norm, global_grad_norm

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    total = global_grad_norm([p.grad], norm_type=2.0, device=torch.device("cpu"))
    with pytest.raises(DistributedError, match="total norm of the model's gradients is inf"):
        clip_by_global_norm([p], total, max_norm=1.0, error_if_nonfinite=True)
    clip_by_global_norm([p], total, max_norm=1.0, error_if_nonfinite=False)  # torch's behaviour: scaled by 0
    assert p.grad.tolist()[0] == 0.0


def test_only_ops_a_capture_fixed_to_a_mode_stop_a_mode_switch():
    """Dropout with p > 0 and batch norm with running statistics, as torch.export writes them, fix the
    training mode; batch norm without running statistics and instance norm do not (they normalise by the
    batch in either mode), nor does a module left as a call (symbolic tracing)."""
    from autosplit.passes.capture import capture
    from autosplit.runtime.loop import mode_fixed_nodes

    x = torch.randn(4, 3, 5, 5)
    fixed = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Dropout(0.3))
    free = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, track_running_stats=False), nn.InstanceNorm2d(4), nn.Dropout(0.0))
    exported = capture(fixed, (x,), {}, method="export").gm
    found = mode_fixed_nodes(exported, training=False)
    assert len(found) == 2 and any("batch_norm" in f for f in found) and any("dropout" in f for f in found), found
    assert mode_fixed_nodes(exported, training=True) == []
    assert mode_fixed_nodes(capture(free, (x,), {}, method="export").gm, training=False) == []
    assert mode_fixed_nodes(capture(fixed, (x,), {}, method="symbolic_trace").gm, training=False) == []
