"""``compile=True``: compiled stages train like eager ones; where compilation cannot run, a typed error or
a logged eager fallback that names the stage and the cause."""

from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch._inductor import config as inductor_config

import autosplit
from autosplit import compat
from autosplit.errors import CompileError, ConstraintError
from autosplit.runtime.compiled import CompileOptions, compile_stages
from tests.helpers import NO_SEARCH, gpt_case

ROOT = Path(__file__).resolve().parents[2]
SHAPE = re.compile(r".+\. Likely cause: .+\. Try: .+\.", re.DOTALL)
NO_CXX = (None, "/nonexistent/bin/g++")  # what CXX=/nonexistent/bin/g++ makes of inductor's search at import
PLANNED = {"schedule": "1f1b", "micro_batches": 4, **NO_SEARCH}
"""Every split here and the compiled pipeline below are planned alike, and :func:`_train` steps on one of the
pipeline's micro-batches (:data:`ROWS`): the compiled stages are the same graphs at the same shapes, so inductor
compiles their kernels once in the suite (each a C++ compile of seconds on a fresh cache). The last micro-batch:
the one with a padded row."""
ROWS = slice(6, 8)


def _split(model, compile, **options):
    _, args, kwargs, _, _ = gpt_case()
    return autosplit.autosplit(model, ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, compile=compile, **{**PLANNED, **options})


