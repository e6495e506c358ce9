#!/usr/bin/env bash
# Check autosplit against another torch: scripts/check_torch.sh VERSION
#
# Sets up .venv-torch-VERSION (git-ignored) with torch==VERSION as the package registry serves it
# (for Linux x86-64 that is the CUDA build, which runs on a CPU-only machine) and the project's other
# dependencies as pyproject.toml declares them, then runs a fast subset of the suite on it with this
# tree on PYTHONPATH: capture, plan, one 2-process pipeline, checkpoints (CHECKS below). Prints one
# line "torch VERSION: PASS" or "torch VERSION: FAIL (...)" last, and exits 0 or 1 (2: usage, or the
# venv could not be set up). Safe to re-run: an existing venv with that torch is reused.
#
#   scripts/check_torch.sh 2.14.1              # the newest torch the registry serves (as of this writing)
#   KEEP_GOING=1 scripts/check_torch.sh 2.14.1 # run every check instead of stopping at the first failure
set -uo pipefail
VERSION=${1:-}
if [[ -z "$VERSION" || "$VERSION" == -* ]]; then
    echo "usage: scripts/check_torch.sh VERSION   (e.g. 2.14.1)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=.venv-torch-$VERSION
PY=${PYTHON:-python3}

CHECKS=(
    # capture: symbolic trace, export fallback, annotations (fake tensors, flop counting, pytree)
    tests/passes/test_capture.py
    # plan: the planner end to end (capture → annotate → estimate → solve → codegen) and split = unsplit
    "tests/api/test_planner.py"
    "tests/runtime/test_equivalence.py::test_tied_embedding_is_one_parameter_on_one_device"
    "tests/runtime/test_equivalence.py::test_module_called_twice_and_in_place_writes_stay_with_their_tensor"
    # one 2-process pipeline (gloo, torch.distributed.pipelining), and checkpoints (DCP) moving between
    # the distributed and the unsplit model
    "tests/runtime/test_distributed_faults.py::test_checkpoints_move_between_the_distributed_and_the_unsplit_model"
    "tests/runtime/test_materialise.py::test_a_checkpoint_saved_under_one_plan_resumes_under_others_and_in_the_unsplit_model"
)

setup() {
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" || return 1
    if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; then
        echo "installing torch==$VERSION into $VENV (the registry's build; this can take a while)"
        "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
        "$VENV/bin/python" -m pip install -q "torch==$VERSION" || return 1
    fi
    # The project's declared dependencies other than torch (read from pyproject.toml, so this list is
    # never a second copy), and the test runner; not the project itself: this tree is on PYTHONPATH.
    mapfile -t DEPS < <("$VENV/bin/python" - <<'EOF'
import re
text = open("pyproject.toml").read()  # (no tomllib: Python 3.10 has none)
deps = re.findall(r'^\s*"([^"]+)",', re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1), re.M)
test = re.findall(r'"([^"]+)"', re.search(r"^test = \[(.*?)\]", text, re.M).group(1))
name = lambda d: re.split(r"[<>=!~ \[]", d, maxsplit=1)[0]
for dep in [*deps, *(d for d in test if name(d) in ("pytest", "hypothesis", "pytest-timeout", "transformers"))]:
    if name(dep) != "torch":
        print(dep)
EOF
    )
    "$VENV/bin/python" -m pip install -q "${DEPS[@]}" || return 1
}

if ! setup; then
    echo "torch $VERSION: FAIL (could not set up $VENV)"
    exit 2
fi

export PYTHONPATH=$ROOT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$VENV/bin/python" -c "import torch, autosplit; print('checking autosplit with torch', torch.__version__, 'from', torch.__file__)"
STOP=(-x)
[ -n "${KEEP_GOING:-}" ] && STOP=()
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --tb=short --show-capture=no "${STOP[@]}" "${CHECKS[@]}"
rc=$?
if [ $rc -eq 0 ]; then
    echo "torch $VERSION: PASS"
    exit 0
fi
echo "torch $VERSION: FAIL (pytest exit $rc)"
exit 1
