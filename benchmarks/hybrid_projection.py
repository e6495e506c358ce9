"""Hybrid data × model parallelism projected onto DGX-1 clusters (issue #11, Pal et al. 2019).

Inception-V3, GNMT and BigLSTM at their published sizes, built on the meta device (planning
reads shapes only), on 8 to 1,024 V100s in DGX-1 nodes, with their paper's per-GPU batch b
and also b/2 and b/4 (so data parallelism alone may shrink its global batch too). For every
cluster size the best data-parallel-only configuration's time to the target is set against
the best hybrid's (``autosplit.plan_hybrid``: each worker a pipeline over k devices,
k = 2 … 64), beside the gains Pal et al. project (≥ 26.5%, 8%, 22%).

Statistical efficiency needs a noise scale, and none is published for these models that we
could check offline. So each is **measured by the tool** (``autosplit.api.measure_noise_scale``)
on the bench-size model of the same family, on a synthetic task with a learnable signal
(noisy images of a fixed picture per class; a fixed token-by-token translation; text from a
sparse random Markov chain), after a short warm-up of training. McCandlish et al. find the
noise scale grows by orders of magnitude as the loss falls, and a real dataset's differs from
a synthetic one's, so the gains are also shown at 10× and 100× the measured scale, labelled as
assumptions: the measured number is where a run starts, not where it ends.

Writes ``benchmarks/results/hybrid_projection.json``.

Usage::

    python benchmarks/hybrid_projection.py                       # all three, 8…1,024 V100s
    python benchmarks/hybrid_projection.py --models gnmt --nodes 16
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autosplit
import autosplit.api
import autosplit.compiler.hybrid
from benchmarks.models import GNMT, BigLSTM, InceptionV3, make
from benchmarks.plan_time import machine

RESULTS = Path(__file__).resolve().parent / "results" / "hybrid_projection.json"
ASSUMED = (10, 100)
"""Multiples of the measured noise scale also shown (assumptions, labelled as such)."""
ACTIVE_CLASSES, ACTIVE_TOKENS = 10, 256
"""The synthetic tasks use 10 of the classes and 256 of the tokens, so that a short warm-up
already learns something (which outputs occur) and the gradient carries a signal to measure."""


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple]
    """Example inputs at a batch (meta tensors)."""
    per_device_batch: int
    batch_source: str
    optimizer: str
    optimizer_source: str
    pal_gain: float
    clusters: tuple[int, ...]
    """DGX-1 GPU memory (GB) to plan on."""
    task: Callable[[nn.Module, torch.Generator], Callable[[int], tuple]]
    """(bench model, generator) → a sampler of (inputs, target) batches of the synthetic task."""


def _image_task(_model: nn.Module, gen: torch.Generator) -> Callable[[int], tuple]:
    _, (x,) = make("inception_v3", "bench")
    patterns = torch.randn(ACTIVE_CLASSES, *x.shape[1:], generator=gen)  # each class a faint fixed picture

    def sample(batch: int) -> tuple:
        labels = torch.randint(0, ACTIVE_CLASSES, (batch,), generator=gen)
        return (0.5 * patterns[labels] + torch.randn(batch, *x.shape[1:], generator=gen),), labels

    return sample


def _translation_task(model: nn.Module, gen: torch.Generator) -> Callable[[int], tuple]:
    vocab, seq = cast(nn.Embedding, model.src_emb).num_embeddings, 16  # a GNMT
    dictionary = torch.randperm(vocab, generator=gen)  # every source token has one translation

    def sample(batch: int) -> tuple:
        src = torch.randint(1, ACTIVE_TOKENS, (batch, seq), generator=gen)
        tgt = dictionary[src]
        tgt_in = torch.cat([torch.zeros(batch, 1, dtype=torch.long), tgt[:, :-1]], 1)  # teacher forcing from <s> = 0
        return (src, tgt_in), tgt

    return sample


def _text_task(model: nn.Module, gen: torch.Generator) -> Callable[[int], tuple]:
    seq = 16
    successors = torch.randint(0, ACTIVE_TOKENS, (ACTIVE_TOKENS, 4), generator=gen)  # four possible next tokens each

    def sample(batch: int) -> tuple:
        tokens = [torch.randint(0, ACTIVE_TOKENS, (batch,), generator=gen)]
        for _ in range(seq):
            tokens.append(successors[tokens[-1], torch.randint(0, 4, (batch,), generator=gen)])
        text = torch.stack(tokens, 1)
        return (text[:, :-1],), text[:, 1:]

    return sample


WORKLOADS = {
    "inception_v3": Workload(
        "inception_v3", InceptionV3, lambda b: (torch.empty(b, 3, 299, 299),), 32,
        "Szegedy et al. 2016 (Rethinking the Inception Architecture), §8: batch 32 per replica",
        "adam", "RMSProp with momentum keeps two buffers per parameter, as Adam does", 0.265, (16,), _image_task,
    ),
    "gnmt": Workload(
        "gnmt", GNMT, lambda b: (torch.zeros(b, 50, dtype=torch.long), torch.zeros(b, 50, dtype=torch.long)), 128,
        "Wu et al. 2016 (GNMT), §8: 128 sentence pairs per replica; 50 tokens a side assumed",
        "adam", "GNMT trains with Adam, then SGD", 0.08, (16,), _translation_task,
    ),
    "biglstm": Workload(
        "biglstm", BigLSTM, lambda b: (torch.zeros(b, 20, dtype=torch.long),), 128,
        "Jozefowicz et al. 2016 (Exploring the Limits of Language Modeling): 128 sequences of 20 steps per worker",
        "sgd_momentum", "AdaGrad keeps one accumulator per parameter, as SGD with momentum does", 0.22, (16, 32),
        _text_task,
    ),
}


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, -2), target.flatten())


def measure_noise(name: str, *, warmup_steps: int, big: int, small: int, batches: int, seed: int = 0) -> dict:
    """The simple noise scale of the bench-size model on its synthetic task, after ``warmup_steps`` of Adam."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model, _ = make(name, "bench")
    sample = WORKLOADS[name].task(model, gen)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t0 = time.perf_counter()
    losses = []
    for _ in range(warmup_steps):
        inputs, target = sample(small * 2)
        loss = _loss(model(*inputs), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))

    def big_batches() -> Iterator[tuple]:
        for _ in range(batches):
            inputs, target = sample(big)
            yield inputs, target

    found = autosplit.api.measure_noise_scale(model, big_batches(), _loss, small_batch=small)
    return {
        "noise_scale": found.noise_scale, "trace": found.trace, "grad_sq": found.grad_sq, "small_batch": small,
        "big_batch": big, "batches": batches, "warmup_steps": warmup_steps,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "seconds": time.perf_counter() - t0,
        "source": f"measured by autosplit.api.measure_noise_scale on the bench-size {name} ({small} vs {big} examples, "
                  f"{batches} batches) on a synthetic task after {warmup_steps} Adam steps",
    }


