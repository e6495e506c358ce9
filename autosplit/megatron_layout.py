"""Megatron-LM's ``--pipeline-model-parallel-layout``: read, checked and written as Megatron does.

A layout lists the pipeline's stages in virtual-stage order (stage ``k`` runs on pipeline rank
``k mod pp``, as its ``k // pp``-th model chunk), separated by ``|``; each stage is a string of
layer letters: ``E`` the embedding, ``t`` a transformer (decoder) layer, ``L`` the loss (the final
norm and the output layer with it), ``m`` a multi-token-prediction layer. ``x*n`` repeats a letter,
``(...)*n`` a group, and commas are cosmetic. Megatron-Bridge's Llama-3-70B on TP 4 × PP 8 × VP 5::

    Et*2|(t*2|)*34,t*3|(t*2|)*3,tL      → 40 stages: E t t | t t … | t t t | t t … | t L

:func:`parse` unrolls a layout as ``PipelineParallelLayerLayout.parse_str_to_list`` does (groups
first, then letters; every other character, a space among them, is refused as Megatron refuses it);
:func:`check` refuses what ``PipelineParallelLayerLayout`` and its ``validate_layer_layout`` refuse
(the embedding once and first, the loss once and last, as many ``t`` as the model has layers, as many
``m`` as it has multi-token prediction layers and each rank's in its last virtual stage, a stage count
that the pipeline degree divides) and returns the virtual pipeline size. The tests hold both to
Megatron-Core's own parser on generated layouts. autosplit is stricter in one place only: a stage
with no layer (``'Et*16||t*8|t*8L'``), which Megatron builds as a rank that relays its input and
autosplit's runtime does not run. :func:`format_layout` writes
stages back in the published style: a letter run as ``t*n``, a run of identical stages as
``(…|)*n`` followed by a comma, so that the recipes' strings come back as they were written.

Usage::

    stages = parse("Et*2|(t*2|)*34,t*3|(t*2|)*3,tL")
    vp = check(stages, num_layers=80, pipeline=8)     # 5
    assert format_layout(stages) == "Et*2|(t*2|)*34,t*3|(t*2|)*3,tL"
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

from autosplit.errors import ConstraintError, advice

__all__ = ["LETTERS", "check", "format_layout", "parse"]

LETTERS = {"E": "embedding", "t": "transformer layer", "L": "loss (final norm and output layer)", "m": "multi-token prediction layer"}
"""The layer letters Megatron's layouts use, and what each stands for."""

_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_LETTER = re.compile(r"(.)\*(\d+)")


def parse(layout: str) -> tuple[tuple[str, ...], ...]:
    """The stages of ``layout``, each a tuple of layer letters (a typed error on anything Megatron would not read)."""
    if not isinstance(layout, str) or not layout:
        raise ConstraintError(advice(
            f"Megatron layout {layout!r} is empty", "a layout lists every stage's layers, separated by '|'",
            "write one such as 'Et*2|(t*2|)*34,t*3|(t*2|)*3,tL'",
        ))
    text = layout.replace(",", "")
    for pattern in (_GROUP, _LETTER):
        text = pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)
    stages = tuple(tuple(stage) for stage in text.split("|"))
    bad = sorted({c for stage in stages for c in stage} - set(LETTERS))
    if bad:
        raise ConstraintError(advice(
            f"Megatron layout {layout!r} holds {bad}, which are no layer letters (after unrolling: {text[:60]!r})",
            f"Megatron reads {', '.join(f'{k} ({v})' for k, v in LETTERS.items())}, 'x*n', '(…)*n', '|' and commas, "
            "nothing else (no spaces: its parser refuses them as 'Invalid layer character'); groups do not nest",
            "correct the layout",
        ))
    return stages


