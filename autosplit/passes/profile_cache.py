"""The profile cache: profiles kept on disk as JSON, keyed by what their measurements depend on.

A profile is cached under ``cache_dir`` (default ``$AUTOSPLIT_CACHE`` or ``~/.cache/autosplit``),
in a file named by the digest of its key: graph fingerprint, device name, dtypes, input shapes,
threads, warm-up and repeats, torch version, and what the caller adds (the optimizer, the
schedule's order), so a restart does not profile again. A file measured under another key, or
unreadable, is ignored and measured again; files are replaced atomically.

Usage::

    key = profile_key(captured, inputs, device, fingerprint, options)
    path = cache_path(key, options)
    cached = load(path, key, Profile.from_json)     # None: measure, then
    store(path, profile.to_json())
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from autosplit.compat import pytree
from autosplit.options import ProfileOptions
from autosplit.passes.capture import Captured

__all__ = ["SCHEMA", "cache_path", "load", "profile_key", "store"]

log = logging.getLogger(__name__)

T = TypeVar("T")

SCHEMA = 7  # bump when what a profile measures changes: older cache files are then ignored


def _cache_dir(options: ProfileOptions) -> Path:
    root = options.cache_dir or os.environ.get("AUTOSPLIT_CACHE") or Path.home() / ".cache" / "autosplit"
    return Path(root) / "profiles"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        import platform

        return f"cpu:{platform.processor() or platform.machine()}"
    return str(device)


def profile_key(captured: Captured, inputs: Sequence[Any], device: torch.device, fingerprint: str, options: ProfileOptions) -> dict:
    tensors = [t for t in pytree.tree_leaves(list(inputs)) if isinstance(t, torch.Tensor)]
    dtypes = sorted({str(p.dtype) for p in captured.gm.parameters()} | {str(t.dtype) for t in tensors})
    return {
        "schema": SCHEMA,
        "fingerprint": fingerprint,
        "device": _device_name(device),
        "dtypes": dtypes,
        "input_shapes": [list(t.shape) for t in tensors],
        "threads": options.threads or torch.get_num_threads(),
        "warmup": options.warmup,
        "repeats": options.repeats,
        "torch": torch.__version__,
    }



def cache_path(key: dict, options: ProfileOptions) -> Path:
    """The file the profile of ``key`` is cached in."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return _cache_dir(options) / f"{digest}.json"


def load(path: Path, key: dict, decode: Callable[[dict], T]) -> T | None:
    """What is cached at ``path``, decoded, when it was measured under ``key``; None when there is
    none or it is unreadable (a damaged file is measured again)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] == key:
            return decode(data)
    except (ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable profile cache %s: %s", path, e)
    return None


def store(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
