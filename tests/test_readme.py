"""Every ```python snippet of README.md and of the pages under docs/ runs as written on the CPU
quick-start machine, and the docs name exactly the results files kept under benchmarks/results/.

The snippets are read from the pages when the tests run (never copied here), by the fence's info
string:

- ``python``: run in this process, in page order, in one namespace per page (README.md's first
  snippet of "Use" defines the model, ``x``, ``y`` and ``loss_fn`` its others use; a docs page
  defines what its own snippets use), in a scratch folder;
- ``python torchrun``: a complete script, run under ``torchrun --nproc-per-node 2`` (gloo);
- ``python script``: a complete script, run with the interpreter as ``python file.py``;
- ``python skip-gpu``: needs CUDA, skipped without it. Any other marker fails, so a snippet
  is never left out silently.

A script runs in its own test, a ``torchrun`` one in the group of tests that start processes
(``tests/conftest.py``), which run on one worker beside the in-process snippets.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
"""README.md first, then the docs pages by name: the order the snippets run in."""
RESULTS = ROOT / "benchmarks" / "results"
KINDS = {"": "in-process", "torchrun": "torchrun", "script": "script", "skip-gpu": "needs CUDA"}
FENCE = re.compile(r"^```python(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)


@dataclass(frozen=True)
class Snippet:
    page: str
    """The page's path from the repository root (``README.md``, ``docs/schedules.md``)."""
    line: int
    """Line of the opening fence in the page."""
    kind: str
    code: str
    section: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def snippets() -> list[Snippet]:
    out = []
    for path in PAGES:
        text, page = path.read_text(), path.relative_to(ROOT).as_posix()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            headings = re.findall(r"^#+ (.+)$", text[: m.start()], re.M)
            out.append(Snippet(page, line, m["info"].strip(), m["code"], headings[-1] if headings else ""))
    return out


SNIPPETS = snippets()
IDS = [f"{s.page}:{s.line}-{s.kind or 'python'}" for s in SNIPPETS]


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOSPLIT_CACHE": str(tmp / "cache")}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def test_readme_has_snippets_of_known_kinds_only():
    assert len(SNIPPETS) >= 10, f"found {len(SNIPPETS)} python snippets in README.md and docs/"
    unknown = [f"{s.name}: ```python {s.kind}" for s in SNIPPETS if s.kind not in KINDS]
    assert not unknown, f"snippets with a marker the README test does not know: {unknown}"
    readme = [s for s in SNIPPETS if s.page == "README.md"]
    assert sum(s.kind == "" for s in readme) >= 3 and [s.kind for s in readme].count("torchrun") == 1, (
        "README.md shows the two API tiers in process and one torchrun script")
    skipped = [s.name for s in SNIPPETS if s.kind == "skip-gpu"]
    assert len(skipped) <= 1, f"skipping is for the rare snippet that needs a GPU: {skipped}"


def test_the_docs_read_every_results_file_kept_and_only_those():
    """benchmarks/results/ keeps one file per benchmark, the one the docs read their figures from."""
    named = {m for page in PAGES for m in re.findall(r"benchmarks/results/([\w.-]+\.json)", page.read_text())}
    kept = {p.name for p in RESULTS.glob("*.json")}
    assert named <= kept, f"the docs read results files that are not kept: {sorted(named - kept)}"
    assert kept <= named, f"results files no page reads (move or delete them): {sorted(kept - named)}"


def test_relative_links_of_the_pages_resolve():
    broken = [f"{page.relative_to(ROOT)}: {link}" for page in PAGES
              for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text())
              if not (page.parent / link).exists()]
    assert not broken, f"links to files that do not exist: {broken}"


