"""A stage's compute inside the pipeline against the same stage run alone: where the step
predictions of ``schedules.py`` lose their 7–26% (issue #24).

For the GPT of issue #8 (as ``pipeline_runtime.py``) planned onto 2 CPU processes with per-node
costs measured in this run (one pinned core, one thread), for each schedule:

- every rank times its stage's forward and backward inside the pipeline (torch's
  ``forward_one_chunk`` and ``stage_backward``, summed over the step's micro-batches; median over
  ``--steps`` steps) and counts the process's minor page faults per step;
- before and after those steps, the same rank runs the same stage module alone on the inputs it
  received in a pipeline step (all forwards, then all backwards, the loss on the last stage; the
  other rank does the same at the same time), timed and counted the same way;
- beside them, the plan's predicted forward and backward of that stage (the last stage's with the
  loss: the planner is given ``loss_fn`` and ``example_target``) and its predicted step.

Prints a table and writes ``benchmarks/investigations/results/stage_context.json``.

Usage::

    .venv/bin/python benchmarks/investigations/stage_context.py                 # gpipe and 1f1b, about 3 min
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import autosplit  # noqa: E402
from autosplit.options import ProfileOptions  # noqa: E402
from autosplit.timers import steady_allocator  # noqa: E402
from benchmarks import pipeline_runtime  # noqa: E402
from benchmarks.plan_time import machine  # noqa: E402


def _faults() -> int:
    """Minor page faults of this process so far (/proc/self/stat, field 10)."""
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7])


class _Clock:
    """Seconds and page faults spent inside wrapped calls, per step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.faults: dict[str, int] = {}

    def wrap(self, key: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            f0, t0 = _faults(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0
                self.faults[key] = self.faults.get(key, 0) + _faults() - f0
        return timed

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        out = (self.seconds, self.faults)
        self.seconds, self.faults = {}, {}
        return out


def _alone(pipe, opt, inputs, target, loss_fn, M: int, last: bool, repeats: int) -> dict[str, Any]:
    """The rank's stage module run alone on the inputs it received in one pipeline step."""
    module = pipe._stages[0].submod
    received: list[tuple[tuple, dict]] = []

    def keep(_m: Any, args: tuple, kwargs: dict) -> None:
        received.append((tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args), kwargs))

    hook = module.register_forward_pre_hook(keep, with_kwargs=True)
    dist.barrier()
    pipe.step(*inputs, target=target)
    opt.zero_grad()
    hook.remove()
    targets = target.chunk(M)
    fwd, bwd, faults = [], [], []
    for rep in range(repeats + 1):
        dist.barrier()
        f0, t0 = _faults(), time.perf_counter()
        outs = []
        for i, (args, kwargs) in enumerate(received):
            args = tuple(a.requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args)
            out = module(*args, **kwargs)
            tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor) and t.requires_grad]
            outs.append([loss_fn(tensors[0], targets[i]) / M] if last else tensors)
        t1 = time.perf_counter()
        for tensors in outs:
            torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
        t2 = time.perf_counter()
        opt.zero_grad()
        if rep:  # the first is a warm-up
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            faults.append(_faults() - f0)
    return {"forward": statistics.median(fwd), "backward": statistics.median(bwd), "faults": statistics.median(faults)}