def _train(split, optimizer, steps: int = 3):
    """Losses and gradients of ``steps`` optimizer steps on the :data:`ROWS` of gpt_case's batch."""
    torch.manual_seed(1)
    _, args, kwargs, target, loss_fn = gpt_case()
    args, kwargs, target = tuple(a[ROWS] for a in args), {k: v[ROWS] for k, v in kwargs.items()}, target[ROWS]
    opt = optimizer(split.parameters())
    record = []
    for _ in range(steps):
        loss = loss_fn(split(*args, **kwargs), target)
        loss.backward()
        record.append((loss.detach(), {n: p.grad.clone() for n, p in split.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return record


def _assert_same_training(a, b, rtol=1e-4, atol=1e-6):
    for (loss_a, grads_a), (loss_b, grads_b) in zip(a, b, strict=True):
        torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=atol)
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("optimizer", [lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.Adam(p, lr=1e-2)],
                         ids=["sgd", "adam"])
def test_an_inductor_compiled_split_trains_like_the_eager_split(optimizer):
    model = gpt_case()[0]
    names = sorted(model.state_dict())
    compiled = _split(copy.deepcopy(model), True)
    eager = _split(copy.deepcopy(model), False, plan=compiled.plan)
    assert compiled.compiled == {0: "compiled", 1: "compiled"} and eager.compiled == {}
    _assert_same_training(_train(compiled, optimizer), _train(eager, optimizer))
    _, args, kwargs, _, _ = gpt_case()
    with torch.no_grad():  # forward only: graphs of their own
        rows = (tuple(a[ROWS] for a in args), {k: v[ROWS] for k, v in kwargs.items()})
        torch.testing.assert_close(compiled(*rows[0], **rows[1]), eager(*rows[0], **rows[1]), rtol=1e-4, atol=1e-6)
    assert compiled.compiled == {0: "compiled", 1: "compiled"}  # no stage fell back on its first call
    # In place: the same names and parameters; only the stage GraphModules call compiled code.
    assert sorted(compiled.state_dict()) == names
    assert all(compat.compiled_call(stage) is not None for stage in compiled.stages)
    assert not any(compat.compiled_call(m) for m in compiled.modules())


def test_the_users_model_is_untouched_and_shares_its_parameters():
    model = gpt_case()[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    split = _split(model, CompileOptions(backend="aot_eager"))
    assert [id(p) for p in split.parameters()] == [id(p) for p in model.parameters()]
    assert not any(compat.compiled_call(m) for m in model.modules())  # model(x) still runs eagerly
    _, args, kwargs, _, _ = gpt_case()
    torch.testing.assert_close(split(*args, **kwargs), model(*args, **kwargs))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_compile_stages_compiles_a_ranks_stages_in_place():
    """The interface distribute uses: the stages one rank holds, by index, compiled where they are."""
    model = gpt_case()[0]
    split, eager = _split(model, False), _split(copy.deepcopy(model), False)
    stage = split.stages[1]
    keys = list(stage.state_dict())
    status = compile_stages({1: stage}, backend="aot_eager")
    assert status == {1: "compiled"} and split.stages[1] is stage and list(stage.state_dict()) == keys
    assert compat.compiled_call(stage) is not None and compat.compiled_call(split.stages[0]) is None
    _, args, kwargs, _, _ = gpt_case()
    torch.testing.assert_close(split(*args, **kwargs), eager(*args, **kwargs))


def test_no_cpp_compiler_is_a_typed_error_before_anything_compiles():
    with inductor_config.patch({"cpp.cxx": NO_CXX}), pytest.raises(CompileError) as e:
        _split(gpt_case()[0], True)
    text = str(e.value)
    assert SHAPE.fullmatch(text), text
    assert "C++ compiler" in text and "/nonexistent/bin/g++" in text and "fallback=True" in text


def test_no_cpp_compiler_with_fallback_logs_each_stage_and_trains_eagerly(caplog):
    model = gpt_case()[0]
    eager = _split(copy.deepcopy(model), False)
    with inductor_config.patch({"cpp.cxx": NO_CXX}), caplog.at_level(logging.WARNING, "autosplit.runtime.compiled"):
        split = _split(model, CompileOptions(fallback=True), plan=eager.plan)
    for s in (0, 1):
        assert split.compiled[s].startswith("eager: inductor needs a C++ compiler")
        assert f"stage {s} runs eagerly: inductor needs a C++ compiler" in caplog.text
    assert not any(compat.compiled_call(stage) for stage in split.stages)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    _assert_same_training(_train(split, sgd), _train(eager, sgd), rtol=0, atol=0)


def test_cxx_pointing_nowhere_is_refused_in_a_fresh_process():
    """The real mechanism: inductor reads $CXX when it is imported."""
    script = textwrap.dedent("""
        import autosplit
        from autosplit.errors import CompileError
        from tests.helpers import gpt_case
        model, args, kwargs, _, _ = gpt_case()
        try:
            autosplit.autosplit(model, ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, time_limit=2, compile=True)
        except CompileError as e:
            print("CompileError:", e)
    """)
    env = {**os.environ, "CXX": "/nonexistent/bin/g++"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert "CompileError: compile=True: the 2 stage(s) [0, 1] cannot be compiled" in out.stdout, out.stdout + out.stderr
    assert "/nonexistent/bin/g++" in out.stdout


def _refuses_embedding(gm: torch.fx.GraphModule, example_inputs):
    """A backend that refuses one op, as inductor or a vendor backend may (only the GPT's first stage has it)."""
    for node in gm.graph.nodes:
        if "embedding" in str(node.target):
            raise NotImplementedError("this backend has no kernel for embedding")
    return gm.forward


def test_an_op_the_backend_refuses_is_a_typed_error_at_the_stages_first_call():
    split = _split(gpt_case()[0], CompileOptions(backend=_refuses_embedding))
    _, args, kwargs, _, _ = gpt_case()
    with pytest.raises(CompileError) as e:
        split(*args, **kwargs)
    text = str(e.value)
    assert SHAPE.fullmatch(text), text
    assert "stage 0 could not be compiled" in text and "no kernel for embedding" in text and "fallback=True" in text


def test_an_op_the_backend_refuses_falls_back_to_eager_for_that_stage_only(caplog):
    model = gpt_case()[0]
    eager = _split(copy.deepcopy(model), False)
    split = _split(model, CompileOptions(backend=_refuses_embedding, fallback=True), plan=eager.plan)
    with caplog.at_level(logging.WARNING, "autosplit.runtime.compiled"):
        record = _train(split, lambda p: torch.optim.Adam(p, lr=1e-2))
    assert split.compiled[0].startswith("eager: NotImplementedError: this backend has no kernel for embedding")
    assert split.compiled[1] == "compiled"
    assert "stage 0 runs eagerly" in caplog.text and "no kernel for embedding" in caplog.text
    assert "stage 1 runs eagerly" not in caplog.text
    _assert_same_training(record, _train(eager, lambda p: torch.optim.Adam(p, lr=1e-2)))


def test_bad_compile_values_are_refused():
    with pytest.raises(ConstraintError, match="compile='yes'"):
        _split(gpt_case()[0], "yes")
    with pytest.raises(CompileError, match="no backend 'no-such-backend'"):
        _split(gpt_case()[0], CompileOptions(backend="no-such-backend"))


def test_a_makespan_plan_refuses_compile():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ConstraintError, match="makespan"):
        autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(torch.randn(4, 4),), objective="makespan", time_limit=2,
                            compile=True)


def test_the_models_own_error_is_raised_as_itself_not_as_a_compile_error():
    """Dynamo reports a wrong input wrapped in its own error; the stage's eager rerun shows it is the model's."""
    split = _split(gpt_case()[0], CompileOptions(backend="aot_eager"))
    _, args, kwargs, _, _ = gpt_case()
    with pytest.raises(RuntimeError, match="indices") as e:
        split(args[0].float(), **kwargs)  # token ids as floats: the embedding refuses them
    assert not isinstance(e.value, (CompileError, compat.dynamo_error()))  # eager's own error
    assert split.compiled == {0: "compiled", 1: "compiled"} and compat.compiled_call(split.stages[0]) is not None
    split(*args, **kwargs)  # and the right input still runs compiled


def _pipeline_case(rank: int, world: int) -> None:
    """Two pipelines of one model on the same plan, eager and compiled: the same losses, gradients,
    forward-only outputs; the compiled one reports its stage compiled."""
    from tests.helpers import where

    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()
    eager = autosplit.distribute(copy.deepcopy(model), ["cpu"] * world, example_inputs=args, example_kwargs=kwargs,
                                 loss_fn=loss_fn, **PLANNED)
    compiled = autosplit.distribute(copy.deepcopy(model), None, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn,
                                    plan=eager.plan, compile=True)
    assert compiled.compiled == dict.fromkeys(compiled.layout.held, "compiled") and eager.compiled == {}
    for step in range(2):
        losses = [pipe.step(*args, target=target, **kwargs) for pipe in (eager, compiled)]
        if eager.is_last:
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5, msg=where(f"step {step} loss"))
        grads = dict(eager.named_parameters())
        for name, p in compiled.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=where(f"step {step} grad {name}"))
        for pipe in (eager, compiled):
            for p in pipe.parameters():
                p.grad = None
    outputs = [pipe(*args, **kwargs) for pipe in (eager, compiled)]
    if eager.is_last:
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5, msg=where("forward-only output"))


def test_a_compiled_pipeline_trains_like_the_eager_one_on_two_processes(gloo):
    gloo(2).run(_pipeline_case, [()])
