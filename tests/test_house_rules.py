"""The house rules of DESIGN §3 and §5 that a machine can check, on every module of ``autosplit/``.

- No module is over :data:`MODULE_LINES` lines: a module that grows past it is split along its seams.
- No function or method is over :data:`FUNCTION_LINES` lines, counted by the AST from its first
  decorator (or its ``def``) to its last line, docstring and comments included: a longer one is cut
  into named helpers along its steps.
- Every module has an ``__all__`` (``[]`` where it exports nothing), a literal list of names, each
  bound at the module's top level (defined there or imported).
- Every reference to the package in the docstrings and comments of ``autosplit/``, in
  ``README.md`` and in ``docs/*.md`` resolves, so none goes stale when code moves:

  - dotted names ``autosplit.x.y…``: the longest importable prefix is imported, the rest are
    attributes (a dataclass field, an annotated attribute or one set on ``self`` count); a class or
    function a module only imports is cited where it is defined, unless the module exports it
    (``__all__``: ``autosplit.Plan``, ``autosplit.plans.StageReport``);
  - Sphinx roles (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``, ``:data:``,
    ``:exc:``, ``:obj:``): qualified targets as dotted names, relative ones (``.steps.codegen``)
    from the module's package, unqualified ones among the module's names or its classes' attributes;
  - file paths: ``autosplit/…``, ``tests/…``, ``benchmarks/…``, ``examples/…`` and ``docs/…`` from
    the repository, and a room's (``runtime/stage.py``) from ``autosplit/``, as ``docs/architecture.md``
    writes them; ``room/module.name`` and ``room/module.py::name`` name an attribute of that module.
    A slash between plain words outside backticks ("autosplit/torchtitan ratios") is not a path.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autosplit"
MODULE_LINES = 450
FUNCTION_LINES = 80
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("autosplit", "tests", "benchmarks", "examples", "docs")
ROOMS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())

DOTTED = re.compile(r"(?<![\w./-])autosplit(?:\.\w+)+")
ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`~?([\w.]+)`")
PATH = re.compile(
    r"(?<![\w./-])((?:" + "|".join((*TOP, *ROOMS)) + r")/[\w/-]*\w(?:\.py\b(?:::\w+(?:\.\w+)*)?|(?:\.[\w-]+)+)?/?)(?![{*\w])"
)


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines (split them along their seams): {long}"


def test_no_function_is_over_80_lines():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - first + 1
                if lines > FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {FUNCTION_LINES} lines (cut them into named helpers): {long}"


def _bound(body: list[ast.stmt]) -> Iterator[str]:
    """The names a module's top-level statements bind (those under top-level ``if``/``try``/``with`` too)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                yield from (n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import):
            yield from (a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield from (a.asname or a.name for a in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                yield from _bound(block)


def test_every_module_has_all_and_each_name_in_it_is_defined():
    bad = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        declared = [n for n in tree.body if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)]
        where = path.relative_to(ROOT)
        if not declared:
            bad.append(f"{where}: no __all__")
            continue
        value = declared[-1].value
        if not isinstance(value, (ast.List, ast.Tuple)) or not all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts
        ):
            bad.append(f"{where}: __all__ is not a literal list of names")
            continue
        names = set(_bound(tree.body))
        bad += [f"{where}: __all__ names {e.value!r}, which it does not define" for e in value.elts if e.value not in names]
    assert not bad, bad


# -- references ----------------------------------------------------------------------------------


