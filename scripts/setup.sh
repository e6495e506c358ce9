#!/usr/bin/env bash
# Create .venv with everything autosplit needs. Safe to re-run.
# torch is pinned here (and only here) so pip takes the CPU build present on the machine
# instead of resolving `torch>=2.4` to the newest CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
# torch pinned again in the same resolve as the test extras: megatron-core and torchtitan depend on torch, and a
# separate resolve could replace the CPU build with the newest CUDA one.
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[test]"
# Bytecode for the project's own modules, written once here: where PYTHONDONTWRITEBYTECODE is set, every process
# (each torchrun rank, each test's subprocess) would otherwise compile them from source again (about 0.25 s each).
.venv/bin/python -m compileall -q autosplit tests benchmarks examples >/dev/null
