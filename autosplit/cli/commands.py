"""The command line's commands: ``plan``, ``compare``, ``show``, ``run`` and ``demo``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any

from autosplit.cli import inputs, processes

__all__ = ["compare", "demo", "plan", "run", "show", "world_size"]


# -- commands ----------------------------------------------------------------------------------
def plan(args: argparse.Namespace, argv: list[str]) -> int:
    from autosplit.api.planner import Planner
    from autosplit.plans import write_atomically
    from autosplit.report.html import write_html
    from autosplit.report.text import plan_report

    work = inputs.workload(args.workload, args.batch)
    loss = {"loss_fn": work["loss_fn"], "example_target": work["target"]} if "loss_fn" in work and "target" in work else {}
    engine = {"expressible_in": args.export} if args.export else {}  # a plan for that engine: its layers whole
    planner = Planner(work["model"], inputs.devices(args.devices), example_inputs=work["example_inputs"],
                      example_kwargs=work["example_kwargs"], **loss, **inputs.options(args), **engine)
    with processes.bars():
        plan = planner.plan()
    if args.export:
        snippet = planner.export(args.export, plan)  # refused (a cut inside a layer: with the nearest plan) before any file is written
        if args.out:
            write_atomically(args.out, snippet, f"the {args.export} configuration")
        print(snippet, end="")
    elif args.out:
        plan.save(args.out)
    if args.html:
        write_html(args.html, plan)
    if not args.export:
        processes.emit(args, plan_report(plan), plan.to_dict())
    return 0


def compare(args: argparse.Namespace, argv: list[str]) -> int:
    if args.measure and args.nproc_per_node:  # the launcher imports no runtime: its ranks do
        launched = processes.launch(argv, args.nproc_per_node)
        if launched is not None:
            return launched
    from autosplit.api.comparison import compare
    if "RANK" in os.environ:  # under torchrun: measure through the distributed runtime
        processes.init_process_group()
    work = inputs.workload(args.workload, args.batch)
    with processes.bars():
        result = compare(
            work["model"], inputs.devices(args.devices), example_inputs=work["example_inputs"],
            example_kwargs=work["example_kwargs"], manual=inputs.manual(args.manual), measure=args.measure,
            loss_fn=work.get("loss_fn"), target=work.get("target"), steps=args.steps, **inputs.options(args),
        )
    if args.html and processes.rank() == 0:
        result.to_html(args.html)
    processes.emit(args, result.table(), result.to_dict())
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def show(args: argparse.Namespace, argv: list[str]) -> int:
    from autosplit.plans import Plan
    from autosplit.report.html import write_html
    from autosplit.report.text import plan_report

    plan = Plan.load(args.plan)
    if args.html:
        write_html(args.html, plan)
    processes.emit(args, plan_report(plan), plan.to_dict())
    return 0


def world_size(args: argparse.Namespace, devices: list[str]) -> int:
    """The processes ``run`` starts by default: one per device (the devices are the whole mesh), or with
    ``--plan`` the ranks of the plan's mesh (pp × data-parallel copies × tp; ``--dp`` for a plan made for one copy)."""
    if not args.plan:
        return len(devices)
    from autosplit.plans import Plan

    plan = Plan.load(args.plan)
    return len(plan.devices) * (plan.data_parallel if plan.data_parallel > 1 else args.dp) * plan.context_parallel * plan.tensor_parallel


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Pipelined (and data-parallel) training of the workload for ``--steps`` steps."""
    from autosplit.api.mesh_checks import check_replicate

    check_replicate(args.replicate)  # before any process starts
    devices = inputs.devices(args.devices)
    launched = processes.launch(argv, args.nproc_per_node or world_size(args, devices))
    if launched is not None:  # the launcher imports no runtime: its ranks do, once their workload loads
        return launched
    import torch
    import torch.distributed as dist

    processes.init_process_group()
    work = inputs.workload(args.workload, args.batch)
    if "loss_fn" not in work or "target" not in work:
        from autosplit.errors import ConstraintError, advice

        raise ConstraintError(advice(
            f"{args.workload} gives no loss_fn and target", "training needs a loss",
            "return 'loss_fn' and 'target' from the factory",
        ))
    from autosplit.api.distributed import distribute

    with processes.bars():
        pipe = distribute(work["model"], None if args.plan else devices, example_inputs=work["example_inputs"],
                          example_kwargs=work["example_kwargs"], loss_fn=work["loss_fn"], example_target=work["target"],
                          data_parallel=args.dp, replicate=args.replicate, plan=args.plan, **inputs.options(args))
    if args.out and processes.rank() == 0:
        pipe.plan.save(args.out)
    opt = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    rows = []
    inputs_, kwargs_, target = _copy_share(work, pipe.plan.data_parallel, pipe.layout.replica)
    if pipe.asynchronous is not None:  # no flush: every mini-batch in one run
        batch = (inputs_, kwargs_, target)
        dist.barrier()
        t0 = time.perf_counter()
        losses = pipe.run([batch] * args.steps, optimizer=opt)
        # A mini-batch's time is the interval between the updates that end it and the one before,
        # on the slowest rank; the first interval holds the pipeline's fill (start-up) and is left
        # out of the median.
        ends = torch.tensor([t0, *pipe.last_run["update_times"]], dtype=torch.float64)
        intervals = ends.diff()
        dist.all_reduce(intervals, op=dist.ReduceOp.MAX)
        last = torch.tensor([-1.0 if loss is None else float(loss) for loss in losses], dtype=torch.float64)
        dist.all_reduce(last, op=dist.ReduceOp.MAX)  # the last stage's losses
        rows = [{"step": i, "seconds": float(dt), "loss": float(v), "start_up": i == 0} for i, (dt, v) in enumerate(zip(intervals, last))]
        if not args.json and processes.rank() == 0:
            for r in rows:
                print(f"mini-batch {r['step']}: loss {r['loss']:.6f}")
    else:
        for step in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            loss = pipe.step(*inputs_, target=target, **kwargs_)
            opt.step()
            opt.zero_grad()
            elapsed = torch.tensor([time.perf_counter() - t0, -1.0 if loss is None else float(loss)], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time; the last stage's loss
            rows.append({"step": step, "seconds": elapsed[0].item(), "loss": elapsed[1].item()})
            if not args.json and processes.rank() == 0:
                print(f"step {step}: loss {rows[-1]['loss']:.6f}, {rows[-1]['seconds'] * 1e3:.1f} ms")
    steady = [r["seconds"] for r in rows if not r.get("start_up")] or [r["seconds"] for r in rows]
    summary = (f"predicted step {pipe.plan.step_time * 1e3:.1f} ms ({pipe.plan.schedule}); measured median "
               f"{statistics.median(steady) * 1e3:.1f} ms over {len(steady)} steps"
               + (" (the first mini-batch, which fills the pipeline, left out)" if len(steady) < len(rows) else ""))
    processes.emit(args, summary, {"plan": pipe.plan.to_dict(), "steps": rows})
    dist.destroy_process_group()
    return 0


def _copy_share(work: dict[str, Any], copies: int, index: int) -> tuple[tuple, dict[str, Any], Any]:
    """The workload's global batch as data-parallel copy ``index`` of ``copies`` steps on it: its rows."""
    from autosplit.microbatch import split_batch, split_target

    inputs_, kwargs_ = split_batch(work["example_inputs"], work["example_kwargs"], copies)[index]
    return inputs_, kwargs_, split_target(work["target"], copies)[index]