def _texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring (attribute docstrings too) and every comment of a module."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def _has(obj: Any, name: str) -> bool:
    """``obj.name`` exists, or ``obj`` is a class that declares it (a dataclass field or annotation
    anywhere in its MRO) or sets it on ``self``."""
    if hasattr(obj, name):
        return True
    if not inspect.isclass(obj):
        return False
    for cls in obj.__mro__:
        if name in getattr(cls, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{name}\b\s*(:[^=\n]*)?=", source):
            return True
    return False


def _attributes(obj: Any, prefix: str, attributes: list[str]) -> str | None:
    for attribute in attributes:
        if not _has(obj, attribute):
            return f"{prefix} has no {attribute!r}"
        prefix, obj = f"{prefix}.{attribute}", getattr(obj, attribute, None)
        if obj is None:  # declared, not set on the class: nothing further to look into
            return None
    return None


def _resolve(dotted: str) -> str | None:
    """None if ``dotted`` names a module of the package and attributes of it, else why not."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name == "autosplit.__main__":  # importing it runs the command line
            return None
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not name.startswith(e.name):
                raise
            continue
        return _imported_only(module, name, parts[i:]) or _attributes(module, name, parts[i:])
    return f"no module {parts[0]!r}"


def _imported_only(module: Any, name: str, attributes: list[str]) -> str | None:
    """Why ``name.attributes[0]`` is not the thing's home: a class or function the module only
    imports (not in its ``__all__``, as a room's public names are) is cited where it is defined."""
    if not attributes or not hasattr(module, attributes[0]):
        return None
    value = getattr(module, attributes[0])
    home = getattr(value, "__module__", None) if inspect.isclass(value) or inspect.isfunction(value) else None
    if home is None or home == name or attributes[0] in getattr(module, "__all__", ()):
        return None
    return f"{name} only imports {attributes[0]!r}: cite {home}.{'.'.join(attributes)}"


def _local(module: str, target: str) -> str | None:
    """An unqualified role target: a name of ``module`` (then its attributes), or an attribute of a class defined there."""
    if module == "autosplit.__main__":
        return None
    namespace = importlib.import_module(module)
    first, *rest = target.split(".")
    if _has(namespace, first):
        return _attributes(getattr(namespace, first), f"{module}.{first}", rest)
    classes = [v for v in vars(namespace).values() if inspect.isclass(v) and v.__module__ == module]
    if not rest and any(_has(cls, first) for cls in classes):
        return None
    return f"{module} has no {first!r} (qualify it: :role:`~autosplit.room.module.{target}`)"


def _path(text: str, match: re.Match) -> str | None:
    path = match.group(1).rstrip("/")
    last = path.rsplit("/", 1)[-1]
    quoted = match.start() > 0 and text[match.start() - 1] == "`"
    if not quoted and "." not in last and not match.group(1).endswith("/"):
        return None  # words joined by a slash, not a path
    base = ROOT if path.split("/")[0] in TOP else PACKAGE
    if "::" in path:
        file, attribute = path.split("::")
        return f"no file {file}" if not (base / file).is_file() else _resolve(f"{_name(base / file)}.{attribute}")
    if (base / path).exists() or (base / f"{path}.py").is_file():
        return None
    if "." not in last:
        return f"no file, folder or module {path} (under {base.relative_to(ROOT.parent)})"
    module, *attributes = last.split(".")
    file = base / path.rsplit("/", 1)[0] / f"{module}.py"
    if not file.is_file():
        return f"no file {path}, nor a module {file.relative_to(ROOT)}"
    return _resolve(".".join([_name(file), *attributes]))


def _stale(where: str, text: str, package: str, module: str) -> Iterator[str]:
    for match in DOTTED.finditer(text):
        if why := _resolve(match.group(0)):
            yield f"{where}: {match.group(0)}: {why}"
    for match in ROLE.finditer(text):
        target = match.group(1)
        if target.startswith("autosplit."):
            why = _resolve(target)
        elif target.startswith("."):
            up = len(target) - len(target.lstrip("."))
            base = package.split(".")[: len(package.split(".")) - up + 1]
            why = _resolve(".".join([*base, target.lstrip(".")]))
        else:
            why = _local(module, target)
        if why:
            yield f"{where}: {match.group(0)}: {why}"
    for match in PATH.finditer(text):
        if why := _path(text, match):
            yield f"{where}: {match.group(1)}: {why}"


def test_every_reference_in_docstrings_comments_and_docs_resolves():
    stale = []
    for path in _modules():
        module = _name(path)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for line, text in _texts(path):
            stale += _stale(f"{path.relative_to(ROOT)}:{line}", text, package, module)
    for page in DOCS:
        for line, text in enumerate(page.read_text().splitlines(), 1):
            stale += _stale(f"{page.relative_to(ROOT)}:{line}", text, "autosplit", "autosplit")
    assert not stale, "stale references (the code moved; say where it is now):\n" + "\n".join(stale)
