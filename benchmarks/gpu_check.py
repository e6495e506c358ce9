"""A GPU check: split = unsplit on one GPU, measured costs beside the H100 roofline, predicted beside measured.

For the built-in GPT (:class:`autosplit.examples.GPT`) and a transformers Llama (built from a small
``LlamaConfig``, no weights downloaded), each in fp32, in bf16-mixed (autocast around every
stage's forward, fp32 master weights) and in ``fp8`` (bf16-mixed with ``float8="tensorwise"``: the plan's
linears run torchao's float8 training, the unsplit copy converted alike; the FP8 linears' costs are the
analytic FP8 ones, which a profile of the unconverted graph cannot give):

1. **split = unsplit**: the model planned as two stages on one GPU (``["cuda:0", "cuda:0"]``,
   ``schedule="sequential"``: one batch through the stages in turn, what :class:`SplitModule`
   runs; its first layer pinned to the first stage and its last to the second), with
   ``costs="measured"`` (every node profiled on the GPU inside whole passes, under autocast in
   bf16-mixed), trained ``--steps`` Adam steps beside an identical
   unsplit copy on the same batches: the losses and the final weights must agree (fp32 to 1e-4 relative, bf16-mixed to 2e-2);
2. **costs**: the measured per-node forward + backward seconds beside the ``H100-80GB``
   preset's roofline, summed per op kind (``Linear``, ``aten.linear``, ``softmax`` …), as measured / roofline;
3. **step and memory**: the plan's predicted step (forward, backward, optimizer) beside the
   median measured step of the split module (CUDA-synchronised, after warm-up), and the plan's
   predicted memory (both stages: they share the GPU) beside ``torch.cuda.max_memory_allocated``
   over a step, and the unsplit model's step and peak beside them.

Writes ``benchmarks/results/gpu_check.json`` (with the GPU's name: on an H200 the roofline is still
the H100 preset's, the comparison the issue asks for). About 20 s of cases on one H200 at the
default sizes; ``--deadline`` (480 s) stops starting new cases past it and says so.

Without CUDA it refuses before any work: a :class:`~autosplit.errors.DeviceError` on stderr
(``gpu_check: DeviceError: ...``), exit code 2, nothing written. Exit 1: it ran and a check
failed (split ≠ unsplit beyond tolerance, or a case raised); 0: every check passed. A case autosplit
refuses by design (a :class:`~autosplit.errors.ConstraintError`: a Llama from a transformers whose
forward asks whether autocast is on, under bf16-mixed) is recorded as skipped, with the refusal.

Usage::

    .venv/bin/python benchmarks/gpu_check.py                     # on a machine with a GPU
    .venv/bin/python benchmarks/gpu_check.py --models gpt --precisions fp32 --steps 3
    .venv/bin/python benchmarks/gpu_check.py --cpu-smoke --out /tmp/smoke.json   # the same code path on CPU, tiny models
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autosplit
from autosplit.compiler.costs import cost_table
from autosplit.devices import resolve_devices
from autosplit.errors import AutosplitError, ConstraintError, DeviceError, advice
from autosplit.examples import GPT
from benchmarks.plan_time import machine

RESULTS = Path(__file__).resolve().parent / "results"
ROOFLINE = "H100-80GB"
TOLERANCE = {"fp32": 1e-4, "bf16-mixed": 2e-2, "fp8": 2e-2}
"""Largest relative difference of a loss, and of a weight (against the largest weight), split vs unsplit. ``"fp8"``:
bf16-mixed with ``float8="tensorwise"`` (torchao's float8 training on the plan's linears; the unsplit copy converted
with the same recipe and filter, so both compute the same FP8 values)."""
MiB = 2**20

# name: (vocab, width, layers, heads, sequence, batch) — the check's sizes, and the CPU smoke test's
SIZES = {"gpu": (8192, 768, 8, 12, 512, 8), "cpu-smoke": (128, 32, 2, 2, 16, 4)}


def require_cuda() -> str:
    """The GPU's name, or a :class:`DeviceError` saying why this check cannot run here."""
    if not torch.cuda.is_available():
        raise DeviceError(advice(
            "benchmarks/gpu_check.py needs a CUDA GPU, and this process sees none",
            f"torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"{'built with CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU-only build'}); nothing was run or written",
            "run it on a machine with an NVIDIA GPU (one H100 or H200: about 2–4 minutes), or pass --cpu-smoke to "
            "run the same code path on CPU with tiny models",
        ))
    return torch.cuda.get_device_name(0)