def _fmt(r: autosplit.compiler.hybrid.HybridRow | None) -> str:
    return "does not fit" if r is None else f"k={r.k:<2d} B={r.global_batch:<6d} {r.step * 1e3:8.1f} ms {r.time_to_target:9.3g}"


def project(w: Workload, memory_gb: int, nodes: int, noise: float, time_limit: float, schedule: str) -> dict:
    with torch.device("meta"):
        model = w.build()
        inputs = w.inputs(w.per_device_batch)
    cluster = autosplit.Cluster.dgx1(nodes=nodes, gpu_memory_gb=memory_gb)
    t0 = time.perf_counter()
    tried = [w.per_device_batch // 4, w.per_device_batch // 2, w.per_device_batch]
    hp = autosplit.plan_hybrid(model, cluster, example_inputs=inputs, per_device_batch=tried,
                               noise_scale=noise, optimizer=w.optimizer, time_limit=time_limit, schedule=schedule)
    seconds = time.perf_counter() - t0
    scales = {"measured": noise, **{f"{m}x measured (assumed)": noise * m for m in ASSUMED}}
    views = {label: hp if b == noise else hp.with_statistics(noise_scale=b) for label, b in scales.items()}

    print(f"\n{w.name} on DGX-1 (V100-{memory_gb}GB), per-GPU batches {tried}, {schedule} workers, optimizer memory as "
          f"{w.optimizer}; planned in {seconds:.0f} s; Pal et al. project ≥ {w.pal_gain:.1%}")
    head = f"{'GPUs':>6s} {'best DP-only (k, B, step, time to target × E_min)':>50s} {'best hybrid':>50s}"
    print(head + "".join(f" {'gain @ ' + label.split(' ')[0]:>16s}" for label in scales))
    sizes = []
    for i, point in enumerate(hp.scaling):
        if point.devices < cluster.per_node:
            continue
        gains = {label: view.scaling[i].gain for label, view in views.items()}
        print(f"{point.devices:>6d} {_fmt(point.data_parallel):>50s} {_fmt(point.hybrid):>50s}"
              + "".join(f" {'' if g is None else f'{g:+.1%}':>16s}" for g in gains.values()))
        sizes.append({
            "devices": point.devices,
            **{label: {"data_parallel": _row(view.scaling[i].data_parallel), "hybrid": _row(view.scaling[i].hybrid),
                       "gain": view.scaling[i].gain} for label, view in views.items()},
        })
    print("crossover (fewest GPUs where a hybrid wins): "
          + ", ".join(f"{label}: {view.crossover}" for label, view in views.items()))
    return {
        "cluster": cluster.name, "gpu_memory_gb": memory_gb, "per_device_batches": tried, "schedule": schedule,
        "plan_seconds": seconds, "noise_scales": scales,
        "crossover": {label: view.crossover for label, view in views.items()},
        "choice_at_largest": {label: _row(view.choice) for label, view in views.items()},
        "sizes": sizes,
        "infeasible": [{"k": r.k, "worker_batch": r.worker_batch, "error": r.error} for r in hp.rows if not r.feasible],
    }


def _row(r: autosplit.compiler.hybrid.HybridRow | None) -> dict | None:
    if r is None:
        return None
    return {"k": r.k, "replicas": r.replicas, "worker_batch": r.worker_batch, "global_batch": r.global_batch,
            "micro_batches": r.micro_batches, "step": r.step, "exposed_allreduce": r.allreduce,
            "examples_factor": r.examples_factor, "time_to_target": r.time_to_target, "memory": r.memory}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--nodes", type=int, default=128, help="DGX-1 nodes of the largest cluster (8 GPUs each)")
    parser.add_argument("--time-limit", type=float, default=5.0, help="solver seconds per worker plan")
    parser.add_argument("--schedule", default="gpipe", help="the workers' pipeline schedule")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--big", type=int, default=128)
    parser.add_argument("--small", type=int, default=8)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)

    results = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "workloads": {}}
    for name in args.models:
        w = WORKLOADS[name]
        noise = measure_noise(name, warmup_steps=args.warmup_steps, big=args.big, small=args.small, batches=args.batches)
        print(f"\n{name}: noise scale {noise['noise_scale']:.4g} examples ({noise['source']}; loss "
              f"{noise['loss_first']:.3f} → {noise['loss_last']:.3f}; {noise['seconds']:.0f} s)")
        if not (math.isfinite(noise["noise_scale"]) and noise["noise_scale"] > 0):
            print(f"{name}: the estimate is not a positive number (the gradient's signal is below its noise); skipped")
            results["workloads"][name] = {"noise": noise, "skipped": "noise scale estimate not positive"}
            continue
        results["workloads"][name] = {
            "per_device_batch": w.per_device_batch, "batch_source": w.batch_source, "optimizer": w.optimizer,
            "optimizer_source": w.optimizer_source, "pal_gain": w.pal_gain, "noise": noise,
            "projections": [project(w, gb, args.nodes, noise["noise_scale"], args.time_limit, args.schedule) for gb in w.clusters],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
