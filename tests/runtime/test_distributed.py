"""The distributed runtime across processes (gloo): pipelined training equals unsplit training.

Every worker runs several models through ``autosplit.distribute`` and, beside it, the unsplit
model on the same global batch in the same process (float64, seeded; the table's harness,
:func:`tests.layouts.trained_layout`). Losses, every gradient and the parameters after 3 AdamW
steps must agree. Models with BatchNorm are compared with the
*micro-batched* reference (the unsplit model run micro-batch by micro-batch, the losses
averaged): a pipeline normalises each micro-batch with its own statistics, so it cannot equal
full-batch BatchNorm, and it should not pretend to.
"""

from __future__ import annotations

import copy
from typing import Literal

import pytest
import torch

from tests.helpers import where
from tests.layouts import Comparison, trained_layout

MICRO = 2


BATCHNORM = {"inception"}


def _run_case(name: str, schedule: str, dp: int, replicate: Literal["replicate", "fully_shard"], rank: int, world: int) -> None:
    layout = {"data_parallel": dp, "replicate": replicate, "schedule": schedule, "micro_batches": MICRO}
    pipe, reference = trained_layout(name, layout, Comparison(chunks=MICRO if name in BATCHNORM else 1), rank=rank, world=world)
    assert len(set(pipe.plan.assignment.values())) == world // dp
    if dp == 1:  # the gathered state dict loads into the unsplit model and equals it
        full = pipe.full_state_dict()
        assert set(full) == set(reference.state_dict())
        fresh = copy.deepcopy(reference)
        fresh.load_state_dict(full)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(fresh.state_dict()[key], value, msg=where(key))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_training_equals_unsplit_training_on_two_processes(gloo, schedule):
    pytest.importorskip("transformers")
    gloo(2).run(_run_case, [(name, schedule, 1, "replicate") for name in ("gpt", "gpt2", "inception", "gnmt")])


@pytest.mark.parametrize("replicate", ["replicate", "fully_shard"])
def test_hybrid_two_stages_by_two_replicas_equals_unsplit_training(gloo, replicate):
    gloo(4).run(_run_case, [("gpt", "1f1b", 2, replicate), ("inception", "gpipe", 2, replicate)])