def demo(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    import autosplit
    from autosplit.examples import GPT
    from autosplit.report.text import plan_report

    torch.manual_seed(args.seed)
    model = GPT(vocab=512, d_model=args.width, n_layers=args.layers, n_heads=4, max_len=args.seq)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 512, (args.batch, args.seq))
    mask = torch.ones_like(tokens)
    targets = torch.randint(0, 512, (args.batch, args.seq))

    start = time.perf_counter()
    with processes.bars():
        split = autosplit.autosplit(
            model, ["cpu"] * args.devices, example_inputs=(tokens,), example_kwargs={"attention_mask": mask},
            time_limit=args.time_limit, seed=args.seed,
        )
    print(f"planned and built in {time.perf_counter() - start:.2f}s "
          f"({', '.join(f'{k} {v:.2f}s' for k, v in split.plan.timings.items())})")
    print(plan_report(split.plan))

    loss_fn = torch.nn.CrossEntropyLoss()
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (split, reference)]
    print(f"\ntraining {args.steps} steps, split module vs the original model:")
    for step in range(args.steps):
        losses = []
        for module, opt in zip((split, reference), opts):
            loss = loss_fn(module(tokens, attention_mask=mask).flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        print(f"  step {step}: loss {losses[0]:.6f} (split) {losses[1]:.6f} (original), |diff| {abs(losses[0] - losses[1]):.2e}")
    split.plan.save(args.out)
    print(f"\nplan written to {args.out}; rebuild it without solving: "
          f"autosplit.autosplit(model, None, example_inputs=..., plan={args.out!r})")
    return 0
