"""Activation checkpointing as a decision of the plan: which blocks a plan may recompute, and what
the user decided for them (``PlanOptions.checkpointing`` and ``recompute``).

The blocks are the model's repeated layers — a transformer's layers, a ResNet's residual blocks —
as coarsening finds them (:func:`~autosplit.solver.coarsen.repeated_layers`), and any other module
the user names in ``recompute``. ``checkpointing="none"`` keeps every block's activations and
``"full"`` recomputes every block (torchtitan's ``full`` mode), except where ``recompute`` says
otherwise; ``"auto"`` leaves the undecided ones to the solver, which chooses them with the split.

Usage::

    blocks = candidate_blocks(table, options)   # (label, node names): estimate(..., blocks=blocks)
    offer = offered(table, options)             # label → True / False / None (the solver's choice)
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from autosplit.costtable import CostTable
from autosplit.errors import ConstraintError, advice
from autosplit.options import PlanOptions
from autosplit.solver.build import build_problem
from autosplit.solver.coarsen import repeated_layers
from autosplit.solver.pipeline.dp import topological_order

__all__ = ["candidate_blocks", "offered"]

log = logging.getLogger(__name__)


def _inside(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def candidate_blocks(
    table: CostTable, options: PlanOptions, also: Collection[str] = ()
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(label, member node names) of every block a plan may recompute: the repeated layers, then each
    module ``recompute`` (or ``also``: a saved plan's blocks) names that holds none of them (a key
    that holds some names those)."""
    if options.checkpointing == "none" and not options.recompute and not also:
        return ()
    problem = build_problem(table)
    layers = [path for group in repeated_layers(problem, topological_order(problem)) for path in group]
    paths = table.module_paths
    known = {p for p in paths if p}
    for key in [*(options.recompute or {}), *also]:
        if key in layers:
            continue
        if any(_inside(layer, key) for layer in layers):
            continue
        if not any(_inside(p, key) for p in known):
            raise ConstraintError(advice(
                f"option recompute names {key!r}, but no graph node comes from that module",
                "a misspelt name, or a module the forward never calls",
                f"name a block (like {layers[:3] or sorted(known)[:3]}) or a module holding some",
            ))
        if any(_inside(key, layer) for layer in layers):
            raise ConstraintError(advice(
                f"option recompute names {key!r}, a part of a block the plan may recompute whole",
                "blocks are recomputed whole (one checkpointed region each)",
                f"name the block it is in ({next(la for la in layers if _inside(key, la))!r})",
            ))
        layers.append(key)
    members: dict[str, list[str]] = {layer: [] for layer in layers}
    for name, path in zip(table.nodes, paths):  # every block a node's module is (in): its path's dotted prefixes
        parts = path.split(".") if path else []
        for k in range(1, len(parts) + 1):
            block = members.get(".".join(parts[:k]))
            if block is not None:
                block.append(name)
    first = {name: i for i, name in enumerate(table.nodes)}
    return tuple((layer, tuple(members[layer])) for layer in sorted(layers, key=lambda la: first[members[la][0]]))


def offered(table: CostTable, options: PlanOptions) -> dict[str, bool | None]:
    """Each block of ``table`` with the decision the options make for it: True (recompute), False
    (keep) or None (the solver chooses). A block that recomputing would train differently (an
    in-place write into its input, BatchNorm's running statistics) is kept, or refused when the
    user asks for it by name."""
    default = {"none": False, "full": True, "auto": None}[options.checkpointing]
    pins = options.recompute or {}
    decided: dict[str, bool | None] = {}
    for b, label in enumerate(table.blocks):
        keys = [k for k in pins if _inside(label, k)]
        choice = pins[max(keys, key=len)] if keys else default
        why = table.block_refusal[b]
        if why and choice is not False:
            if keys and choice:
                raise ConstraintError(advice(
                    f"option recompute asks to recompute {label!r}, but {why}",
                    "recomputing it in the backward would run that again and train differently from the model",
                    f"leave {label!r} out of recompute (or set it to False)",
                ))
            log.info("block %s is kept: %s", label, why)
            choice = False
        decided[label] = choice
    return decided
