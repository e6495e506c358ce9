"""``autosplit.compare``: autosplit's plan first and every split on the same footing, a split over a
memory cap costed and marked, each split measured beside its prediction, both objectives side by side."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import autosplit
from autosplit.api.comparison import compare
from tests.helpers import seeded_gpt


def test_compare_puts_autosplit_first_and_every_split_on_the_same_footing():
    model, inputs = seeded_gpt()
    cmp = compare(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2, manual={
        "torchtitan": [["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "head"]],
        "split points": {"blocks.3": "beginning"},
        "deepspeed": "parameters",
        "typo": [["wte"], ["nothing.here"]],
    })
    names = [c.name for c in cmp.candidates]
    assert names == ["autosplit", "torchtitan", "split points", "deepspeed", "typo"]
    auto = cmp.autosplit
    for c in cmp.candidates[1:4]:
        assert c.feasible and c.plan.micro_batches == auto.micro_batches and c.plan.schedule == auto.schedule
        assert c.plan.fingerprint == auto.fingerprint
        # one cost model: the solver's plan is no worse under it, and its bound holds for every plan
        assert auto.solver.objective <= c.plan.solver.objective * (1 + 1e-9)
        assert c.plan.solver.objective >= cmp.bound * (1 - 1e-9)
    assert cmp.candidates[4].plan is None and "names no module" in cmp.candidates[4].error
    text = str(cmp)
    assert text.index("autosplit") < text.index("torchtitan") and "no (below)" in text and "solver bound" in text
    assert "typo: ConstraintError: module 'nothing.here' names no module" in text
    data = json.loads(cmp.to_json())
    assert [c["name"] for c in data["candidates"]] == names and data["candidates"][4]["plan"] is None
    assert autosplit.Plan.from_dict(data["candidates"][1]["plan"]).assignment == cmp.candidates[1].plan.assignment


def test_a_manual_split_over_the_memory_cap_is_costed_and_marked():
    model, inputs = seeded_gpt()
    heavy = [["wte", "wpe", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "ln_f", "head"]]
    probe = compare(model, ["cpu"] * 2, example_inputs=inputs, manual={"heavy": heavy}, time_limit=2)
    need = probe.candidates[1].plan.stages[0].memory
    cap = int(need * 0.95)  # between what stage 0 of the heavy split needs and what autosplit's plan needs
    assert probe.autosplit.stages[0].memory < cap and max(st.memory for st in probe.autosplit.stages) < cap
    cmp = compare(model, ["cpu"] * 2, example_inputs=inputs, manual={"heavy": heavy}, memory={0: cap, 1: cap}, time_limit=2)
    heavy_row = cmp.candidates[1]
    assert cmp.candidates[0].feasible and not heavy_row.feasible and heavy_row.plan is not None
    assert "stage 0 on cpu needs" in heavy_row.over_cap[0] and "over its cap" in heavy_row.over_cap[0]
    assert "no: over a cap" in str(cmp)
    with pytest.raises(autosplit.errors.PlanValidationError, match="over its cap"):
        autosplit.compiler.manual.manual_plan(autosplit.Planner(model, ["cpu"] * 2, example_inputs=inputs, memory={0: cap, 1: cap}), heavy)


def test_a_recipe_with_data_parallel_degrees_is_costed_like_the_mesh_searchs_configuration():
    """A recipe spreads over the devices as the whole mesh: FSDP 4 alone is costed exactly as the mesh
    search costed that configuration (one split, the same micro-batches), a pipeline × data parallel
    recipe as its split on one copy's share; a degree the devices do not divide, and options that
    restate the recipe's own fields, are refused by name."""
    model, inputs = seeded_gpt()
    H100 = autosplit.devices.PRESETS["H100-80GB"]
    cmp = compare(model, [H100] * 4, example_inputs=inputs, data_parallel="auto", replicate="auto", micro_batches=1,
                  schedule="gpipe", limits=autosplit.options.SolverLimits(cpsat_vars=1), manual={
                      "fsdp 4": autosplit.Recipe(data_parallel=4, replicate="fully_shard"),
                      "pp 2 × dp 2": autosplit.Recipe([["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "head"]],
                                                      data_parallel=2, options={"micro_batches": 2}),
                      "dp 3": autosplit.Recipe(data_parallel=3),
                  })
    auto, fsdp, pp, bad = cmp.candidates
    searched = next(a for a in auto.plan.alternatives if a.data_parallel == 4 and a.dp_shard == 4)
    assert fsdp.plan.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}
    assert fsdp.plan.step_time == pytest.approx(searched.step_time, rel=1e-12)
    assert pp.plan.mesh == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 1} and pp.plan.micro_batches == 2
    assert pp.plan.stages[1].modules[0].startswith("blocks.2") and len(pp.plan.devices) == 2
    assert bad.plan is None and "data_parallel=3 does not divide the 4 devices" in bad.error
    assert "pp 1 × dp_shard 4" in str(cmp) and "on 4 devices" in str(cmp)
    with pytest.raises(autosplit.errors.ConstraintError, match="data_parallel"):
        autosplit.Recipe(options={"data_parallel": 2})
    with pytest.raises(autosplit.errors.ConstraintError, match="zero3"):
        autosplit.Recipe(data_parallel=2, replicate="zero3")
    with pytest.raises(autosplit.errors.ConstraintError, match="shedule"):
        autosplit.Recipe(options={"shedule": "1f1b"})


