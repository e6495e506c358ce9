"""The tensor-parallel training cases of ``tests/runtime/test_tensor_parallel.py`` and
``tests/runtime/test_tensor_parallel_meshes.py``: fixed plans of a GPT and a small transformers Llama with
``tensor_parallel`` and ``tp_shards`` set by hand (or the planner's own), and one rank's training of
such a plan against the unsplit model on the global batch, in float64.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

import autosplit
from autosplit.runtime.placement import MESH_DIMS
from autosplit.runtime.tensor_parallel import tp_scope
from tests.helpers import NO_SEARCH, gpt_case, where
from tests.layouts import ROWS, Comparison, llama_case, train_alike

__all__ = ["CASES", "MICRO", "STEPS", "distribute", "fixed_plan", "float64_throughout", "forward_held", "planned", "recomputing",
           "RECOMPUTING", "sequence_parallel", "shards", "train_case"]

STEPS = 3
MICRO = 2
CLIP = 0.05
"""A max norm below the models' gradient norms, so that clipping scales every gradient."""

CASES: dict[str, Callable[[], Any]] = {"gpt": gpt_case, "gpt-vocab": gpt_case, "llama": llama_case,
                                       "llama-1": functools.partial(llama_case, layers=1)}
"""The models by name; ``llama-1``: the Llama in one decoder layer (compiled: inductor's time grows with the graph)."""


def _rms_norm_in_its_dtype(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward`` without its cast to float32 (and back)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@contextlib.contextmanager
def float64_throughout(name: str) -> Iterator[None]:
    """The Llama in float64 end to end while captured and run: transformers' ``LlamaRMSNorm`` normalises
    in float32 whatever its input's dtype. Its input sums a row-parallel product (``o_proj``,
    ``down_proj``) that tp 2 adds in two halves, so the float64 values differ from the unsplit model's
    in the last bits, and an element now and then rounds to the neighbouring float32: gradients differ
    at float32's precision (1e-8), and AdamW's normalised step makes that 1e-5 in a parameter whose
    gradient is near 0. Without the cast both models run float64 through and agree to rounding."""
    if not name.startswith("llama"):
        yield
        return
    from transformers.models.llama import modeling_llama

    saved = modeling_llama.LlamaRMSNorm.forward
    setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_its_dtype)  # noqa: B010 -- a method, set for a while
    try:
        yield
    finally:
        setattr(modeling_llama.LlamaRMSNorm, "forward", saved)  # noqa: B010


def shards(name: str, model: torch.nn.Module) -> dict[str, int]:
    """The tp_shards of the module docstring, by the model's own parameter names."""
    if name.startswith("gpt"):  # "gpt-vocab": its tied embedding and head too, vocabulary-parallel
        mlp = {k: 0 if ".fc." in k else 1 for k in dict(model.named_parameters()) if ".fc." in k or k.endswith(".out.weight")}
        return {**mlp, "wte.weight": 0, "head.weight": 0} if name == "gpt-vocab" else mlp
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
    row = ("o_proj", "down_proj")
    return {k: 0 if any(c in k for c in column) else 1 for k in dict(model.named_parameters(remove_duplicate=False))
            if k.endswith("weight") and any(c in k for c in (*column, *row))}


def fixed_plan(name: str, stages: int, copies: int, tp: int, folder: str, replicate: str = "fully_shard", **options: Any) -> str:
    """A fixed plan of ``stages`` × ``copies`` (``dp_shard``, or ``dp_replicate`` under ``replicate="replicate"``)
    with ``tensor_parallel=tp`` set by hand, saved to a file; ``options``: other plan options (a multi-stage
    schedule), and ``dp_shard`` (below ``copies``: HSDP, set by hand as well)."""
    with float64_throughout(name):
        return _made_plan(name, stages, copies, tp, folder, replicate, options)


def _made_plan(name: str, stages: int, copies: int, tp: int, folder: str, replicate: str, options: dict[str, Any]) -> str:
    shard = options.pop("dp_shard", None)
    torch.manual_seed(0)
    model, args, kwargs, _, _ = CASES[name]()
    options = {"schedule": "1f1b" if stages <= MICRO else "gpipe", "micro_batches": MICRO, **NO_SEARCH, **options}
    made = autosplit.plan(model.double(), ["cpu"] * (stages * copies), example_inputs=args, example_kwargs=kwargs,
                          data_parallel=copies, replicate=replicate, **options)  # the whole mesh but tp, the global batch
    if tp > 1:
        made = dataclasses.replace(made, tensor_parallel=tp, tp_shards=shards(name, model))
    if shard is not None:
        made = dataclasses.replace(made, dp_shard=shard)
    # gpt-vocab: the GPT's plan, its tp_shards its own
    path = (f"{folder}/{name}-pp{stages}-{replicate}{copies}-shard{made.dp_shard}-tp{tp}-{options['schedule']}"
            f"{'-recompute' if made.recompute else ''}.json")
    made.save(path)
    return path


