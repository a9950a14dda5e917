"""Reading and writing user files: atomic writes, and reads whose errors name the file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hetshard.errors import SpecError, SpecParseError


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and a rename, so a reader never
    sees a half-written file and an interrupted write leaves the old file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_text(path: str | os.PathLike, what: str) -> str:
    """The file's text, or a SpecError naming ``what`` and the OS reason."""
    if not str(path).strip():  # (Path("") is the working directory: "Is a directory")
        raise SpecError(what, str(path), f"the path of a {what} file (it is empty)")
    if Path(path).is_dir():
        raise SpecError(what, str(path), f"the path of a {what} file (it is a directory)")
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(what, str(path), f"a readable {what} file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise SpecError(what, str(path), f"a UTF-8 text {what} file (byte {e.start} is "
                                         f"not UTF-8: a binary or corrupted file?)") from None


def parse_json(text: str, source: str) -> Any:
    """Parsed JSON, or a SpecParseError with the source and line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecParseError(source, e.msg, line=e.lineno) from None
