"""One function of a benchmark, called in a fresh interpreter: its peak RSS is then its own, and
nothing it imports or caches carries over to the next case.

Usage::

    row = in_fresh_process("benchmarks.plan_3d:_plan_row", "recipe", 5.0)   # its dict, or a "crashed" one
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["in_fresh_process"]

ROOT = Path(__file__).resolve().parents[1]
_CODE = ("import importlib, json, sys; sys.path.insert(0, sys.argv[1]); module, name = sys.argv[2].split(':'); "
         "print('ROW' + json.dumps(getattr(importlib.import_module(module), name)(*json.loads(sys.argv[3]))))")


def in_fresh_process(function: str, *args: Any, timeout: float = 1800) -> dict[str, Any]:
    """``function`` (``"package.module:name"``, returning a JSON-able dict) called with ``args`` (JSON-able)
    in a new interpreter; ``{"outcome": "crashed", "stderr": ...}`` when it printed no result,
    ``{"outcome": "timed out", "total_s": timeout}`` when it ran past ``timeout`` seconds (then killed)."""
    try:
        out = subprocess.run([sys.executable, "-c", _CODE, str(ROOT), function, json.dumps(args)],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"outcome": "timed out", "total_s": timeout}
    line = next((x for x in out.stdout.splitlines() if x.startswith("ROW")), None)
    return json.loads(line[3:]) if line else {"outcome": "crashed", "stderr": out.stderr[-2000:]}
