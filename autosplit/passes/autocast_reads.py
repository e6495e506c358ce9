"""Models that ask whether autocast is on: captured without it, refused under a mixed precision.

A captured graph holds what ``forward`` computed while it was traced, with autocast off. The mixed
precisions (``"bf16-mixed"``, ``"fp16-mixed"``) run that graph under ``torch.autocast``, which is
the model's own function under autocast only if ``forward`` does not branch on autocast itself.
Some do: ``transformers`` 5.17's ``maybe_autocast`` turns autocast off around Llama's rotary tables
*only when it is on*, so traced with it off the graph holds no such region, and under autocast the
tables' matmul runs in bf16 where the model's runs in fp32 (found on an H200: the exported graph's
dtype check stopped the step with ``Tensor dtype mismatch``; a model without such a check would
have trained on other numbers).

:func:`autocast_reads` records, while a capture runs, which functions outside torch and autosplit
call ``torch.is_autocast_enabled``; :func:`refuse_under_autocast` refuses a mixed precision for a
capture that has any. A model that imported the function under its own name
(``from torch import is_autocast_enabled``) is not seen.

Usage::

    with autocast_reads() as reads:
        graph = trace(model)
    refuse_under_autocast(tuple(reads), "bf16-mixed")  # raises if reads
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from autosplit.errors import ConstraintError, advice

__all__ = ["autocast_reads", "refuse_under_autocast"]

_OURS = ("torch", "autosplit")
"""Packages whose own reads of the autocast state are not the model's (torch's passes, autosplit's fidelity checks)."""


@contextlib.contextmanager
def autocast_reads() -> Iterator[list[str]]:
    """The functions (``module.function``) outside torch and autosplit that call
    ``torch.is_autocast_enabled`` while the block runs, each once, in the order of their first call."""
    seen: list[str] = []
    asked = torch.is_autocast_enabled

    def spy(*args: Any, **kwargs: Any) -> bool:
        caller = sys._getframe(1)
        where = f"{caller.f_globals.get('__name__', '?')}.{caller.f_code.co_name}"
        if where.partition(".")[0] not in _OURS and where not in seen:
            seen.append(where)
        return asked(*args, **kwargs)

    torch.is_autocast_enabled = spy
    try:
        yield seen
    finally:
        torch.is_autocast_enabled = asked


def refuse_under_autocast(reads: Sequence[str], precision: str) -> None:
    """A :class:`~autosplit.errors.ConstraintError` when ``precision`` runs under autocast and the
    model read the autocast state while it was captured (``reads``, from :func:`autocast_reads`)."""
    if precision.endswith("-mixed") and reads:
        raise ConstraintError(advice(
            f"precision={precision!r} runs the model's graph under torch.autocast, and the model's forward asks whether "
            f"autocast is on ({', '.join(reads[:3])} calls torch.is_autocast_enabled)",
            "the graph was captured with autocast off, so it holds what the model computes without autocast; where "
            "the model computes otherwise under autocast (transformers 5.17's maybe_autocast keeps the rotary "
            "tables in fp32 only then), the split would train on other numbers",
            "plan with precision='bf16-fsdp' (bf16 parameters, no autocast) or 'fp32', or use a version of the "
            "library whose forward does not ask (transformers 5.24 does not)",
        ))
