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
import sys

from autosplit import schedules
from autosplit.cli import commands, processes

__all__ = ["main"]


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
        p.add_argument("--gap", type=float, default=None,
                       help="the certified gap to settle for: a plan proven within this fraction of optimal (default 0.01)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--costs", default="analytic", help="analytic (default), measured, or a cost table JSON")
        p.add_argument("--json", action="store_true", help="print JSON instead of the report")

    p = sub.add_parser("plan", help="plan a model onto devices; print the report")
    planning(p)
    p.add_argument("--data-parallel", default=None, metavar="N|auto",
                   help="data-parallel copies (the devices are the whole mesh, the batch the global one: pp = devices / "
                        "(dp × tp)); 'auto': chosen with the split")
    p.add_argument("--replicate", default=None, choices=["replicate", "fully_shard", "auto"],
                   help="how the copies keep in step (FSDP2's names); 'auto': chosen with the split")
    p.add_argument("--tensor-parallel", default=None, metavar="N|auto",
                   help="devices each stage's tensors are split over, inside a node; 'auto': chosen with the split")
    p.add_argument("--export", choices=["torchtitan", "megatron"], default=None,
                   help="plan what that engine can place (every layer whole) and print it as the engine's configuration "
                        "(torchtitan's TOML job config, Megatron-LM's flags)")
    p.add_argument("--out", help="write the plan JSON here (with --export: the engine's configuration)")
    p.add_argument("--html", help="write the HTML report here")
    p.set_defaults(run=commands.plan)

    p = sub.add_parser("compare", help="autosplit's plan against manual splits, predicted (and measured)")
    planning(p)
    p.add_argument("--manual", action="append", default=[], metavar="NAME=SPLIT", help="a manual split; repeat for more")
    p.add_argument("--measure", action="store_true", help="also train each split and time it")
    p.add_argument("--steps", type=int, default=10, help="timed steps per split with --measure (default 10)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="with --measure: run distributed on N processes")
    p.add_argument("--html", help="write the HTML report here")
    p.set_defaults(run=commands.compare)

    p = sub.add_parser("show", aliases=["report"], help="print (or render) a saved plan ('report': the same)")
    p.add_argument("plan")
    p.add_argument("--html", help="write the HTML report here")
    p.add_argument("--json", action="store_true", help="print the plan's JSON")
    p.set_defaults(run=commands.show)

    p = sub.add_parser("run", help="train the workload pipelined across processes (starts torchrun)")
    planning(p, devices="cpu*2")
    p.add_argument("--dp", type=int, default=1, help="data-parallel copies (the devices are the whole mesh: pp = devices / dp)")
    p.add_argument("--replicate", default="replicate",
                   help="how replicas keep in step, torch's names: replicate (FSDP2's replicate, default) or fully_shard")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--plan", help="a saved plan to run instead of solving")
    p.add_argument("--out", help="write the plan it ran here")
    p.add_argument("--nproc-per-node", type=int, default=None, help="default: one per device (with --plan: its mesh's ranks)")
    p.set_defaults(run=commands.run)

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
    demo.set_defaults(run=commands.demo)
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
            if processes.first_to_report(message):  # once per launch, not once per rank
                print(message, file=sys.stderr)
            return 2
        raise
