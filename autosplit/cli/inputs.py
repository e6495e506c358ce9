"""What the command line reads: workloads (``MODULE:FACTORY``), device lists, manual splits and plan options.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

__all__ = ["devices", "manual", "one_line", "options", "workload"]


# -- workloads, devices, manual splits ---------------------------------------------------------
def one_line(e: BaseException) -> str:
    """An exception as ``Type: message`` on one line."""
    return " ".join(f"{type(e).__name__}: {e}".split())


def workload(spec: str, batch: int | None) -> dict[str, Any]:
    from autosplit.errors import AutosplitError, ConstraintError, advice

    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConstraintError(advice(
            f"cannot load the workload {spec!r}: {one_line(e)}",
            "MODULE:FACTORY names an importable module and a function in it",
            "e.g. autosplit.examples:gpt, or mypkg.models:make (run from the folder that holds mypkg)",
        )) from e
    except Exception as e:  # the module's own code failed while importing
        raise ConstraintError(advice(
            f"cannot load the workload {spec!r}: importing {module_name} raised {one_line(e)}",
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
            f"the workload factory {call} raised {one_line(e)}", "the factory's own code fails with these arguments",
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


def devices(text: str) -> list[str]:
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


def manual(items: list[str]) -> dict[str, Any]:
    from autosplit.errors import ConstraintError, advice

    splits: dict[str, Any] = {}
    for item in items:
        name, sep, spec = item.partition("=")
        if item.startswith(("megatron:", "torchtitan:")):  # an engine's configuration, named after the engine
            name, sep, spec = item.partition(":")[0], ":", item
        if not sep or not name:
            raise ConstraintError(advice(
                f"--manual {item!r} is not NAME=SPLIT", "each manual split needs a name for the table",
                "e.g. --manual ds=parameters or --manual even=@split.json",
            ))
        where = f"--manual {name}"
        if spec.startswith(("megatron:", "torchtitan:")):
            splits[name] = spec  # read by Planner.manual (autosplit.compiler.engine_plans)
            continue
        if spec.startswith("@"):
            where += f" (file {spec[1:]})"
            try:
                spec = Path(spec[1:]).read_text()
            except OSError as e:
                raise ConstraintError(advice(
                    f"{where}: cannot read the file: {one_line(e)}", "@PATH reads the split from a JSON file",
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


def options(args: argparse.Namespace) -> dict[str, Any]:
    out = {"time_limit": args.time_limit, "seed": args.seed, "schedule": args.schedule, "costs": args.costs,
           "objective": args.objective}
    if args.micro_batches is not None:
        out["micro_batches"] = args.micro_batches
    if getattr(args, "gap", None) is not None:
        out["gap"] = args.gap
    for name in ("data_parallel", "tensor_parallel"):
        degree = getattr(args, name, None)
        if degree is not None:
            out[name] = int(degree) if degree.isdigit() else degree  # anything else: PlanOptions says what it takes
    if getattr(args, "replicate", None) is not None and args.command == "plan":
        out["replicate"] = args.replicate
    return out