# -- the models ----------------------------------------------------------------------------------------


def _gpt(size: tuple[int, ...], seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    vocab, width, layers, heads, seq, batch = size
    torch.manual_seed(seed)
    model = GPT(vocab=vocab, d_model=width, n_layers=layers, n_heads=heads, max_len=seq)
    tokens = torch.randint(0, vocab, (batch, seq))
    return model, {"args": (tokens,), "kwargs": {"attention_mask": torch.ones_like(tokens)}, "vocab": vocab}


def _llama(size: tuple[int, ...], seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, width, layers, heads, seq, batch = size
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=int(width * 8 / 3) // 32 * 32 or 32, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=seq,
        attention_dropout=0.0, use_cache=False,
    )
    cfg._attn_implementation = "eager"  # the attention written out in ops, which torch.export keeps
    tokens = torch.randint(0, vocab, (batch, seq))
    return LlamaForCausalLM(cfg), {"args": (tokens,), "kwargs": {"attention_mask": torch.ones_like(tokens)}, "vocab": vocab}


MODELS: dict[str, Callable[..., tuple[torch.nn.Module, dict[str, Any]]]] = {"gpt": _gpt, "llama": _llama}
"""name → factory(size, seed=...): the model and its batch (``args``, ``kwargs``, ``vocab``)."""
LAYERS = {"gpt": "blocks", "llama": "model.layers"}
"""name → the model's list of layers: its first layer is pinned to the first stage and its last to the
second, so the check runs a real boundary (on one GPU the solver would otherwise keep one stage)."""


def token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the next-token logits (a transformers output's ``.logits``), in fp32."""
    logits = output.logits if hasattr(output, "logits") else output[0] if isinstance(output, (tuple, list)) else output
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


# -- measuring -------------------------------------------------------------------------------------------


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


class _Trainer:
    """Adam steps of ``module`` on one batch, timed (synchronised) and with the device's peak memory."""

    def __init__(self, module: torch.nn.Module, device: torch.device, precision: str) -> None:
        self.module, self.device, self.precision = module, device, precision
        self.opt = torch.optim.Adam(module.parameters(), lr=1e-3)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, batch: dict[str, Any], target: torch.Tensor) -> float:
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16-mixed")
        with autocast:  # the split runs its stages under their own autocast; the loss under the same, as for the unsplit model
            loss = token_loss(self.module(*batch["args"], **batch["kwargs"]), target)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def timed(self, batch: dict[str, Any], target: torch.Tensor, steps: int) -> dict[str, Any]:
        """Median seconds of ``steps`` steps after one untimed; the peak memory of a step (CUDA only)."""
        self.step(batch, target)
        if self.device.type == "cuda":
            self._sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        times = []
        for _ in range(steps):
            self._sync()
            t0 = time.perf_counter()
            self.step(batch, target)
            self._sync()
            times.append(time.perf_counter() - t0)
        out: dict[str, Any] = {"step_s": statistics.median(times), "steps_s": times}
        if self.device.type == "cuda":
            out["peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            out["resident_bytes"] = before  # weights, gradients (none between steps) and Adam state
        return out


def _op_kind(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_function":
        name = str(node.target) if "aten." in str(node.target) else getattr(node.target, "__name__", str(node.target))
        return re.sub(r"\.(default|Tensor|Scalar|int|dim|self)$", "", name)
    return node.op


def costs_by_op(planner: autosplit.Planner, micro_batches: int) -> dict[str, Any]:
    """Per op kind: measured forward + backward seconds on the GPU beside the H100 preset's roofline."""
    options = planner.options
    measured, source = cost_table(planner.traced, planner.specs()[:1], options, micro_batches=micro_batches)
    roofline, _ = cost_table(planner.traced, resolve_devices([ROOFLINE]), options.replace(costs="analytic"), micro_batches=micro_batches)
    gm = planner.traced.captured.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    kinds: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(measured.nodes):
        kind = _op_kind(gm, nodes[name]) if name in nodes else "other"
        row = kinds.setdefault(kind, {"nodes": 0, "measured_s": 0.0, "roofline_s": 0.0})
        row["nodes"] += 1
        row["measured_s"] += measured.fwd_time[i][0] + measured.bwd_time[i][0]
        j = roofline.nodes.index(name) if name in roofline.nodes else None
        if j is not None:
            row["roofline_s"] += roofline.fwd_time[j][0] + roofline.bwd_time[j][0]
    for row in kinds.values():
        row["measured_over_roofline"] = row["measured_s"] / row["roofline_s"] if row["roofline_s"] > 0 else None
    total_m, total_r = sum(r["measured_s"] for r in kinds.values()), sum(r["roofline_s"] for r in kinds.values())
    ordered = dict(sorted(kinds.items(), key=lambda kv: -kv[1]["measured_s"]))
    return {"source": source, "roofline": ROOFLINE, "total_measured_s": total_m, "total_roofline_s": total_r,
            "measured_over_roofline": total_m / total_r if total_r else None, "by_op": ordered}


def _weights_differ(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest |a − b| over every weight, relative to the largest weight."""
    sa, sb = a.state_dict(), b.state_dict()
    worst, scale = 0.0, 0.0
    for name, t in sb.items():
        if name in sa and t.is_floating_point():
            worst = max(worst, float((sa[name].detach().float().cpu() - t.detach().float().cpu()).abs().max()))
            scale = max(scale, float(t.detach().float().abs().max()))
    return worst / scale if scale else worst


def run_case(name: str, precision: str, size: tuple[int, ...], devices: list[str], steps: int, timed_steps: int,
             time_limit: float) -> dict[str, Any]:
    """One model in one precision: plan, split = unsplit, costs by op, predicted beside measured."""
    device = torch.device(devices[0])
    model, batch = MODELS[name](size, seed=0)
    reference = copy.deepcopy(model)
    vocab = batch.pop("vocab")
    target = torch.randint(0, vocab, batch["args"][0].shape, generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    model.to(device)
    batch_dev, target_dev = _to(batch, device), target.to(device)
    float8, computes = ("tensorwise", "bf16-mixed") if precision == "fp8" else (None, precision)
    planner = autosplit.Planner(model, devices, example_inputs=batch_dev["args"], example_kwargs=batch_dev["kwargs"],
                                loss_fn=token_loss, example_target=target_dev, schedule="sequential", precision=computes, float8=float8,
                                costs="measured", time_limit=time_limit, pin={f"{LAYERS[name]}.0": 0, f"{LAYERS[name]}.{size[2] - 1}": 1})
    plan = planner.plan()
    split = planner.build(plan)
    if float8:  # the unsplit copy converted as the stages are
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        wanted = set(plan.float8_linears)
        convert_to_float8_training(reference, module_filter_fn=lambda _, fqn: fqn in wanted,
                                   config=Float8LinearConfig.from_recipe_name(float8))
    planning_s = time.perf_counter() - t0
    fields = ("vocab", "width", "layers", "heads", "seq", "batch")
    out: dict[str, Any] = {"model": name, "precision": precision, "float8_linears": len(plan.float8_linears),
                           "size": dict(zip(fields, size)),
                           "devices": devices, "nodes": len(plan.assignment), "capture": plan.capture, "costs": plan.costs,
                           "planning_s": planning_s, "timings": dict(plan.timings),
                           "stages": [{"modules": list(s.modules), "nodes": s.nodes, "params": s.params, "compute_s": s.compute,
                                       "memory_bytes": s.memory} for s in plan.stages]}
    out["costs_by_op"] = costs_by_op(planner, plan.micro_batches)

    # split = unsplit: the same steps on the same batch from the same weights
    reference.to(device)
    mine, theirs = _Trainer(split, device, computes), _Trainer(reference, device, computes)
    losses = [(mine.step(batch_dev, target_dev), theirs.step(batch_dev, target_dev)) for _ in range(steps)]
    loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in losses)
    weight_rel = _weights_differ(split, reference)
    out["equivalence"] = {"losses": losses, "loss_rel": loss_rel, "weight_rel": weight_rel, "tolerance": TOLERANCE[precision],
                          "ok": loss_rel <= TOLERANCE[precision] and weight_rel <= TOLERANCE[precision]}

    # predicted beside measured: the step, and the memory of both stages (they share the device)
    measured = mine.timed(batch_dev, target_dev, timed_steps)
    unsplit = theirs.timed(batch_dev, target_dev, timed_steps)
    predicted_memory = sum(s.memory for s in plan.stages)
    out["step"] = {"predicted_s": plan.step_time, "measured_s": measured["step_s"],
                   "predicted_over_measured": plan.step_time / measured["step_s"], "unsplit_measured_s": unsplit.get("step_s"),
                   "terms": None if plan.terms is None else {k: v for k, v in dataclasses.asdict(plan.terms).items()
                                                              if isinstance(v, (int, float))}}
    out["memory"] = {"predicted_bytes": predicted_memory, "measured_peak_bytes": measured.get("peak_bytes"),
                     "predicted_over_measured": predicted_memory / measured["peak_bytes"] if measured.get("peak_bytes") else None,
                     "unsplit_peak_bytes": unsplit.get("peak_bytes"), "per_stage_predicted_bytes": [s.memory for s in plan.stages]}
    del split, reference, model, mine, theirs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _print(case: dict[str, Any]) -> None:
    if "error" in case or "skipped" in case:
        print(f"{case['model']:>6} {case['precision']:>10}  {case.get('error') or case.get('skipped')}")
        return
    eq, step, mem, c = case["equivalence"], case["step"], case["memory"], case["costs_by_op"]
    peak = "-" if mem["measured_peak_bytes"] is None else f"{mem['measured_peak_bytes'] / MiB:8.1f}"
    ratio = "-" if c.get("measured_over_roofline") is None else f"{c['measured_over_roofline']:8.2f}"
    print(f"{case['model']:>6} {case['precision']:>10} {case['nodes']:>5} {'ok' if eq['ok'] else 'DIFFERS':>7} "
          f"{eq['loss_rel']:9.2e} {step['predicted_s'] * 1e3:9.2f} {step['measured_s'] * 1e3:9.2f} "
          f"{mem['predicted_bytes'] / MiB:9.1f} {peak:>9} {ratio:>8}")
    for kind, row in list(c.get("by_op", {}).items())[:6]:
        ratio = "-" if row["measured_over_roofline"] is None else f"{row['measured_over_roofline']:.2f}"
        print(f"{'':>19} {kind:<28} {row['nodes']:>4} nodes  measured {row['measured_s'] * 1e3:8.3f} ms  "
              f"roofline {row['roofline_s'] * 1e3:8.3f} ms  ×{ratio}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--precisions", nargs="+", default=list(TOLERANCE), choices=list(TOLERANCE))
    parser.add_argument("--steps", type=int, default=3, help="training steps compared with the unsplit model (default 3)")
    parser.add_argument("--timed-steps", type=int, default=10, help="steps timed after one warm-up (default 10)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver time limit, seconds")
    parser.add_argument("--deadline", type=float, default=480.0, help="start no new case after this many seconds (default 480)")
    parser.add_argument("--cpu-smoke", action="store_true", help="run on two logical CPU devices with tiny models (no CUDA needed)")
    parser.add_argument("--out", default=str(RESULTS / "gpu_check.json"))
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        gpu = "cpu (smoke test)" if args.cpu_smoke else require_cuda()
    except AutosplitError as e:
        print(f"gpu_check: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    devices = ["cpu", "cpu"] if args.cpu_smoke else ["cuda:0", "cuda:0"]
    size = SIZES["cpu-smoke" if args.cpu_smoke else "gpu"]
    print(f"{gpu}: two stages on {devices[0]}, measured costs beside the {ROOFLINE} roofline")
    print(f"{'model':>6} {'precision':>10} {'nodes':>5} {'split':>7} {'loss rel':>9} {'pred ms':>9} {'meas ms':>9} "
          f"{'pred MiB':>9} {'peak MiB':>9} {'meas/roof':>8}")
    cases: list[dict[str, Any]] = []
    for name in args.models:
        for precision in args.precisions:
            if time.perf_counter() - start > args.deadline:
                cases.append({"model": name, "precision": precision, "skipped": f"past the {args.deadline:.0f} s deadline"})
            elif name == "llama" and not _has_transformers():
                cases.append({"model": name, "precision": precision, "skipped": "transformers is not installed"})
            else:
                try:
                    cases.append(run_case(name, precision, size, devices, args.steps, args.timed_steps, args.time_limit))
                except ConstraintError as e:  # autosplit refused the case by design (the installed model reads autocast)
                    cases.append({"model": name, "precision": precision, "skipped": f"refused: {str(e)[:2000]}"})
                except Exception as e:  # noqa: BLE001 - one case failing is a result: recorded, the others still run
                    cases.append({"model": name, "precision": precision, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            _print(cases[-1])
    passed = all(c.get("equivalence", {}).get("ok", False) for c in cases if "skipped" not in c)
    result = {"benchmark": "gpu_check", "gpu": gpu, "cpu_smoke": args.cpu_smoke, "machine": machine(),
              "cuda": torch.version.cuda, "args": vars(args), "cases": cases, "passed": passed,
              "seconds": time.perf_counter() - start}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"{'passed' if passed else 'FAILED'} in {result['seconds']:.0f} s; wrote {out}")
    return 0 if passed else 1


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
