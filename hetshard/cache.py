"""On-disk and in-memory plan cache.

Plans are stored as JSON under ``$HETSHARD_CACHE_DIR/plans/<key>.json`` (default: the
user cache directory, ``~/.cache/hetshard``), keyed by a fingerprint of the traced
program (``hetshard.Program.fingerprint``: its loss's equations, state and batch
shapes), the cluster, the planner options, the calibration and the hetshard version, so
an upgrade never reuses a stale plan. Writes are
atomic (temporary file + rename). A file that does not parse or does not match its key
is reported once, ignored and replaced by the recomputed plan; nothing else is touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

from hetshard._plan import Plan
from hetshard.errors import HetshardError
from hetshard.fileio import write_atomic

_MEMORY: dict[str, Plan] = {}
_REPORTED: set[str] = set()


def cache_dir() -> Path:
    root = os.environ.get("HETSHARD_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hetshard"


def fingerprint(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def load(key: str) -> Plan | None:
    """The cached plan for ``key`` (memory first, then disk), or None."""
    if key in _MEMORY:
        return _MEMORY[key]
    path = cache_dir() / "plans" / f"{key}.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            raise HetshardError(f"key {data.get('key')!r} != {key!r}")
        plan = Plan.from_dict(data["plan"], source=str(path))
    except (OSError, ValueError, KeyError, TypeError, HetshardError) as e:
        if str(path) not in _REPORTED:
            _REPORTED.add(str(path))
            warnings.warn(f"hetshard plan cache: {path} is corrupted or stale ({e}); "
                          f"re-planning and overwriting it", stacklevel=3)
        return None
    _MEMORY[key] = plan
    return plan


def store(key: str, plan: Plan) -> None:
    """Keeps ``plan`` in memory and on disk; a cache directory that cannot be written is
    reported once and the plan is only kept in memory (the caller's work goes on)."""
    _MEMORY[key] = plan
    folder = cache_dir() / "plans"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / f"{key}.json", json.dumps({"key": key, "plan": plan.to_dict()}))
    except OSError as e:
        if str(folder) not in _REPORTED:
            _REPORTED.add(str(folder))
            warnings.warn(f"hetshard plan cache: cannot write under {folder} ({e}); plans "
                          f"are kept in memory only (set HETSHARD_CACHE_DIR to a writable "
                          f"directory)", stacklevel=3)


def clear_memory() -> None:
    _MEMORY.clear()
