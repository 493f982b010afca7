"""Strict-but-forgiving JSON reading: clear errors with line/column, non-standard tokens recorded."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.errors import InputError

MAX_JSON_BYTES = 64 * 1024 * 1024


@dataclass
class JsonDocument:
    path: Path
    data: dict
    text: str
    nonstandard: list[str] = field(default_factory=list)  # e.g. ["Infinity"]

    def line_of(self, key: str) -> int | None:
        """Best-effort 1-based line of the first occurrence of a key (for SARIF / github output)."""
        needle = json.dumps(key) + ":"
        idx = self.text.find(needle)
        if idx < 0:
            needle = json.dumps(key)
            idx = self.text.find(needle)
        if idx < 0:
            return None
        return self.text.count("\n", 0, idx) + 1


def read_text(path: Path, *, what: str = "file", limit: int = MAX_JSON_BYTES) -> str:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise InputError(f"cannot read {what}: {_os_reason(exc)}", file=str(path)) from None
    if size > limit:
        raise InputError(f"{what} is {size} bytes, larger than the {limit} byte limit", file=str(path))
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {what}: {_os_reason(exc)}", file=str(path)) from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 (byte {exc.start})", file=str(path)) from None


def load_json_object(path: Path, *, what: str = "JSON file") -> JsonDocument:
    """Read a JSON object; raise InputError naming the file and line/column on any problem."""
    text = read_text(path, what=what)
    nonstandard: list[str] = []

    def _constant(token: str):
        nonstandard.append(token)
        return float(token.replace("Infinity", "inf").replace("NaN", "nan"))

    try:
        data = json.loads(text, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", file=str(path)
        ) from None
    except RecursionError:
        raise InputError("JSON nested too deeply", file=str(path)) from None
    if not isinstance(data, dict):
        raise InputError(f"expected a JSON object, found {type(data).__name__}", file=str(path))
    return JsonDocument(path=path, data=data, text=text, nonstandard=nonstandard)


def dump_json_like(data: dict, original_text: str | None = None) -> str:
    """Serialise a config the way transformers does (indent 2, sorted as given, trailing newline)."""
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _os_reason(exc: OSError) -> str:
    return exc.strerror or exc.__class__.__name__


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file via a temporary sibling and rename, so a crash never leaves half a file."""
    tmp = path.with_name(f".{path.name}.kvtool-tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
