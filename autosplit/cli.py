"""Command line: plan, compare, show, run, and the built-in demo.

Usage::

    autosplit demo                                                   # the built-in end-to-end job
    autosplit plan autosplit.examples:gpt --devices "A100-80GB*8" --batch 32 --out plan.json --html plan.html
    autosplit compare autosplit.examples:gpt --devices "cpu*2" --manual even=@split.json --manual ds=parameters \\
        --manual cut='{"blocks.4": "beginning"}' --measure --html compare.html
    autosplit show plan.json --html plan.html
    autosplit run autosplit.examples:gpt --devices "cpu*2" --steps 10  # pipelined training on 2 processes (torchrun)

``MODULE:FACTORY`` names a function that returns the workload: a dict with ``model`` and
``example_inputs`` (optionally ``example_kwargs``, ``target`` and ``loss_fn``), or a tuple
``(model, example_inputs)``; ``--batch B`` calls it with ``batch=B``. ``--devices`` is a comma
list of ``NAME*COUNT`` (``"cpu*2"``, ``"A100-80GB*4,V100-16GB*4"``, ``"cuda:0,cuda:1"``).
A manual split is JSON (module lists per stage, a balance list, split points) or a DeepSpeed
``partition_method`` (``parameters``, ``uniform``, ``type:Block``); ``@file.json`` reads a file.
``run`` and ``compare --measure --nproc-per-node N`` start themselves under torchrun when not
already in it. Progress bars show on a terminal only, on rank 0 only. ``--json`` prints
machine-readable output. Exit codes: 0 done; 2 a typed autosplit error (on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autosplit import schedules

__all__ = ["main"]


# -- workloads, devices, manual splits ---------------------------------------------------------
def _one_line(e: BaseException) -> str:
    """An exception as ``Type: message`` on one line."""
    return " ".join(f"{type(e).__name__}: {e}".split())


def _workload(spec: str, batch: int | None) -> dict[str, Any]:
    from autosplit.errors import AutosplitError, ConstraintError, advice

    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConstraintError(advice(
            f"cannot load the workload {spec!r}: {_one_line(e)}",
            "MODULE:FACTORY names an importable module and a function in it",
            "e.g. autosplit.examples:gpt, or mypkg.models:make (run from the folder that holds mypkg)",
        )) from e
    except Exception as e:  # the module's own code failed while importing
        raise ConstraintError(advice(
            f"cannot load the workload {spec!r}: importing {module_name} raised {_one_line(e)}",
            f"the code of {module_name} fails when it is imported",
            f"see the traceback of: python -c 'import {module_name}'",
        )) from e
    factory = getattr(module, attr or "workload", None)
    if not callable(factory):
        raise ConstraintError(advice(
            f"cannot load the workload {spec!r}: {module_name} has no function {attr or 'workload'!r}",
            "MODULE:FACTORY names an importable module and a function in it", "check the name after the colon",
        ))
    call = f"{module_name}.{attr or 'workload'}({'' if batch is None else f'batch={batch}'})"
    try:
        made = factory(batch=batch) if batch is not None else factory()
    except AutosplitError:
        raise
    except Exception as e:  # the factory's own code failed
        raise ConstraintError(advice(
            f"the workload factory {call} raised {_one_line(e)}", "the factory's own code fails with these arguments",
            f"see the traceback of: python -c 'import {module_name}; {call}'",
        )) from e
    if isinstance(made, tuple):
        model, inputs = made[:2]
        made = {"model": model, "example_inputs": inputs}
    if not isinstance(made, dict) or "model" not in made or "example_inputs" not in made:
        raise ConstraintError(advice(
            f"{spec} returned {type(made).__name__}, not a workload",
            "a factory returns a dict with 'model' and 'example_inputs', or a tuple (model, example_inputs)",
            "return {'model': model, 'example_inputs': (x,), 'target': y, 'loss_fn': loss_fn}",
        ))
    inputs = made["example_inputs"]
    made["example_inputs"] = inputs if isinstance(inputs, tuple) else (inputs,)
    made.setdefault("example_kwargs", {})
    return made


def _devices(text: str) -> list[str]:
    from autosplit.errors import DeviceError, advice

    out: list[str] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, count = item.partition("*")
        if (count and not count.isdigit()) or count == "0":
            raise DeviceError(advice(
                f"--devices item {item!r}: {count!r} is not a positive count", "items are NAME or NAME*COUNT",
                'e.g. --devices "cpu*2" or "A100-80GB*8"',
            ))
        out += [name] * int(count or 1)
    return out


def _manual(items: list[str]) -> dict[str, Any]:
    from autosplit.errors import ConstraintError, advice

    splits: dict[str, Any] = {}
    for item in items:
        name, sep, spec = item.partition("=")
        if not sep or not name:
            raise ConstraintError(advice(
                f"--manual {item!r} is not NAME=SPLIT", "each manual split needs a name for the table",
                "e.g. --manual ds=parameters or --manual even=@split.json",
            ))
        where = f"--manual {name}"
        if spec.startswith("@"):
            where += f" (file {spec[1:]})"
            try:
                spec = Path(spec[1:]).read_text()
            except OSError as e:
                raise ConstraintError(advice(
                    f"{where}: cannot read the file: {_one_line(e)}", "@PATH reads the split from a JSON file",
                    "check the path (relative to the current folder)",
                )) from e
        try:
            splits[name] = json.loads(spec)
        except json.JSONDecodeError as e:
            if spec.lstrip().startswith(("{", "[")):
                raise ConstraintError(advice(
                    f"{where}: {spec[:60]!r} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (character {e.pos})",
                    "a split that starts with { or [ is read as JSON: module lists per stage, a balance list or split points",
                    """write it as JSON, e.g. --manual cut='{"blocks.4": "beginning"}' (double quotes inside)""",
                )) from e
            splits[name] = spec  # a DeepSpeed partition_method
    return splits


# -- progress bars and ranks -------------------------------------------------------------------
def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def _bars() -> Iterator[None]:
    """rich progress bars for the compiler's passes, on a terminal and on rank 0 only."""
    if not sys.stderr.isatty() or _rank() != 0:
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from autosplit import progress

    bars = Progress(SpinnerColumn(), TextColumn("{task.description:<10}"), BarColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)
    running: dict[str, tuple[Any, threading.Event]] = {}

    def tick(task: Any, limit: float, stop: threading.Event) -> None:  # a solve's bar fills over its time limit
        start = time.monotonic()
        while not stop.wait(0.1):
            bars.update(task, completed=min(time.monotonic() - start, limit))

    def listener(event: str, name: str, limit: float | None) -> None:
        if event == "start":
            task, stop = bars.add_task(name, total=limit), threading.Event()
            running[name] = (task, stop)
            if limit:
                threading.Thread(target=tick, args=(task, limit, stop), daemon=True).start()
        elif name in running:
            task, stop = running.pop(name)
            stop.set()
            bars.update(task, total=1, completed=1)

    with bars, progress.listen(listener):
        yield


