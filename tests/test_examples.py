"""The README's torchrun examples run as written (CPU, gloo), quietly, and `autosplit run` reports
a typed error once, not once per rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # torchrun's ranks (tests/conftest.py)
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _example(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "examples/pipeline_gpt.py", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(),
    )


def _losses(stdout: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[-1]) for line in stdout.splitlines() if ": loss " in line]


def test_readme_torchrun_example_trains_on_two_processes():
    result = _example(2, "--steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "autosplit plan:" in result.stdout
    losses = _losses(result.stdout)
    assert len(losses) == 2 and losses[1] < losses[0], result.stdout[-2000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_data_parallel_example_trains_without_fsdp_view_warnings():
    # Stage 0 of this GPT ends with a Linear on a 3-D input (a view of its 2-D product), which
    # FSDP2 warned about on every forward of every replica: the runtime filters exactly that.
    result = _example(4, "--dp", "2", "--steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    steps: dict[int, dict[int, float]] = {}  # step → replica → the last stage's loss (each replica its own rows)
    # two ranks print at once: a line may run into the next, so the records are found wherever they are
    for replica, step, loss in re.findall(r"replica (\d+)\) step (\d+): loss (\d+\.\d{4})", result.stdout):
        steps.setdefault(int(step), {})[int(replica)] = float(loss)
    assert sorted(steps) == [0, 1] and all(sorted(v) == [0, 1] for v in steps.values()), result.stdout[-2000:]
    assert sum(steps[1].values()) < sum(steps[0].values()), result.stdout[-2000:]
    assert "view tensor" not in result.stderr and "Warning" not in result.stderr, result.stderr[-3000:]


def test_autosplit_run_prints_a_typed_error_once_not_once_per_rank():
    done = subprocess.run(
        [sys.executable, "-m", "autosplit", "run", "no.such.module:gpt", "--devices", "cpu*2", "--steps", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={k: v for k, v in _env().items() if k != "OMP_NUM_THREADS"},
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("autosplit: ConstraintError: cannot load the workload") == 1, done.stderr[-3000:]
    assert "OMP_NUM_THREADS" not in done.stderr  # torchrun's banner: the launch sets its default itself