def check(stages: Sequence[Sequence[str]], *, num_layers: int, pipeline: int, mtp_layers: int | None = None,
          empty_stages: bool = False) -> int:
    """The virtual pipeline size of ``stages`` on ``pipeline`` ranks, or a typed error where Megatron-Core's
    ``PipelineParallelLayerLayout(layout, pipeline).validate_layer_layout(num_layers, mtp_layers)`` would
    refuse them — or, stricter than Megatron, where a stage holds no layer (``empty_stages=True``: accepted
    as Megatron accepts it, for writing a plan that leaves a rank without a layer)."""
    problems = _megatron_problems(stages, num_layers, pipeline, mtp_layers)
    if problems:
        raise ConstraintError(advice(
            f"Megatron layout {format_layout(stages)!r} is not one Megatron runs: " + "; ".join(problems),
            "Megatron validates a layout so (PipelineParallelLayerLayout.validate_layer_layout)",
            "correct the layout, or let autosplit write it: plan.export('megatron')",
        ))
    empty = [k for k, stage in enumerate(stages) if not stage]
    if empty and not empty_stages:
        raise ConstraintError(advice(
            f"Megatron layout {format_layout(stages)!r} leaves stages {empty} without a layer: Megatron accepts that (the "
            "rank relays its input), autosplit does not", "every stage of autosplit's runtime runs part of the model",
            "give each stage a layer, or fewer stages",
        ))
    return len(stages) // pipeline


def _megatron_problems(stages: Sequence[Sequence[str]], num_layers: int, pipeline: int, mtp_layers: int | None) -> list[str]:
    """What Megatron-Core refuses in ``stages``, in its own order of checks (none: it accepts them)."""
    if pipeline < 1 or len(stages) % pipeline:
        return [f"its {len(stages)} stages do not divide over pipeline size {pipeline}"]
    flat = [c for stage in stages for c in stage]
    problems = []
    if flat.count("E") != 1 or flat[:1] != ["E"]:
        problems.append(f"the embedding E must come once, first (it comes {flat.count('E')} time(s), and the layout starts with "
                        f"{flat[:1] or 'nothing'})")
    if flat.count("L") != 1 or flat[-1:] != ["L"]:
        problems.append(f"the loss L must come once, last (it comes {flat.count('L')} time(s))")
    if flat.count("t") != num_layers:
        problems.append(f"it holds {flat.count('t')} transformer layers t, the model {num_layers}")
    if flat.count("m") != (mtp_layers or 0):
        problems.append(f"it holds {flat.count('m')} multi-token prediction layers m, the model {mtp_layers or 0}")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        problems.append("transformer layers come after a multi-token prediction layer m")
    vp = len(stages) // pipeline
    early = [k for k, stage in enumerate(stages) if "m" in stage and k < (vp - 1) * pipeline]
    if early:
        problems.append(f"stages {early} hold m outside their rank's last virtual stage")
    split = [k for k, stage in enumerate(stages) if "m" in stage and stage.count("m") != (mtp_layers or 0)]
    if split and flat.count("m") == mtp_layers:
        problems.append(f"the m layers are spread over stages {split}, not all in one")
    return problems


def _stage(stage: Sequence[str]) -> str:
    return "".join(c if len(run) == 1 else f"{c}*{len(run)}" for c, run in ((c, list(g)) for c, g in itertools.groupby(stage)))


def format_layout(stages: Sequence[Sequence[str]]) -> str:
    """``stages`` as a layout string: letter runs as ``t*n``, and a run of identical stages before the
    last as ``(…|)*n`` followed by a comma (the published recipes' style; :func:`parse` reads it back)."""
    parts = [_stage(s) for s in stages]
    out, k = [], 0
    last = len(parts) - 1
    while k < last:
        run = 1
        while k + run < last and parts[k + run] == parts[k]:
            run += 1
        out.append(f"({parts[k]}|)*{run}," if run > 1 else f"{parts[k]}|")
        k += run
    out.append(parts[last] if parts else "")
    return "".join(out)