def test_compare_measures_each_split_locally_beside_its_prediction():
    model, inputs = seeded_gpt()
    target = torch.randint(0, 64, (4, 8))
    loss_fn = lambda out, t: nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    cmp = compare(model, ["cpu"] * 2, example_inputs=inputs, manual={"even": ["blocks.2"]}, measure=True,
                  loss_fn=loss_fn, target=target, steps=2, warmup=1, time_limit=2)
    for c in cmp.candidates:
        m = c.measured
        assert m is not None and m.runtime == "local" and m.steps == 2 and 0 < m.min <= m.median <= m.max
        assert m.predicted == pytest.approx(sum(st.compute for st in c.plan.stages))
    assert "its prediction" in str(cmp) and "local: one process runs the stages in turn" in str(cmp)
    assert all(p.grad is None for p in model.parameters()), "measuring trains copies, not the user's model"
    with pytest.raises(autosplit.errors.ConstraintError, match="needs loss_fn and target"):
        compare(model, ["cpu"] * 2, example_inputs=inputs, measure=True)


def test_compare_shows_both_objectives_and_measures_the_makespan_runtime(tmp_path):
    from benchmarks.workloads.models import make

    torch.manual_seed(0)
    model, (q, i) = make("two_tower", "tiny")
    target = torch.arange(q.shape[0])
    cmp = autosplit.compare(
        model, ["cpu"] * 2, example_inputs=(q, i), manual={"deepspeed": "parameters"}, measure=True, steps=2, warmup=1,
        loss_fn=torch.nn.functional.cross_entropy, target=target, objective="makespan", time_limit=5,
    )
    names = [c.name for c in cmp.candidates]
    assert names == ["autosplit makespan", "autosplit pipeline", "deepspeed"]
    makespan, pipeline, manual = (c.plan for c in cmp.candidates)
    assert makespan.schedule == "makespan" and pipeline.schedule == manual.schedule == "gpipe"
    assert pipeline.micro_batches == manual.micro_batches == 8
    runtimes = [c.measured.runtime for c in cmp.candidates]
    assert runtimes == ["makespan", "local", "local"]
    assert cmp.candidates[0].measured.predicted == makespan.step_time
    text = cmp.table()
    assert "makespan, 1 micro-batch" in text and "gpipe × 8" in text
    assert "no makespan plan's objective" in text and "no pipeline plan's objective" in text
    cmp.to_html(tmp_path / "compare.html")
    html = (tmp_path / "compare.html").read_text()
    assert "no makespan plan&#39;s objective" in html or "no makespan plan's objective" in html
