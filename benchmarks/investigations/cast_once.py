"""How much do a step's bf16 weight copies weigh with and without
:func:`~autosplit.runtime.precision.cast_once`, and would FSDP2's ``MixedPrecisionPolicy`` train like
autocast (issue 47 item 3)?

1. Copies: a GPT (``--d-model``, ``--layers``; fp32) runs one step of ``M`` micro-batches, each
   forward under bf16 autocast on CPU, the backwards after (GPipe's order); the tensors saved for
   backward are grouped by storage, and the bf16 copies of weights among them counted and summed,
   with per-micro-batch autocast alone (the runtime before) and inside one ``cast_once`` scope.
2. FSDP2: a small GPT (``autosplit.examples.GPT``, d_model 16, 2 layers, as the tests' ``gpt_case``)
   wrapped by ``fully_shard`` on a one-process gloo mesh, 3 AdamW steps of ``M`` = 4 micro-batches,
   against the unsplit model under per-micro-batch autocast: with autocast inside ``cast_once``
   (what the runtime does), and with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
   and autocast (what issue 47 proposed). Reported: the largest differences of the losses, the
   gradients and the weights after 3 steps, and by how much they exceed bf16-mixed's tolerance in
   the tests (``rtol=1e-3, atol=1e-4``); and the dtype of the embedding's output (a tensor that
   crosses stages: its static metadata are traced under autocast, where it stays fp32).

Usage::

    .venv/bin/python benchmarks/investigations/cast_once.py            # ~10 s
    .venv/bin/python benchmarks/investigations/cast_once.py --d-model 512 --layers 8 --micro 8
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autosplit.examples import GPT
from autosplit.runtime.precision import autocast, cast_once

OUT = Path(__file__).parent / "results" / "cast_once.json"
TOL = {"rtol": 1e-3, "atol": 1e-4}


def _loss(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), t.flatten())


def _step(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, micro: int, *, once: bool, policy: bool = True,
          saved: dict[int, tuple[bool, int]] | None = None) -> torch.Tensor:
    """One step of ``micro`` micro-batches; ``saved``: storage → (whether it is a bf16 copy of a weight,
    its bytes) of every tensor saved for backward."""
    low = [p.detach().to(torch.bfloat16).flatten() for p in model.parameters()] if saved is not None else []

    def pack(s: torch.Tensor) -> torch.Tensor:
        if saved is not None:
            storage = s.untyped_storage()
            whole = torch.empty(0, dtype=s.dtype).set_(storage)
            copy_of_weight = s.dtype == torch.bfloat16 and any(w.numel() == whole.numel() and torch.equal(w, whole) for w in low)
            saved[storage.data_ptr()] = (copy_of_weight, storage.nbytes())
        return s

    losses = []
    with cast_once("bf16-mixed", "cpu") if once else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
            for xs, ts in zip(x.chunk(micro), t.chunk(micro)):
                with autocast("bf16-mixed", "cpu") if policy else contextlib.nullcontext():
                    losses.append(_loss(model, xs, ts) / micro)
        for loss in losses:
            loss.backward()
    return torch.stack([loss.detach() for loss in losses]).sum()


def copies(d_model: int, layers: int, micro: int, rows: int, seq: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(vocab=512, d_model=d_model, n_layers=layers, n_heads=4, max_len=seq)
    x, t = torch.randint(0, 512, (rows, seq)), torch.randint(0, 512, (rows, seq))
    result: dict[str, Any] = {"d_model": d_model, "layers": layers, "micro_batches": micro, "rows": rows, "seq": seq}
    for once in (False, True):
        saved: dict[int, tuple[bool, int]] = {}
        _step(model, x, t, micro, once=once, saved=saved)
        model.zero_grad()
        weight_copies = [n for copy_of_weight, n in saved.values() if copy_of_weight]
        result["cast_once" if once else "per_micro_batch"] = {
            "weight_copies": len(weight_copies), "weight_copy_MiB": sum(weight_copies) / 2**20,
            "saved_MiB": sum(n for _, n in saved.values()) / 2**20,
        }
    return result


def _train(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, *, once: bool) -> list[Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept = []
    for _ in range(3):
        loss = _step(model, x, t, 4, once=once)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        kept.append((loss, [(g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone() for g in grads]))
        opt.step()
        opt.zero_grad()
    weights = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return [kept, [w.detach().clone() for w in weights]]


def _over(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest amount by which |a − b| exceeds atol + rtol·|b| (≤ 0: within the tolerance)."""
    return float(((a - b).abs() - TOL["atol"] - TOL["rtol"] * b.abs()).max())


def _differences(got: list[Any], ref: list[Any]) -> dict[str, float]:
    (steps, weights), (ref_steps, ref_weights) = got, ref
    grads = [(g, r) for (_, gs), (_, rs) in zip(steps, ref_steps) for g, r in zip(gs, rs)]
    return {
        "loss_max_abs": max(abs(float(a - b)) for (a, _), (b, _) in zip(steps, ref_steps)),
        "grad_max_abs": max(float((g - r).abs().max()) for g, r in grads),
        "grad_over_tolerance": max(_over(g, r) for g, r in grads),
        "weight_max_abs_after_3": max(float((w - r).abs().max()) for w, r in zip(weights, ref_weights)),
        "weight_over_tolerance": max(_over(w, r) for w, r in zip(weights, ref_weights)),
    }


def fsdp_policy() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        base = GPT(vocab=40, d_model=16, n_layers=2, n_heads=2, max_len=8)
        x, t = torch.randint(0, 40, (8, 8)), torch.randint(0, 40, (8, 8))
        reference = _train(copy.deepcopy(base), x, t, once=False)
        once = copy.deepcopy(base)
        fully_shard(once, mesh=mesh)
        policy = copy.deepcopy(base)
        fully_shard(policy, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        embedded: dict[str, str] = {}
        for name, model in (("autocast", once), ("MixedPrecisionPolicy", policy)):
            model.wte.register_forward_hook(lambda m, i, o, name=name: embedded.update({name: str(o.dtype)}))
        return {"fully_shard + cast_once": _differences(_train(once, x, t, once=True), reference),
                "fully_shard + MixedPrecisionPolicy": _differences(_train(policy, x, t, once=False), reference),
                "embedding output dtype": embedded}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"copies": copies(args.d_model, args.layers, args.micro, args.rows, args.seq), "fsdp": fsdp_policy()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