def _launch(argv: list[str], nproc: int) -> int | None:
    """Start this command under torchrun with ``nproc`` processes, unless already in it."""
    if "RANK" in os.environ:
        return None
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # torchrun sets one intra-op thread per process unless told otherwise, and prints a banner
    # saying so; setting the same default here keeps the choice and drops the banner.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="autosplit-errors-") as reports:
        os.environ[_REPORTS] = reports  # the ranks print each distinct error once (see _first_to_report)
        try:  # the processes run the same command; with RANK set, they do not launch again
            torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "autosplit", *argv])
        except ChildFailedError as e:  # the ranks printed their errors; exit as the first failed rank did
            return next(iter(e.failures.values())).exitcode or 1
        finally:
            os.environ.pop(_REPORTS, None)
    return 0


_REPORTS = "AUTOSPLIT_ERROR_REPORTS"
"""A folder shared by the ranks of one launch, where each distinct error is claimed by the first
rank that prints it."""


def _first_to_report(message: str) -> bool:
    """Whether this process prints ``message``: always outside torchrun; under it, only the first
    rank with this exact message (every rank usually fails alike: a bad workload or option), so
    a launch prints each distinct error once. The ranks of ``autosplit run`` share the folder
    :func:`_launch` made; under a torchrun started by hand, the ranks of one node share one keyed
    by the run and the launching agent's process."""
    import hashlib
    import tempfile

    if "RANK" not in os.environ:
        return True
    folder = os.environ.get(_REPORTS) or os.path.join(
        tempfile.gettempdir(), "autosplit-errors", f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.getppid()}"
    )
    try:
        os.makedirs(folder, exist_ok=True)
        claim = os.path.join(folder, hashlib.sha1(message.encode()).hexdigest()[:16])
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False  # another rank printed it
    except OSError:
        return True  # no shared folder: better twice than never
    return True


def _init_process_group() -> None:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _emit(args: argparse.Namespace, text: str, data: Any) -> None:
    if _rank() == 0:
        print(json.dumps(data, indent=1) if args.json else text)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    out = {"time_limit": args.time_limit, "seed": args.seed, "schedule": args.schedule, "costs": args.costs,
           "objective": args.objective}
    if args.micro_batches is not None:
        out["micro_batches"] = args.micro_batches
    return out


