"""Typed-JSON decoding: a plan file's objects read as the dataclasses they were written from.

Each field is read as its annotated type (``int``, ``float``, ``str``, ``bool``, tuples, mappings,
``X | None`` and nested dataclasses), so a plan file that was edited or truncated fails on load
with a :class:`~autosplit.errors.PlanFileError` naming the first wrong field, its value and the
type expected — never later, deep inside the planner or the runtime.

Usage::

    plan = readread_record(Plan, json.loads(text), "", "plan.json")
"""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import types
import typing
from collections.abc import Mapping
from typing import Any

from autosplit.errors import PlanFileError, advice

__all__ = ["JSON_KINDS", "read_record"]

JSON_KINDS = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "a list", tuple: "a list", dict: "an object"}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _wrong_type(source: str, path: str, value: object, expected: str) -> PlanFileError:
    found = f"a list of {len(value)}" if isinstance(value, (list, tuple)) else JSON_KINDS.get(type(value), type(value).__name__)
    return PlanFileError(advice(
        f"{source}: field {path} = {reprlib.repr(value)} is {found}, expected {expected}",
        "the file was edited, or written by hand", "re-plan the model, or restore the file from where it was saved",
    ))


def _expected(hint: Any) -> str:
    """What a field of type ``hint`` looks like in JSON, in words."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_expected(a) for a in args)
    if origin is tuple:
        return "a list" if args[-1] is Ellipsis else f"a list of {len(args)}"
    return "an object" if origin is Mapping or dataclasses.is_dataclass(hint) else JSON_KINDS[hint]


def _field(value: Any, hint: Any, path: str, source: str, expected: str | None = None) -> Any:
    """``value`` read as a field of type ``hint``, or a :class:`PlanFileError` naming ``path``, the type and the value."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):  # X | None
        if value is None:
            return None
        return _field(value, next(a for a in args if a is not type(None)), path, source, _expected(hint))
    if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
        return read_record(typing.cast(type, hint), value, path, source)
    if origin is tuple and isinstance(value, (list, tuple)):
        items = args[:1] * len(value) if args[-1] is Ellipsis else args
        if len(items) == len(value):
            return tuple(_field(v, h, f"{path}[{i}]", source) for i, (v, h) in enumerate(zip(value, items)))
    elif origin is Mapping and isinstance(value, Mapping):
        return {_field(k, args[0], f"{path} key", source): _field(v, args[1], f"{path}[{k!r}]", source) for k, v in value.items()}
    elif isinstance(value, bool):
        if hint is bool:
            return value
    elif hint is float and isinstance(value, (int, float)):
        return float(value)
    elif hint is int and (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        return int(value)  # a count written as 8.0 is still 8
    elif hint is str and isinstance(value, str):
        return value
    raise _wrong_type(source, path, value, expected or _expected(hint))


def read_record(cls: type, data: Mapping, path: str, source: str) -> Any:
    """An instance of the dataclass ``cls`` from the JSON object ``data``: no unknown fields, no required field missing."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = f"{path}." if path else ""
    unknown = sorted(str(k) for k in data if k not in fields)
    missing = [n for n, f in fields.items()
               if n not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if unknown or missing:
        what = f"unknown field {where + unknown[0]!r}" if unknown else f"required field {where + missing[0]!r} is missing"
        raise PlanFileError(advice(
            f"{source}: {what} ({cls.__name__} has fields {list(fields)})",
            "the file was edited, truncated or written by hand",
            "re-plan the model, or restore the file from where it was saved",
        ))
    hints = _hints(cls)
    return cls(**{name: _field(value, hints[name], f"{where}{name}", source) for name, value in data.items()})
