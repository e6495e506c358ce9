"""Byte sizes as people write them (``"20GiB"``) and read them back. No torch here."""

from __future__ import annotations

import re

from autosplit.errors import DeviceError, advice

__all__ = ["GiB", "parse_bytes", "format_bytes"]

GiB = 1024**3

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """``"20GiB"`` → 21474836480; numbers pass through. Decimal (GB) and binary (GiB) units."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise DeviceError(advice(
                f"memory size {value} is not positive", "a cap is a number of bytes > 0", "write it like '20GiB' or 8 * 2**30"
            ))
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise DeviceError(advice(
            f"cannot read memory size {value!r}", "a size is a number with an optional unit (kB, MB, GB, KiB, MiB, GiB, TiB)",
            "write it like '20GiB', '512MiB', '16GB' or an int of bytes",
        ))
    return parse_bytes(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