# -- commands ----------------------------------------------------------------------------------
def _plan(args: argparse.Namespace, argv: list[str]) -> int:
    from autosplit.htmlreport import write_html
    from autosplit.planner import Planner

    work = _workload(args.workload, args.batch)
    planner = Planner(work["model"], _devices(args.devices), example_inputs=work["example_inputs"],
                      example_kwargs=work["example_kwargs"], **_options(args))
    with _bars():
        plan = planner.plan()
    if args.out:
        plan.save(args.out)
    if args.html:
        write_html(args.html, plan)
    _emit(args, plan.report(), plan.to_dict())
    return 0


def _compare(args: argparse.Namespace, argv: list[str]) -> int:
    from autosplit.compare import compare

    if args.measure and args.nproc_per_node:
        launched = _launch(argv, args.nproc_per_node)
        if launched is not None:
            return launched
    if "RANK" in os.environ:  # under torchrun: measure through the distributed runtime
        _init_process_group()
    work = _workload(args.workload, args.batch)
    with _bars():
        result = compare(
            work["model"], _devices(args.devices), example_inputs=work["example_inputs"],
            example_kwargs=work["example_kwargs"], manual=_manual(args.manual), measure=args.measure,
            loss_fn=work.get("loss_fn"), target=work.get("target"), steps=args.steps, **_options(args),
        )
    if args.html and _rank() == 0:
        result.to_html(args.html)
    _emit(args, result.table(), result.to_dict())
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def _show(args: argparse.Namespace, argv: list[str]) -> int:
    from autosplit.htmlreport import write_html
    from autosplit.plan import Plan

    plan = Plan.load(args.plan)
    if args.html:
        write_html(args.html, plan)
    _emit(args, plan.report(), plan.to_dict())
    return 0


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    """Pipelined (and data-parallel) training of the workload for ``--steps`` steps."""
    import torch
    import torch.distributed as dist

    from autosplit.runtime.distributed import distribute

    devices = _devices(args.devices)
    launched = _launch(argv, args.nproc_per_node or len(devices) * args.dp)
    if launched is not None:
        return launched
    _init_process_group()
    work = _workload(args.workload, args.batch)
    if "loss_fn" not in work or "target" not in work:
        from autosplit.errors import ConstraintError, advice

        raise ConstraintError(advice(
            f"{args.workload} gives no loss_fn and target", "training needs a loss",
            "return 'loss_fn' and 'target' from the factory",
        ))
    with _bars():
        pipe = distribute(work["model"], None if args.plan else devices, example_inputs=work["example_inputs"],
                          example_kwargs=work["example_kwargs"], loss_fn=work["loss_fn"], data_parallel=args.dp,
                          plan=args.plan, **_options(args))
    if args.out and _rank() == 0:
        pipe.plan.save(args.out)
    opt = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    rows = []
    if pipe.asynchronous is not None:  # no flush: every mini-batch in one run
        batch = (work["example_inputs"], work["example_kwargs"], work["target"])
        dist.barrier()
        t0 = time.perf_counter()
        losses = pipe.train([batch] * args.steps, optimizer=opt)
        # A mini-batch's time is the interval between the updates that end it and the one before,
        # on the slowest rank; the first interval holds the pipeline's fill (start-up) and is left
        # out of the median.
        ends = torch.tensor([t0, *pipe.last_run["update_times"]], dtype=torch.float64)
        intervals = ends.diff()
        dist.all_reduce(intervals, op=dist.ReduceOp.MAX)
        last = torch.tensor([-1.0 if loss is None else float(loss) for loss in losses], dtype=torch.float64)
        dist.all_reduce(last, op=dist.ReduceOp.MAX)  # the last stage's losses
        rows = [{"step": i, "seconds": float(dt), "loss": float(v), "start_up": i == 0} for i, (dt, v) in enumerate(zip(intervals, last))]
        if not args.json and _rank() == 0:
            for r in rows:
                print(f"mini-batch {r['step']}: loss {r['loss']:.6f}")
    else:
        for step in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            loss = pipe.step(*work["example_inputs"], target=work["target"], **work["example_kwargs"])
            opt.step()
            opt.zero_grad()
            elapsed = torch.tensor([time.perf_counter() - t0, -1.0 if loss is None else float(loss)], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time; the last stage's loss
            rows.append({"step": step, "seconds": elapsed[0].item(), "loss": elapsed[1].item()})
            if not args.json and _rank() == 0:
                print(f"step {step}: loss {rows[-1]['loss']:.6f}, {rows[-1]['seconds'] * 1e3:.1f} ms")
    steady = [r["seconds"] for r in rows if not r.get("start_up")] or [r["seconds"] for r in rows]
    summary = (f"predicted step {pipe.plan.step_time * 1e3:.1f} ms ({pipe.plan.schedule}); measured median "
               f"{statistics.median(steady) * 1e3:.1f} ms over {len(steady)} steps"
               + (" (the first mini-batch, which fills the pipeline, left out)" if len(steady) < len(rows) else ""))
    _emit(args, summary, {"plan": pipe.plan.to_dict(), "steps": rows})
    dist.destroy_process_group()
    return 0


def _demo(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    import autosplit
    from autosplit.examples import GPT

    torch.manual_seed(args.seed)
    model = GPT(vocab=512, d_model=args.width, n_layers=args.layers, n_heads=4, max_len=args.seq)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 512, (args.batch, args.seq))
    mask = torch.ones_like(tokens)
    targets = torch.randint(0, 512, (args.batch, args.seq))

    start = time.perf_counter()
    with _bars():
        split = autosplit.autosplit(
            model, ["cpu"] * args.devices, example_inputs=(tokens,), example_kwargs={"attention_mask": mask},
            time_limit=args.time_limit, seed=args.seed,
        )
    print(f"planned and built in {time.perf_counter() - start:.2f}s "
          f"({', '.join(f'{k} {v:.2f}s' for k, v in split.plan.timings.items())})")
    print(split.plan)

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


# -- arguments ---------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autosplit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def planning(p: argparse.ArgumentParser, devices: str | None = None) -> None:
        p.add_argument("workload", help="MODULE:FACTORY returning the model and its example batch")
        p.add_argument("--devices", required=devices is None, default=devices, help='e.g. "A100-80GB*8" or "cpu*2"')
        p.add_argument("--batch", type=int, default=None, help="passed to the factory as batch=")
        p.add_argument("--schedule", default="gpipe",
                       help=f"gpipe (default), or one of {', '.join(schedules.SCHEDULES)} (any case; torch's class names too)")
        p.add_argument("--objective", default="pipeline",
                       help="pipeline (default) or makespan (DLPlacer: parallel branches at once; compare shows both)")
        p.add_argument("--micro-batches", type=int, default=None, help="default 4 × stages")
        p.add_argument("--time-limit", type=float, default=10.0, help="solver time limit, seconds (default 10)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--costs", default="analytic", help="analytic (default), measured, or a cost table JSON")
        p.add_argument("--json", action="store_true", help="print JSON instead of the report")

    p = sub.add_parser("plan", help="plan a model onto devices; print the report")
    planning(p)
    p.add_argument("--out", help="write the plan JSON here")
    p.add_argument("--html", help="write the HTML report here")
    p.set_defaults(run=_plan)

    p = sub.add_parser("compare", help="autosplit's plan against manual splits, predicted (and measured)")
    planning(p)
    p.add_argument("--manual", action="append", default=[], metavar="NAME=SPLIT", help="a manual split; repeat for more")
    p.add_argument("--measure", action="store_true", help="also train each split and time it")
    p.add_argument("--steps", type=int, default=10, help="timed steps per split with --measure (default 10)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="with --measure: run distributed on N processes")
    p.add_argument("--html", help="write the HTML report here")
    p.set_defaults(run=_compare)

    p = sub.add_parser("show", aliases=["report"], help="print (or render) a saved plan ('report': the same)")
    p.add_argument("plan")
    p.add_argument("--html", help="write the HTML report here")
    p.add_argument("--json", action="store_true", help="print the plan's JSON")
    p.set_defaults(run=_show)

    p = sub.add_parser("run", help="train the workload pipelined across processes (starts torchrun)")
    planning(p, devices="cpu*2")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (world size = dp × devices)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--plan", help="a saved plan to run instead of solving")
    p.add_argument("--out", help="write the plan it ran here")
    p.add_argument("--nproc-per-node", type=int, default=None, help="default dp × devices")
    p.set_defaults(run=_run)

    demo = sub.add_parser("demo", help="plan a built-in GPT onto CPU devices, train it split, write the plan")
    demo.add_argument("--devices", type=int, default=4, help="logical CPU devices (default 4)")
    demo.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    demo.add_argument("--width", type=int, default=64, help="model width d_model (default 64)")
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--seq", type=int, default=64)
    demo.add_argument("--steps", type=int, default=3, help="training steps to compare (default 3)")
    demo.add_argument("--time-limit", type=float, default=10.0, help="solver time limit, seconds")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="plan.json", help="where to write the plan (default plan.json)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        return args.run(args, argv)
    except Exception as e:
        from autosplit.errors import AutosplitError

        if isinstance(e, AutosplitError):
            message = f"autosplit: {type(e).__name__}: {e}"
            if _first_to_report(message):  # once per launch, not once per rank
                print(message, file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
