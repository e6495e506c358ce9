"""Page faults in a CPU pipeline's steps, with and without a heap faulted in ahead.

The Llama of ``schedules.py`` under one schedule: autosplit's plan and torchtitan's (``tt 1/1``),
distributed on 2 gloo processes pinned to a core each with one thread, run as ``schedules.py``
times them (interleaved blocks of 2 steps, one untimed step before each block, Adam after every
step). Every process calls :func:`autosplit.timers.steady_allocator` first: once with no reserve,
as ``schedules.py`` did up to run 7, once with ``reserve=HEAP_RESERVE`` (1 GiB), as it does since.
For each plan and rank: the minor page faults of each timed step (``getrusage``, the whole
process) and which stage action they came in (the sum over steps), and the steps' median time.

A heap that fragments grows now and then, and each page it grows by faults in on first touch:
rank 0 of autosplit's plan had such steps, torchtitan's none, in the profile that found it.

Usage::

    .venv/bin/python benchmarks/investigations/heap_faults.py    # about 4 min; writes results/heap_faults.json here
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import autosplit  # noqa: E402
from autosplit.options import ProfileOptions  # noqa: E402
from autosplit.runtime.stage import _PolicyStage  # noqa: E402
from autosplit.timers import steady_allocator  # noqa: E402
from benchmarks import schedules  # noqa: E402
from benchmarks.pipeline_runtime import measured_cpu  # noqa: E402
from benchmarks.schedules import HEAP_RESERVE, candidates, split_text, workload, write_json  # noqa: E402


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _count_faults_per_action(into: collections.Counter) -> None:
    """Count each stage action's page faults into ``into`` under ``"I3"``-style keys (the action as
    ``DistributedModel.tracing`` names it, then the stage), wrapping the stages' three chunk methods
    in this process."""
    for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "I"), ("backward_weight_one_chunk", "W")):
        original = getattr(_PolicyStage, method)

        def counted(self, *args: Any, _original=original, _kind=kind, **kwargs: Any) -> Any:
            before = _minflt()
            try:
                return _original(self, *args, **kwargs)
            finally:
                label = "B" if _kind == "I" and kwargs.get("full_backward", True) else _kind
                into[f"{label}{self.stage_index}"] += _minflt() - before

        setattr(_PolicyStage, method, counted)


def _worker(rank: int, init: str, name: str, paths: list[str], reserve: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank})
    steady_allocator(reserve=reserve)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2, timeout=timedelta(minutes=5))
    try:
        model, inputs, target, loss_fn = workload(name)
        by_action: list[collections.Counter] = [collections.Counter() for _ in paths]
        current: collections.Counter = collections.Counter()
        _count_faults_per_action(current)
        runs: list[tuple[Any, Any, list[int], list[float]]] = []
        for path in paths:
            pipe = autosplit.distribute(copy.deepcopy(model), None, example_inputs=inputs, loss_fn=loss_fn, plan=path)
            runs.append((pipe, torch.optim.Adam(pipe.parameters(), lr=1e-4), [], []))
        for _ in range(rounds):
            for i, (pipe, opt, faults, times) in enumerate(runs):
                for step in range(3):  # one untimed step, then a block of 2, as schedules.py
                    dist.barrier()
                    current.clear()
                    before, t0 = _minflt(), time.perf_counter()
                    pipe.step(*inputs, target=target)
                    opt.step()
                    opt.zero_grad()
                    if step:
                        times.append(time.perf_counter() - t0)
                        faults.append(_minflt() - before)
                        by_action[i].update(current)
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, [(faults, times, dict(by_action[i])) for i, (_, _, faults, times) in enumerate(runs)])
        if rank == 0:
            torch.save(gathered, out)
        for pipe, *_ in runs:
            pipe.close()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=("gpt", "llama"))
    parser.add_argument("--schedule", default="zbvzerobubble")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10, help="blocks of 2 timed steps per plan")
    parser.add_argument("--time-limit", type=float, default=10, help="solver seconds per plan")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "investigations" / "results" / "heap_faults.json"))
    args = parser.parse_args(argv)
    start = time.time()
    steady_allocator(reserve=HEAP_RESERVE)
    _, spec = measured_cpu()
    model, inputs, target, loss_fn = workload(args.model)
    loss = {"loss_fn": loss_fn, "example_target": target}
    low, high = autosplit.schedules.lookup(args.schedule).stages_per_rank
    v = 2 if low <= 2 <= (high or 2) else 1
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        costs = ProfileOptions(threads=1, cores=(0,), cache_dir=os.path.join(tmp, "profiles"))
        plans = candidates(model, inputs, loss, spec, (args.schedule, v, args.micro), args, costs)
        plans = {label: plans[label] for label in ("autosplit", "tt 1/1")}
        paths = [os.path.join(tmp, f"{i}.json") for i in range(len(plans))]
        for path, plan in zip(paths, plans.values()):
            plan.save(path)
        for reserve in (0, HEAP_RESERVE):
            where = os.path.join(tmp, f"reserve-{reserve}")
            os.makedirs(where)
            out = os.path.join(where, "faults.pt")
            mp.spawn(_worker, args=(os.path.join(where, "init"), args.model, paths, reserve, args.rounds, out), nprocs=2, join=True)
            got = torch.load(out, weights_only=False)
            for i, (label, plan) in enumerate(plans.items()):
                ranks = [got[rank][i] for rank in range(2)]
                step = [max(a, b) for a, b in zip(ranks[0][1], ranks[1][1])]
                records.append({
                    "reserve": reserve, "plan": label, "split": split_text(plan, schedules.REPEATED[args.model]),
                    "predicted": plan.step_time, "median_step": statistics.median(step),
                    "faults_per_step": [r[0] for r in ranks], "faults_by_action": [r[2] for r in ranks],
                })
    print(f"{args.model} {args.schedule} v={v} M={args.micro}: {2 * args.rounds} timed steps per plan")
    print(f"{'reserve':>9} {'plan':>10} {'median ms':>10} {'rank 0 faults (steps with any)':>31} {'rank 1':>16}  rank 0's faults by action")
    for r in records:
        cells = [f"{sum(f):>8} ({sum(x > 0 for x in f):>2} of {len(f)})" for f in r["faults_per_step"]]
        actions = {k: v for k, v in sorted(r["faults_by_action"][0].items()) if v}
        print(f"{r['reserve'] >> 20:>6} MiB {r['plan']:>10} {r['median_step'] * 1e3:>10.1f} {cells[0]:>31} {cells[1]:>16}  {actions}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), {
        "machine": schedules.machine(), "argv": sys.argv[1:], "model": args.model, "schedule": args.schedule,
        "stages_per_rank": v, "micro_batches": args.micro, "rounds": args.rounds, "rows": records,
        "seconds": time.time() - start,
    })
    print(f"wrote {args.out} in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
