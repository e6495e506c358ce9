"""Manual splits in every form users write, ``autosplit.compare``, and the HTML report (issue #10)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint

import autosplit
from autosplit.api.comparison import compare
from autosplit.compiler.manual import balance_fqns, megatron_fqns
from autosplit.examples import GPT
from autosplit.report.html import render, write_html


def _gpt(layers=4):
    torch.manual_seed(0)
    return GPT(vocab=64, d_model=16, n_layers=layers, n_heads=2, max_len=8), (torch.randint(0, 64, (4, 8)),)


def _planner(devices=2, layers=4, **options):
    model, inputs = _gpt(layers)
    return model, inputs, autosplit.Planner(model, ["cpu"] * devices, example_inputs=inputs, time_limit=2, **options)


def test_split_points_cut_where_pipelining_cuts():
    _, _, planner = _planner()
    begin = planner.manual({"blocks.2": SplitPoint.BEGINNING})
    end = planner.manual({"blocks.1": SplitPoint.END})
    names = planner.manual(["blocks.2"])
    fqns = planner.manual([["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "head"]])
    assert begin.stage_of["blocks_1_out"] == 0 and begin.stage_of["blocks_2_ln1"] == 1
    assert begin.assignment == names.assignment
    # END of blocks.1 and BEGINNING of blocks.2 differ only in nodes between the two modules (none here)
    assert end.assignment == begin.assignment
    assert fqns.stage_of["blocks_2_ln1"] == 1 and fqns.step_time == pytest.approx(begin.step_time, rel=0.05)


def test_deepspeed_type_balance_and_megatron_forms():
    model, _, planner = _planner(devices=2)
    by_type = planner.manual("type:GPTBlock")
    assert by_type.solver.name == "deepspeed type:GPTBlock" and by_type.stage_of["blocks_1_out"] == 0
    assert by_type.stage_of["blocks_2_ln1"] == 1
    with pytest.raises(autosplit.errors.ConstraintError, match="matches no layer"):
        planner.manual("type:Conv")
    assert megatron_fqns(model, 3, repeated="blocks", first=1, last=1) == [
        ["wte", "wpe", "blocks.0"], ["blocks.1", "blocks.2"], ["blocks.3", "ln_f", "head"]
    ]
    with pytest.raises(autosplit.errors.ConstraintError, match="divide by the stages between"):
        megatron_fqns(model, 4, repeated="blocks", first=1, last=2)
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert balance_fqns(seq, [3, 2]) == [["0", "1", "2"], ["3", "4"]]
    with pytest.raises(autosplit.errors.ConstraintError, match="sums to 4 layers, but the model has 5"):
        balance_fqns(seq, [2, 2])
    seq_planner = autosplit.Planner(seq, ["cpu"] * 2, example_inputs=(torch.randn(4, 8),))
    balanced = seq_planner.manual([3, 2])
    assert sorted(balanced.stage_of.values()) == [0, 0, 0, 1, 1]


def test_a_split_inside_a_module_the_capture_keeps_whole_says_so():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.enc(x))

    planner = autosplit.Planner(Net(), ["cpu"] * 2, example_inputs=(torch.randn(2, 5, 16),))
    with pytest.raises(autosplit.errors.ConstraintError, match=r"'enc.self_attn' is inside 'enc', which the capture keeps as one node"):
        planner.manual({"enc.self_attn": SplitPoint.END})
    with pytest.raises(autosplit.errors.ConstraintError, match=r"names no module .* such as \['head'"):
        planner.manual([["enc"], ["haed"]])
    with pytest.raises(autosplit.errors.ConstraintError, match="at the start of the graph"):
        planner.manual({"enc": SplitPoint.BEGINNING})


def test_compare_puts_autosplit_first_and_every_split_on_the_same_footing():
    model, inputs = _gpt()
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
    model, inputs = _gpt()
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


def test_compare_measures_each_split_locally_beside_its_prediction():
    model, inputs = _gpt()
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


def _report(tmp_path):
    model, inputs = _gpt()
    cmp = compare(model, ["cpu"] * 2, example_inputs=inputs, manual={"even": ["blocks.2"], "typo": ["blocks.9"]},
                  time_limit=2, schedule="1f1b", micro_batches=4)
    return cmp, cmp.to_html(tmp_path / "compare.html")


def test_the_html_report_draws_the_schedule_memory_and_module_tree(tmp_path):
    cmp, path = _report(tmp_path)
    html = path.read_text()
    assert "<script" not in html and "http" not in html.replace("http-equiv", ""), "self-contained, no network"
    plan = cmp.autosplit
    S, M = len(plan.stages), plan.micro_batches
    section = html[html.index('id="plan-0"') : html.index('id="plan-1"')]
    assert section.count('class="task forward"') == S * M and section.count('class="task backward"') == S * M
    assert section.count('class="task optimizer"') == S and 'class="bubble"' in section
    for part in ("state", "activations", "received", "sent", "transient"):
        assert section.count(f'class="mem mem-{part}"') == S
    assert section.count('class="module"') == len(plan.module_stages)
    assert html.count('class="candidate') == 3 and "names no module" in html
    single = write_html(tmp_path / "plan.html", plan).read_text()
    assert 'id="compare"' not in single and single.count('class="task forward"') == S * M


def _chrome():
    selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path = shutil.which("chromedriver")
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if driver_path is None or browser is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver; .ci/run does)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
                 "--window-size=1280,2000"):
        options.add_argument(flag)
    del selenium
    return webdriver.Chrome(service=Service(driver_path), options=options)


def test_the_report_renders_in_headless_chromium(tmp_path):
    cmp, path = _report(tmp_path)
    driver = _chrome()
    try:
        driver.get(path.resolve().as_uri())
        from selenium.webdriver.common.by import By

        plan = cmp.autosplit
        S, M = len(plan.stages), plan.micro_batches
        timeline = driver.find_element(By.CSS_SELECTOR, "#plan-0 svg.timeline")
        forward = timeline.find_elements(By.CSS_SELECTOR, "rect.task.forward")
        assert len(forward) == S * M and all(r.size["width"] > 0 and r.size["height"] > 0 for r in forward)
        assert timeline.size["width"] > 700
        bars = driver.find_elements(By.CSS_SELECTOR, "#plan-0 svg.memory rect.mem-state")
        assert len(bars) == S and all(r.size["width"] > 0 for r in bars)
        rows = driver.find_elements(By.CSS_SELECTOR, "#compare-table tr.candidate")
        assert [r.find_element(By.TAG_NAME, "a").text for r in rows] == ["autosplit", "even", "typo"]
        assert "infeasible" in rows[2].get_attribute("class")
        tree = driver.find_elements(By.CSS_SELECTOR, "#plan-0 .module-tree li.module")
        assert len(tree) == len(plan.module_stages)
        assert driver.find_element(By.CSS_SELECTOR, "#plan-0 .gap").text.endswith("%")
        shot = tmp_path / "report.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        driver.quit()


def test_render_is_deterministic(tmp_path):
    cmp, _ = _report(tmp_path)
    assert render(cmp.candidates) == render(cmp.candidates)