def _worker(rank: int, init: str, plans: list[str], steps: int, out: str) -> None:
    from torch.distributed.pipelining import stage as torch_stage

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank})
    steady_allocator()
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    clock = _Clock()
    base = torch_stage._PipelineStageBase
    forward_one_chunk, stage_backward = base.forward_one_chunk, torch_stage.stage_backward
    rows = []
    try:
        model, inputs, target, loss_fn = pipeline_runtime.workload("gpt")
        for path in plans:
            pipe = autosplit.distribute(copy.deepcopy(model), None, example_inputs=inputs, loss_fn=loss_fn, plan=path)
            opt = torch.optim.Adam(pipe.parameters(), lr=1e-4)
            M, last = pipe.plan.micro_batches, pipe.stage_index == len(pipe.plan.stages) - 1
            before = _alone(pipe, opt, inputs, target, loss_fn, M, last, repeats=5)
            base.forward_one_chunk = clock.wrap("forward", forward_one_chunk)  # type: ignore[method-assign]
            torch_stage.stage_backward = clock.wrap("backward", stage_backward)
            inside: dict[str, list[float]] = {}
            try:
                for i in range(steps + 2):
                    dist.barrier()
                    f0, t0 = _faults(), time.perf_counter()
                    pipe.step(*inputs, target=target)
                    opt.step()
                    opt.zero_grad()
                    seconds, faults = clock.take()
                    if i >= 2:  # warm-up
                        for key, value in (("step", time.perf_counter() - t0), ("faults", _faults() - f0),
                                           ("forward", seconds.get("forward", 0.0)), ("backward", seconds.get("backward", 0.0)),
                                           ("backward_faults", faults.get("backward", 0))):
                            inside.setdefault(key, []).append(value)
            finally:
                base.forward_one_chunk, torch_stage.stage_backward = forward_one_chunk, stage_backward  # type: ignore[method-assign]
            after = _alone(pipe, opt, inputs, target, loss_fn, M, last, repeats=5)
            stage = pipe.plan.stages[pipe.stage_index]
            rows.append({"rank": rank, "schedule": pipe.plan.schedule, "micro_batches": M,
                         "predicted": {"forward": stage.forward, "backward": stage.backward, "step": pipe.plan.step_time},
                         "alone_before": before, "alone_after": after,
                         "inside": {k: statistics.median(v) for k, v in inside.items()}, "inside_steps": inside["step"]})
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--idle", dest="beside", action="store_false",
                        help="profile on an idle host (by default core 1 runs the same passes meanwhile, as rank 1 will)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "investigations" / "results" / "stage_context.json"))
    args = parser.parse_args(argv)
    _, spec = pipeline_runtime.measured_cpu()
    model, inputs, target, loss_fn = pipeline_runtime.workload("gpt")
    with tempfile.TemporaryDirectory() as tmp:
        costs = ProfileOptions(threads=1, cores=(0,), beside=(1,) if args.beside else (), cache_dir=os.path.join(tmp, "profiles"))
        paths = []
        for schedule in args.schedules.split(","):
            plan = autosplit.plan(model, [spec] * 2, example_inputs=inputs, schedule=schedule, micro_batches=args.micro,
                                  costs=costs, time_limit=5, seed=0, loss_fn=loss_fn, example_target=target)
            paths.append(os.path.join(tmp, f"{schedule}.json"))
            plan.save(paths[-1])
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), paths, args.steps, out), nprocs=2, join=True)
        ranks = json.loads(Path(out).read_text())
    rows = [row for pair in zip(*ranks) for row in pair]
    print(f"{'schedule':9s} {'rank':>4s} {'F pred':>7s} {'alone':>13s} {'inside':>7s} {'B pred':>7s} {'alone':>13s} "
          f"{'inside':>7s} {'faults/step alone':>17s} {'inside':>7s} {'step pred':>9s} {'measured':>8s}   (ms)")
    for r in rows:
        p, a, b, i = r["predicted"], r["alone_before"], r["alone_after"], r["inside"]
        print(f"{r['schedule']:9s} {r['rank']:4d} {p['forward'] * 1e3:7.1f} {a['forward'] * 1e3:6.1f}/{b['forward'] * 1e3:6.1f} "
              f"{i['forward'] * 1e3:7.1f} {p['backward'] * 1e3:7.1f} {a['backward'] * 1e3:6.1f}/{b['backward'] * 1e3:6.1f} "
              f"{i['backward'] * 1e3:7.1f} {a['faults']:8.0f}/{b['faults']:8.0f} {i['faults']:7.0f} {p['step'] * 1e3:9.1f} "
              f"{max(x['inside']['step'] for x in rows if x['schedule'] == r['schedule']) * 1e3:8.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"benchmark": "stage_context", "machine": machine(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
