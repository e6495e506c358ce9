"""The code is clean under the pinned ruff and mypy: the library, the tests, the benchmarks and the examples."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["autosplit", "tests", "benchmarks", "examples"]


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_the_code_is_clean_under_ruff_and_mypy(tool):
    exe = shutil.which(tool, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[test]')")
    args = [exe, "check", *CHECKED] if tool == "ruff" else [exe, *CHECKED]
    result = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
