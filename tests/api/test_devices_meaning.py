"""``devices`` means one thing whatever degrees are given: the whole mesh, one device per rank, with the
example batch the global one. A pinned degree is honoured or refused with a typed error, never dropped."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autosplit
from autosplit.errors import AutosplitError, ConstraintError
from autosplit.examples import GPT
from tests.helpers import NO_SEARCH, says

ROWS = 8


def _gpt() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return GPT(vocab=64, d_model=16, n_layers=2, n_heads=2, max_len=8), (torch.randint(0, 64, (ROWS, 8)),)


MODEL, INPUTS = _gpt()
PLANNER = autosplit.Planner(MODEL, ["cpu"], example_inputs=INPUTS)  # one capture, planned under every combination


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(devices=st.integers(1, 8), dp=st.sampled_from([1, 2, 3, 4, "auto"]), tp=st.sampled_from([1, 2, "auto"]),
       replicate=st.sampled_from(["replicate", "fully_shard", "auto"]))
def test_every_combination_of_degrees_is_honoured_or_refused_with_a_typed_error(devices, dp, tp, replicate):
    try:
        made = PLANNER.what_if(devices=["cpu"] * devices, data_parallel=dp, tensor_parallel=tp, replicate=replicate,
                               micro_batches=1, schedule="gpipe", time_limit=1, **NO_SEARCH)
    except AutosplitError as e:
        assert ". Likely cause: " in str(e) and ". Try: " in str(e), str(e)
        return
    assert math.prod(made.mesh.values()) == devices, (made.mesh, devices)  # the devices are the whole mesh
    assert dp == "auto" or made.data_parallel == dp, (made.mesh, dp)
    assert tp == "auto" or made.tensor_parallel == tp, (made.mesh, tp)
    if made.data_parallel > 1 and replicate != "auto":
        assert (made.dp_shard > 1) == (replicate == "fully_shard"), (made.mesh, replicate)


def test_data_parallel_copies_are_taken_from_the_devices_given():
    """``plan(model, ["cpu"] * 4, data_parallel=2)`` is pp 2 × dp 2: four ranks, each copy on half the batch
    (the reading ``plan`` has with ``tensor_parallel`` or ``"auto"`` degrees, and ``distribute`` has too)."""
    made = autosplit.plan(MODEL, ["cpu"] * 4, example_inputs=INPUTS, data_parallel=2, micro_batches=2, schedule="gpipe", **NO_SEARCH)
    assert made.mesh == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 1} and made.batch == ROWS
    with pytest.raises(ConstraintError) as e:  # a copy per device, and a second degree the devices cannot hold
        autosplit.plan(MODEL, ["cpu"] * 2, example_inputs=INPUTS, data_parallel=2, tensor_parallel=2, **NO_SEARCH)
    says(e, "data_parallel=2 does not divide the 1 devices left by tp 2", "world size = pp × dp_replicate × dp_shard × tp")
    with pytest.raises(ConstraintError) as e:  # autosplit() builds one pipeline in this process
        autosplit.autosplit(MODEL, ["cpu"] * 2, example_inputs=INPUTS, data_parallel=2, **NO_SEARCH)
    says(e, "autosplit() builds one pipeline in this process", "autosplit.distribute")


def test_a_saved_plans_mesh_is_read_back_from_the_whole_mesh(tmp_path):
    """A plan made for pp 2 × dp 2, saved, is recosted on a copy's share of the batch: from its own devices
    (``devices=None``) or from the whole mesh's four, where two devices are refused with the arithmetic."""
    made = autosplit.plan(MODEL, ["cpu"] * 4, example_inputs=INPUTS, data_parallel=2, micro_batches=2, schedule="gpipe", **NO_SEARCH)
    made.save(tmp_path / "plan.json")
    for devices in (None, ["cpu"] * 4):
        again = autosplit.Planner(MODEL, devices, example_inputs=INPUTS).plan(tmp_path / "plan.json")
        assert again.mesh == made.mesh and again.step_time == pytest.approx(made.step_time, rel=1e-9)
    with pytest.raises(ConstraintError) as e:
        autosplit.Planner(MODEL, ["cpu"] * 2, example_inputs=INPUTS).plan(tmp_path / "plan.json")
    says(e, "pp × data_parallel × tp = 2 × 2 × 1 = 4 devices, but 2 devices were given", "devices are the whole mesh")
