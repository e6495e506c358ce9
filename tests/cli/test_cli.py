"""The command line: the demo job, plan / compare / show / run, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import autosplit
from autosplit.cli import main


def test_demo_plans_trains_and_writes_a_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["demo", "--devices", "2", "--layers", "2", "--width", "16", "--seq", "8", "--steps", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "autosplit plan:" in text and "bottleneck" in text
    assert text.count("(split)") == 2 and "(original)" in text
    plan = autosplit.Plan.load(out)
    assert len(plan.devices) == 2 and set(plan.assignment.values()) == {0, 1}

    assert main(["report", str(out)]) == 0
    assert "autosplit plan:" in capsys.readouterr().out


def test_cli_reports_autosplit_errors_without_a_traceback(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "PlanFileError: cannot read plan file" in capsys.readouterr().err


GPT_ARGS = ["autosplit.examples:gpt", "--batch", "4", "--time-limit", "2"]


def test_plan_and_show_write_json_html_and_plan_files(tmp_path, capsys):
    out, html = tmp_path / "plan.json", tmp_path / "plan.html"
    assert main(["plan", *GPT_ARGS, "--devices", "A100-80GB*4", "--json", "--out", str(out), "--html", str(html)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["devices"]) == 4 and data["devices"][0]["name"] == "A100-80GB"
    assert autosplit.Plan.load(out).assignment == data["assignment"]
    assert 'class="task forward"' in html.read_text()
    again = tmp_path / "again.html"
    assert main(["show", str(out), "--html", str(again)]) == 0
    assert "autosplit plan:" in capsys.readouterr().out and again.read_text() == html.read_text()


def test_compare_on_the_command_line_reads_every_manual_form(tmp_path, capsys):
    split = tmp_path / "split.json"
    split.write_text(json.dumps([["wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "blocks.3"],
                                 ["blocks.4", "blocks.5", "blocks.6", "blocks.7", "ln_f", "head"]]))
    html = tmp_path / "compare.html"
    args = ["compare", *GPT_ARGS, "--devices", "cpu*2", "--manual", f"even=@{split}", "--manual", "ds=parameters",
            "--manual", 'cut={"blocks.4": "beginning"}', "--manual", "bad=[[1], [2, 3]]", "--json", "--html", str(html)]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    assert [r["name"] for r in rows] == ["autosplit", "even", "ds", "cut", "bad"]
    assert all(r["feasible"] for r in rows[:4]) and rows[4]["plan"] is None
    assert rows[1]["plan"]["assignment"] == rows[3]["plan"]["assignment"]
    assert 'id="compare-table"' in html.read_text()


def test_bad_command_line_input_exits_2_with_a_typed_error(capsys):
    assert main(["plan", "no.such.module:factory", "--devices", "cpu*2"]) == 2
    assert "ConstraintError: cannot load the workload" in capsys.readouterr().err
    assert main(["plan", *GPT_ARGS, "--devices", "cpu*two"]) == 2
    assert "DeviceError: --devices item 'cpu*two'" in capsys.readouterr().err
    assert main(["compare", *GPT_ARGS, "--devices", "cpu*2", "--manual", "nameless"]) == 2
    assert "is not NAME=SPLIT" in capsys.readouterr().err
    assert main(["run", *GPT_ARGS, "--devices", "cpu*2", "--dp", "2", "--replicate", "fsdp"]) == 2  # before torchrun starts
    assert "ConstraintError: replicate='fsdp' is a former name" in (err := capsys.readouterr().err) and "'fully_shard'" in err


def _cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "autosplit", *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.processes  # torchrun's ranks
def test_run_launches_itself_under_torchrun_and_trains_pipelined():
    done = _cli("run", *GPT_ARGS, "--micro-batches", "4", "--devices", "cpu*2", "--steps", "3", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    losses = [row["loss"] for row in result["steps"]]
    assert len(losses) == 3 and all(loss > 0 for loss in losses) and losses[-1] < losses[0]
    assert len(result["plan"]["devices"]) == 2


@pytest.mark.processes  # torchrun's ranks
def test_run_trains_an_asynchronous_schedule_with_a_tied_weight_sent():
    done = _cli("run", *GPT_ARGS, "--micro-batches", "2", "--devices", "cpu*2", "--steps", "4", "--schedule", "xpipe", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    losses = [row["loss"] for row in result["steps"]]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert result["plan"]["schedule"] == "xpipe"
    assert [p["policy"] for p in result["plan"]["shared_params"]] == ["send"], "a replicated copy would drift"


@pytest.mark.processes  # torchrun's ranks
def test_compare_measures_through_the_distributed_runtime_when_launched():
    done = _cli("compare", *GPT_ARGS, "--micro-batches", "4", "--devices", "cpu*2", "--manual", 'cut=["blocks.4"]', "--measure",
                "--steps", "2", "--nproc-per-node", "2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)["candidates"]
    for row in rows:
        m = row["measured"]
        assert m["runtime"] == "distributed" and m["steps"] == 2 and m["median"] > 0
        assert m["predicted"] == row["plan"]["step_time"]


@pytest.mark.processes  # torchrun's ranks
def test_a_rank_that_fails_under_the_launcher_exits_2():
    done = _cli("run", *GPT_ARGS, "--devices", "cpu*2", "--dp", "1", "--nproc-per-node", "3", "--steps", "1")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "DistributedError" in done.stderr


WORKLOADS = '''
import torch

def tiny(batch=4):
    return torch.nn.Linear(4, 2), (torch.randn(batch, 4),)

def broken(batch=4):
    raise ValueError("width 3 is not a multiple of 4")
'''


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_workload_that_fails_to_import_or_build_exits_2_on_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "cli_workloads.py").write_text(WORKLOADS)
    (tmp_path / "cli_raises_on_import.py").write_text("raise RuntimeError('no GPU here\\nat all')\n")
    assert main(["plan", "cli_raises_on_import:make", "--devices", "cpu"]) == 2
    err = _one_line_error(capsys)
    assert "importing cli_raises_on_import raised RuntimeError: no GPU here at all" in err
    assert main(["plan", "cli_workloads:broken", "--batch", "8", "--devices", "cpu"]) == 2
    err = _one_line_error(capsys)
    assert "ConstraintError: the workload factory cli_workloads.broken(batch=8) raised ValueError: width 3 is not" in err
    assert main(["plan", "cli_workloads:missing", "--devices", "cpu"]) == 2
    assert "cli_workloads has no function 'missing'" in _one_line_error(capsys)


def test_manual_json_that_does_not_parse_is_an_error_not_a_partition_method(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "cli_workloads.py").write_text(WORKLOADS)
    args = ["compare", "cli_workloads:tiny", "--devices", "cpu*2", "--time-limit", "1", "--manual"]
    assert main([*args, 'cut={"0": beginning}']) == 2
    err = _one_line_error(capsys)
    assert "ConstraintError: --manual cut: " in err and "is not valid JSON: Expecting value at line 1 column 7 (character 6)" in err
    (tmp_path / "split.json").write_text("[[0], [1")
    assert main([*args, f"even=@{tmp_path / 'split.json'}"]) == 2
    assert f"--manual even (file {tmp_path / 'split.json'})" in _one_line_error(capsys)
    assert main([*args, f"gone=@{tmp_path / 'gone.json'}"]) == 2
    assert "cannot read the file: FileNotFoundError" in _one_line_error(capsys)


def test_plan_out_into_a_missing_folder_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "cli_workloads.py").write_text(WORKLOADS)
    out = tmp_path / "no" / "plan.json"
    assert main(["plan", "cli_workloads:tiny", "--devices", "cpu", "--out", str(out)]) == 2
    assert f"PlanFileError: cannot save the plan to {out}" in _one_line_error(capsys)


def test_plan_chooses_the_mesh_degrees_and_refuses_a_bad_degree(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", *GPT_ARGS, "--devices", "A100-80GB*2", "--data-parallel", "auto", "--replicate", "auto",
                 "--time-limit", "1", "--out", str(out)]) == 0
    assert "configurations tried" in capsys.readouterr().out
    made = autosplit.Plan.load(out)
    assert made.mesh["pp"] * made.data_parallel == 2
    assert main(["plan", *GPT_ARGS, "--devices", "A100-80GB*2", "--data-parallel", "two"]) == 2
    assert "data_parallel" in capsys.readouterr().err
    assert main(["plan", *GPT_ARGS, "--devices", "A100-80GB*2", "--tensor-parallel", "2", "--time-limit", "1", "--out", str(out)]) == 0
    assert autosplit.Plan.load(out).mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 2}
    assert "tensor parallel over tp 2" in capsys.readouterr().out


def test_run_starts_as_many_processes_as_a_given_plans_mesh_has_ranks(tmp_path):
    """``run --plan`` without ``--nproc-per-node`` starts pp × data-parallel copies × tp processes."""
    import argparse
    import dataclasses

    from autosplit.cli.commands import world_size
    from tests.helpers import GOLDEN

    plan = autosplit.Plan.load(GOLDEN / "gpt_a100x2_gpipe.plan.json")
    assert plan.mesh == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    dataclasses.replace(plan, tensor_parallel=2).save(tmp_path / "tp.json")
    assert world_size(argparse.Namespace(plan=None, dp=2), ["cpu"] * 3) == 3  # the devices are the whole mesh
    assert world_size(argparse.Namespace(plan=str(tmp_path / "tp.json"), dp=1), ["cpu"] * 3) == 4
    assert world_size(argparse.Namespace(plan=str(tmp_path / "tp.json"), dp=2), ["cpu"] * 3) == 8