def distribute(model, args, kwargs, loss_fn, plan_path: str, compiled: bool = False) -> Any:
    return autosplit.distribute(model, None, example_inputs=args, plan=plan_path,  # the global batch
                                example_kwargs=kwargs, loss_fn=loss_fn, compile=compiled)


def _check_placement(pipe: Any, rank: int, shards: dict[str, int]) -> None:
    """The rank sits where the mesh's row-major order puts it; every parameter is a DTensor on tp (and dp_shard)."""
    mesh = pipe.plan.mesh
    assert pipe.mesh.mesh_dim_names == MESH_DIMS and tuple(pipe.mesh.shape) == tuple(mesh.values())
    place, copy_, t = pipe.layout.place(pipe.stage_index), pipe.layout.replica, pipe.layout.tp_rank
    assert rank == (place * pipe.layout.replicas + copy_) * mesh["tp"] + t, (rank, place, copy_, t)
    dims = (*(d for d in ("dp_replicate", "dp_shard") if mesh[d] > 1), "tp")  # FSDP2 outside tp
    for pname, p in pipe.named_parameters():
        assert p.device_mesh.mesh_dim_names == dims, (pname, p.device_mesh)
        for dim, placement in zip(dims[:-1], p.placements):
            # fully_shard shards dimension 0 (a _StridedShard over a tp Shard(0): torch's 2-D order); replicate keeps it whole
            assert getattr(placement, "dim", None) == 0 if dim == "dp_shard" else placement.is_replicate(), (pname, p.placements)
        placement = p.placements[-1]
        assert placement.is_shard(shards[pname]) if pname in shards else placement.is_replicate(), (pname, placement)


def planned(name: str, folder: str) -> str:
    """The planner's own plan of ``name`` with ``tensor_parallel=2`` over two devices (the whole mesh):
    its tp_shards from the graph's rules (:mod:`autosplit.passes.tensor_parallel`), not by hand."""
    with float64_throughout(name):
        torch.manual_seed(0)
        model, args, kwargs, _, _ = CASES[name]()
        made = autosplit.plan(model.double(), ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, tensor_parallel=2,
                              data_parallel=1, micro_batches=MICRO, schedule="1f1b", **NO_SEARCH)
    assert made.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 2}
    if name == "llama":  # the rules find what a person writes by hand
        assert dict(made.tp_shards) == shards(name, model), made.tp_shards
    else:  # the fused qkv stays whole, and the report's rows say why
        assert all(k in made.tp_shards for k in shards(name, model)) and "blocks.0.attn.qkv" in made.tp_whole
    path = f"{folder}/{name}-planned-tp2.json"
    made.save(path)
    return path


def train_case(name: str, plan_path: str, compiled: bool = False, evaluate: bool = True, *, rank: int, world: int) -> None:
    with float64_throughout(name):
        _train(name, plan_path, rank, compiled, evaluate)