def _command(snippet: Snippet, path: Path) -> list[str]:
    if snippet.kind == "torchrun":
        return [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", str(path)]
    return [sys.executable, str(path)]


def _run_script(snippet: Snippet, folder: Path) -> subprocess.CompletedProcess:
    folder.mkdir()
    path = folder / "snippet.py"
    path.write_text(snippet.code)
    return subprocess.run(_command(snippet, path), cwd=folder, env=_env(folder), capture_output=True, text=True, timeout=300)


class _Session:
    """The namespaces the in-process snippets share (one per page), and which failed."""

    def __init__(self) -> None:
        self.namespaces: dict[str, dict[str, Any]] = {}
        """Per page: the namespace its in-process snippets share."""
        self.failed: dict[str, str] = {}
        """Per page: the first of its in-process snippets that failed."""


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    old_cwd, old_cache = Path.cwd(), os.environ.get("AUTOSPLIT_CACHE")
    os.chdir(folder)  # the snippets write plan.json, compare.html
    os.environ["AUTOSPLIT_CACHE"] = str(folder / "cache")
    try:
        yield _Session()
    finally:
        os.chdir(old_cwd)
        if old_cache is None:
            os.environ.pop("AUTOSPLIT_CACHE", None)
        else:
            os.environ["AUTOSPLIT_CACHE"] = old_cache


def _marks(snippet: Snippet) -> tuple[pytest.MarkDecorator, ...]:
    """A script is slow (a process of its own); a torchrun script starts processes (``tests/conftest.py``)."""
    return {"torchrun": (pytest.mark.slow, pytest.mark.processes), "script": (pytest.mark.slow,)}.get(snippet.kind, ())


@pytest.mark.parametrize("snippet", [pytest.param(s, marks=_marks(s)) for s in SNIPPETS], ids=IDS)
def test_readme_snippet_runs_as_written(snippet: Snippet, request: pytest.FixtureRequest, tmp_path: Path):
    if snippet.kind == "skip-gpu" and not torch.cuda.is_available():
        pytest.skip(f"{snippet.name} needs CUDA")
    if snippet.kind in ("", "skip-gpu"):
        session: _Session = request.getfixturevalue("session")  # a script needs none
        if snippet.page in session.failed:
            pytest.fail(f"{snippet.name} continues from {session.failed[snippet.page]}, which failed")
        namespace = session.namespaces.setdefault(snippet.page, {"__name__": "__main__"})
        try:
            exec(compile(snippet.code, snippet.name, "exec"), namespace)
        except BaseException:
            session.failed[snippet.page] = snippet.name
            raise
        return
    if snippet.kind not in ("torchrun", "script"):
        pytest.fail(f"{snippet.name}: unknown marker ```python {snippet.kind}")
    done = _run_script(snippet, tmp_path / "script")
    how = " ".join(_command(snippet, Path("snippet.py")))
    assert done.returncode == 0, (
        f"{snippet.name} ({snippet.section}), run as `{how}`, failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    noise = [line for line in done.stderr.splitlines() if "Warning" in line]
    assert not noise, f"{snippet.name} printed warnings:\n" + "\n".join(noise)


# -- what a README reader tripped over -----------------------------------------------------------
def test_readme_split_json_and_every_manual_form_it_names_run_with_the_cli(tmp_path, capsys):
    import json

    from autosplit.cli import main

    blocks = re.findall(r"^```json split\.json\n(.*?)^```", (ROOT / "docs" / "cli.md").read_text(), re.S | re.M)
    assert len(blocks) == 1, "docs/cli.md shows the --manual NAME=@split.json file once"
    split = tmp_path / "split.json"
    split.write_text(blocks[0])
    forms = {"even": f"@{split}", "balance": "[6, 6]", "cut": '{"blocks.4": "beginning"}', "points": '["blocks.4"]',
             "ds": '"parameters"'}
    args = ["compare", "autosplit.examples:gpt", "--batch", "4", "--time-limit", "2", "--devices", "cpu*2", "--json"]
    assert main([*args, *(a for name, form in forms.items() for a in ("--manual", f"{name}={form}"))]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["candidates"]}
    assert all(rows[name]["feasible"] for name in forms)
    even = rows["even"]["plan"]["assignment"]
    assert all(rows[name]["plan"]["assignment"] == even for name in ("balance", "cut", "points"))


def test_measure_stages_says_what_it_takes_when_given_a_count():
    import autosplit
    from autosplit.microbatch import split_batch

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    x = torch.randn(8, 16)
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(x,))
    shape = r"(?s).+\. Likely cause: .+\. Try: .+\."
    for wrong, says in [
        (4, "got int 4, not a list of micro-batches"),
        (x, "got Tensor of shape (8, 16), not a list of micro-batches"),
        ([x, x], "micro_batches[0] is Tensor of shape (8, 16), not an (args, kwargs) pair"),
        ([], "got no micro-batches"),
    ]:
        with pytest.raises(autosplit.errors.ConstraintError, match=shape) as e:
            autosplit.calibration.measure_stages(split, wrong)
        assert says in str(e.value) and "split_batch((x,), {}, split.plan.micro_batches)" in str(e.value)
    with pytest.raises(autosplit.errors.ConstraintError, match="steps=0 is not an integer ≥ 1"):
        autosplit.calibration.measure_stages(split, split_batch((x,), {}, 2), steps=0)
    with pytest.raises(autosplit.errors.ConstraintError, match="not a SplitModule"):
        autosplit.calibration.measure_stages(model, split_batch((x,), {}, 2))
    got = autosplit.calibration.measure_stages(split, split_batch((x,), {}, split.plan.micro_batches), steps=1, warmup=0)
    assert len(got) == 2 and all(m.forward > 0 and m.peak_bytes > 0 for m in got)
