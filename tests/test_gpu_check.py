"""``benchmarks/gpu_check.py`` refuses clearly where there is no CUDA GPU: a typed error on stderr,
exit code 2, nothing written. (Its GPU path runs only on a GPU; ``--cpu-smoke`` runs the same code
on CPU with tiny models, marked slow here.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def test_without_cuda_it_refuses_with_a_typed_error_and_exit_code_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_check: DeviceError: benchmarks/gpu_check.py needs a CUDA GPU")
    assert "torch.cuda.is_available() is False" in err and "Try: run it on a machine with an NVIDIA GPU" in err
    assert not out.exists()


def test_the_script_refuses_from_the_command_line_where_no_gpu_is_visible(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "DeviceError" in done.stderr and "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.slow
def test_the_cpu_smoke_run_checks_split_equals_unsplit_and_writes_its_results(tmp_path):
    out = tmp_path / "smoke.json"
    assert gpu_check.main(["--cpu-smoke", "--models", "gpt", "--steps", "2", "--timed-steps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    fp32, bf16, fp8 = result["cases"]
    assert result["passed"] and fp32["equivalence"]["ok"] and bf16["equivalence"]["ok"] and fp8["equivalence"]["ok"]
    assert fp8["float8_linears"] == 8  # every block's four linears, the tied head kept in bf16
    assert fp32["costs_by_op"]["by_op"] and fp32["costs_by_op"]["roofline"] == "H100-80GB"
    assert fp32["step"]["predicted_s"] > 0 and fp32["memory"]["predicted_bytes"] > 0
