"""``import autosplit`` loads its names on first use; planning loads the planner's rooms, not the multi-process runtime, the
solvers or the FLOP counter."""

from __future__ import annotations

import subprocess
import sys

import pytest

DEFERRED = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.pipelining", "torch.distributed.tensor")
LIBRARIES = ("ortools", "pandas", "networkx", "transformers", "triton", "torch.utils.flop_counter")
"""What planning loads where a path first needs it: the solvers (OR-Tools imports pandas), networkx's graph
algorithms, transformers, and torch's FLOP counter (which imports triton where installed)."""


def test_importing_autosplit_leaves_the_runtimes_heavy_imports_for_their_first_use():
    """``torch.distributed.pipelining`` pulls in ``torch._dynamo``, FSDP and DTensor (seconds of imports): they load when
    ``autosplit.distribute`` is first touched, and then it is the function of ``autosplit.api.distributed``."""
    code = (
        "import sys, autosplit\n"
        f"print(sorted(m for m in {DEFERRED!r} if m in sys.modules))\n"
        "from autosplit.api.distributed import distribute\n"
        "print(autosplit.distribute is distribute, autosplit.api.distributed.distribute is distribute)\n"
        f"print(sorted(m for m in {DEFERRED!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "[]", out
    assert out[1] == "True True"
    assert out[2] == str(sorted(DEFERRED))


def test_importing_autosplit_leaves_the_solvers_and_counters_for_their_first_use():
    code = f"import sys, autosplit\nprint(sorted(m for m in {LIBRARIES!r} if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["[]"], out


def test_the_package_loads_its_names_on_first_use_and_the_planner_no_more_than_planning_needs():
    """``import autosplit`` is the package alone (not even torch); touching a verb loads its room; ``autosplit.plan``
    loads the planner (torch, capture, costs, the solvers' front ends) and still none of the deferred imports;
    a room loads by attribute (``autosplit.report``)."""
    code = (
        "import sys, autosplit\n"
        "print(sorted(m for m in ('torch', 'autosplit.api.planner', 'autosplit.report') if m in sys.modules))\n"
        "from autosplit.api.planner import plan\n"
        "print(autosplit.plan is plan, autosplit.report.plan_report.__module__, 'plan' in dir(autosplit))\n"
        f"print(sorted(m for m in {DEFERRED + LIBRARIES!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["[]", "True autosplit.report.text True", "[]"], out


def test_a_name_the_package_does_not_have_is_refused_by_name():
    import autosplit
    from autosplit.errors import UnknownNameError

    with pytest.raises(UnknownNameError, match="'no_such_verb'"):
        autosplit.no_such_verb  # noqa: B018
