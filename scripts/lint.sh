#!/usr/bin/env bash
# The code is clean under the pinned ruff and mypy (pyproject.toml's test extras, installed into .venv
# by scripts/setup.sh): the library, the tests, the benchmarks and the examples. .ci/run runs this as
# its own step before the tests; .pre-commit-config.yaml runs the same two on commit.
set -uo pipefail
cd "$(dirname "$0")/.."
CHECKED=(autosplit tests benchmarks examples)
status=0
.venv/bin/ruff check "${CHECKED[@]}" || status=1
.venv/bin/mypy "${CHECKED[@]}" || status=1
exit $status
