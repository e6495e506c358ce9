"""``examples/train_loop.py`` — warm-up, accumulation, clipping, evaluation in eval mode, a checkpoint
and a resume — on a 2-process pipeline under torchrun, interrupted and resumed, against the same loop
on the unsplit model run straight through, in float64: every step's loss, norm, LR and validation
loss, and the weights at the end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.processes  # torchrun's ranks (tests/conftest.py)
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_loop.py"


def _run(args: list[str], *, processes: int | None) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if processes is None:
        command = [sys.executable, str(SCRIPT), *args]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}",
                   f"--master-port={port}", str(SCRIPT), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_example_loop_on_a_resumed_pipeline_trains_like_the_unsplit_loop(tmp_path):
    common = ["--dtype", "float64", "--steps", "8", "--eval-every", "2"]
    _run([*common, "--unsplit", "--checkpoint", str(tmp_path / "u"), "--out", str(tmp_path / "unsplit")], processes=None)
    split = [*common, "--checkpoint", str(tmp_path / "s"), "--out", str(tmp_path / "split")]
    _run([*split, "--stop-after", "4"], processes=2)
    assert json.loads((tmp_path / "s" / "loop.json").read_text())["step"] == 4
    _run([*split, "--resume"], processes=2)

    expected = json.loads((tmp_path / "unsplit" / "log.json").read_text())
    got = json.loads((tmp_path / "split" / "log.json").read_text())
    assert [e["step"] for e in got] == list(range(8)) and sum("val_loss" in e for e in got) == 4
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-9 * max(1.0, abs(b[key])), f"step {b['step']} {key}: {a[key]} vs {b[key]}"
    assert expected[3]["lr"] == expected[4]["lr"] and expected[0]["lr"] < expected[1]["lr"], "warm-up, then constant"
    assert any(e["norm"] > 0.5 for e in expected), "clipping acts in some step (max norm 0.5)"
    split_weights = torch.load(tmp_path / "split" / "weights.pt")
    for name, value in torch.load(tmp_path / "unsplit" / "weights.pt").items():
        torch.testing.assert_close(split_weights[name], value, msg=lambda m, name=name: f"{name}: {m}")
