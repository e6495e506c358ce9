"""The README's torchrun example runs as written (2 processes, CPU, gloo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_torchrun_example_trains_on_two_processes():
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "examples/pipeline_gpt.py", "--steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "autosplit plan:" in result.stdout
    losses = [float(line.rsplit(" ", 1)[-1]) for line in result.stdout.splitlines() if ": loss " in line]
    assert len(losses) == 2 and losses[1] < losses[0], result.stdout[-2000:]
