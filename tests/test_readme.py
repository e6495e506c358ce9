"""Every ```python snippet of README.md runs as written on the CPU quick-start machine.

The snippets are read from README.md when the tests run (never copied here), by the fence's
info string:

- ``python``: run in this process, in document order, in one namespace (the first snippet of
  "Use" defines the model, ``x``, ``y`` and ``loss_fn`` the others use), in a scratch folder;
- ``python torchrun``: a complete script, run under ``torchrun --nproc-per-node 2`` (gloo);
- ``python script``: a complete script, run with the interpreter as ``python file.py``;
- ``python skip-gpu``: needs CUDA, skipped without it. Any other marker fails, so a snippet
  is never left out silently.

The scripts run one after another on a background thread while the in-process snippets run
(the planner leaves the second core mostly idle), and each script's test waits for its result.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
KINDS = {"": "in-process", "torchrun": "torchrun", "script": "script", "skip-gpu": "needs CUDA"}
FENCE = re.compile(r"^```python(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)


@dataclass(frozen=True)
class Snippet:
    line: int
    """Line of the opening fence in README.md."""
    kind: str
    code: str
    section: str

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"


def snippets() -> list[Snippet]:
    text = README.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        headings = re.findall(r"^#+ (.+)$", text[: m.start()], re.M)
        out.append(Snippet(line, m["info"].strip(), m["code"], headings[-1] if headings else ""))
    return out


SNIPPETS = snippets()
IDS = [f"{s.line}-{s.kind or 'python'}" for s in SNIPPETS]


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOSPLIT_CACHE": str(tmp / "cache")}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def test_readme_has_snippets_of_known_kinds_only():
    assert len(SNIPPETS) >= 10, f"found {len(SNIPPETS)} python snippets in README.md"
    unknown = [f"{s.name}: ```python {s.kind}" for s in SNIPPETS if s.kind not in KINDS]
    assert not unknown, f"snippets with a marker the README test does not know: {unknown}"
    assert sum(s.kind == "" for s in SNIPPETS) >= 6 and any(s.kind == "torchrun" for s in SNIPPETS)
    skipped = [s.name for s in SNIPPETS if s.kind == "skip-gpu"]
    assert len(skipped) <= 1, f"skipping is for the rare snippet that needs a GPU: {skipped}"


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
    """The namespace the in-process snippets share, whether one of them failed, and the scripts running beside them."""

    def __init__(self, folder: Path, scripts: dict[int, Future]) -> None:
        self.folder = folder
        self.namespace: dict[str, Any] = {"__name__": "__main__"}
        self.failed: str | None = None
        self.scripts = scripts


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    old_cwd, old_cache = Path.cwd(), os.environ.get("AUTOSPLIT_CACHE")
    os.chdir(folder)  # the snippets write plan.json, compare.html
    os.environ["AUTOSPLIT_CACHE"] = str(folder / "cache")
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(max_workers=1)
    scripts = {
        s.line: pool.submit(_run_script, s, folder / f"script-{s.line}") for s in SNIPPETS if s.kind in ("torchrun", "script")
    }
    try:
        yield _Session(folder, scripts)
    finally:
        pool.shutdown(cancel_futures=True)
        os.chdir(old_cwd)
        torch.set_num_threads(threads)
        if old_cache is None:
            os.environ.pop("AUTOSPLIT_CACHE", None)
        else:
            os.environ["AUTOSPLIT_CACHE"] = old_cache


@pytest.mark.parametrize("snippet", SNIPPETS, ids=IDS)
def test_readme_snippet_runs_as_written(snippet: Snippet, session: _Session):
    if snippet.kind == "skip-gpu" and not torch.cuda.is_available():
        pytest.skip(f"{snippet.name} needs CUDA")
    if snippet.kind in ("", "skip-gpu"):
        if session.failed:
            pytest.fail(f"{snippet.name} continues from {session.failed}, which failed")
        try:
            exec(compile(snippet.code, snippet.name, "exec"), session.namespace)
        except BaseException:
            session.failed = snippet.name
            raise
        return
    if snippet.line not in session.scripts:
        pytest.fail(f"{snippet.name}: unknown marker ```python {snippet.kind}")
    done = session.scripts[snippet.line].result()
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

    blocks = re.findall(r"^```json split\.json\n(.*?)^```", README.read_text(), re.S | re.M)
    assert len(blocks) == 1, "README.md shows the --manual NAME=@split.json file once"
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