def _train(name: str, plan_path: str, rank: int, compiled: bool = False, evaluate: bool = True) -> None:
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = CASES[name]()
    model = model.double()
    reference = copy.deepcopy(model)
    pipe = distribute(model, args, kwargs, loss_fn, plan_path, compiled)
    assert set(pipe.compiled.values()) == ({"compiled"} if compiled else set()), pipe.compiled
    _check_placement(pipe, rank, dict(pipe.plan.tp_shards))
    code = "".join(m.code for m in pipe.module.modules() if isinstance(m, torch.fx.GraphModule))
    if pipe.plan.sequence_parallel:  # the activations between the split layers turned as planned
        assert "to_token_shards" in code and "to_whole" in code, code[:2000]
    else:  # each row-parallel product reduced at once
        assert "replicate_partial" in code, code[:2000]
    assert ("recompute_selectively(" in code) == pipe.plan.recompute_selective, code[:2000]
    # inductor reassociates sums (gradients 1e-10 apart, relatively), which AdamW's m/√v magnifies where a gradient is
    # near 0: 3 steps of lr 1e-2 then leave a few weights up to 1e-6 apart
    after = {"atol": 1e-5, "rtol": 1e-5} if compiled else {}
    what = f"{name} {pipe.plan.mesh} rank {rank}"  # the last step clipped below the gradients' norm
    _, _, mine = train_alike(pipe, reference, (args, kwargs, target, loss_fn), Comparison(STEPS, after=after, clip=CLIP), what)
    if not evaluate:  # a compiled evaluation is a graph of its own, compiled on first use
        pipe.close()
        return
    evaluated = pipe.eval_step(*(a[mine] for a in args), target=target[mine], **{k: v[mine] for k, v in kwargs.items()})
    with torch.no_grad():  # forward only, under the same scope as a step
        rows = {k: v[mine] for k, v in kwargs.items()}
        expected_loss = loss_fn(reference(*(a[mine] for a in args), **rows), target[mine])
    if pipe.is_last:
        torch.testing.assert_close(evaluated, expected_loss, msg=where(f"{what} eval_step"))
    pipe.close()


def sequence_parallel(folder: str, stages: int, name: str = "llama") -> str:
    """The planner's own plan of the Llama ``name`` with sequence parallelism over tp 2 (and ``stages`` along pp)."""
    with float64_throughout(name):
        torch.manual_seed(0)
        model, args, kwargs, _, _ = CASES[name]()
        made = autosplit.plan(model.double(), ["cpu"] * 2 * stages, example_inputs=args, example_kwargs=kwargs, tensor_parallel=2,
                              data_parallel=1, sequence_parallel=True, micro_batches=MICRO, schedule="1f1b", **NO_SEARCH)
    assert made.sequence_parallel and made.mesh == {"pp": stages, "dp_replicate": 1, "dp_shard": 1, "tp": 2}
    path = f"{folder}/{name}-sp-pp{stages}.json"
    made.save(path)
    return path


RECOMPUTING: dict[str, dict[str, Any]] = {
    "none": {}, "full": {"checkpointing": "full"}, "selective": {"checkpointing": "full", "selective": True},
}


def recomputing(name: str, folder: str, mode: str, sequence: bool = False) -> str:
    """The planner's own plan of ``name`` over tp 2 (with ``sequence`` parallelism), recomputing every block
    as ``mode`` says (:data:`RECOMPUTING`): costed as it runs, tp_shards from the graph's rules."""
    with float64_throughout(name):
        torch.manual_seed(0)
        model, args, kwargs, _, _ = CASES[name]()
        made = autosplit.plan(model.double(), ["cpu"] * 2, example_inputs=args, example_kwargs=kwargs, tensor_parallel=2,
                              data_parallel=1, sequence_parallel=sequence, micro_batches=MICRO, schedule="1f1b", **NO_SEARCH,
                              **RECOMPUTING[mode])
    assert made.recompute_selective == (mode == "selective") and bool(made.recompute) == (mode != "none")
    path = f"{folder}/{name}-tp2{'-sp' if sequence else ''}-{mode}.json"
    made.save(path)
    return path


def forward_held(name: str, plan_path: str, *, rank: int, world: int) -> tuple[int, int, dict[str, int], dict[str, int]]:
    """(bytes the one-stage plan predicts a rank holds after one micro-batch's forward, bytes it holds
    measured, the collectives of that forward, of its backward) on this rank (:class:`tests.held.Alive`)."""
    from tests.held import Alive, storages

    with float64_throughout(name):
        torch.manual_seed(0)
        model, args, kwargs, target, loss_fn = CASES[name]()
        pipe = distribute(model.double(), args, kwargs, loss_fn, plan_path)
        rows = ROWS // MICRO
        named = dict(zip(pipe._input_names, pipe._to_flat(tuple(a[:rows] for a in args), {k: v[:rows] for k, v in kwargs.items()})))
        stage = pipe.module
        forward = Alive(storages((*stage.parameters(), *stage.buffers(), *named.values())))
        backward = Alive()
        with tp_scope(2):
            with forward:
                out = stage(**named)
            held = forward.alive()
            loss = loss_fn(out[0] if isinstance(out, tuple) else out, target[:rows])  # a one-stage plan: the model's output
            with backward:
                loss.backward()
        pipe.close()
        predicted = pipe.plan.stages[0]
        return predicted.memory_activations + predicted.memory_sent, held, dict(forward.collectives), dict(backward.collectives)
