"""Command line: ``autosplit demo`` (the built-in end-to-end job) and ``autosplit report PLAN``.

Usage::

    autosplit demo --devices 4 --out plan.json
    autosplit report plan.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
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


def _report(args: argparse.Namespace) -> int:
    from autosplit.plan import Plan

    print(Plan.load(args.plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autosplit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
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
    report = sub.add_parser("report", help="print the partition report of a saved plan")
    report.add_argument("plan")
    report.set_defaults(run=_report)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except Exception as e:
        from autosplit.errors import AutosplitError

        if isinstance(e, AutosplitError):
            print(f"autosplit: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
