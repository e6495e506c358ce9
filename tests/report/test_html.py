"""The HTML report: the schedule, memory and module tree drawn, self-contained, rendered in headless
Chromium, and the same on every render."""

from __future__ import annotations

import shutil

import pytest

from autosplit.api.comparison import compare
from autosplit.report.html import render, write_html
from tests.helpers import seeded_gpt


def _report(tmp_path):
    model, inputs = seeded_gpt()
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
