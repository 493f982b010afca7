"""Strict-but-forgiving JSON reading: clear errors with line/column, non-standard tokens recorded."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.io import inputfile
from kvtool.errors import InputError

MAX_JSON_BYTES = inputfile.JSON_LIMIT
# Integers longer than this are refused while parsing: no config number needs more, Python cannot
# even print one past 4300 digits, and int() of a long digit string is quadratic.
MAX_INT_DIGITS = 100
# Configs nest 3-4 levels, tokenizer.json ~6: deeper documents are refused before any recursive walk.
MAX_JSON_DEPTH = 64


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
    """A regular UTF-8 file of at most `limit` bytes (kvtool.io.inputfile: FIFOs and devices are refused)."""
    return inputfile.read_text(path, what=what, limit=limit)


def load_json_object(path: Path, *, what: str = "JSON file") -> JsonDocument:
    """Read a JSON object; raise InputError naming the file and line/column on any problem."""
    # transformers (json.loads) and tokenizers (serde_json) refuse a BOM that Python's utf-8-sig would drop
    text = inputfile.read_text(path, what=what, limit=MAX_JSON_BYTES, bom=False)
    nonstandard: list[str] = []
    data = parse_json(text, path, what=what, nonstandard=nonstandard)
    if not isinstance(data, dict):
        raise InputError(f"expected a JSON object, found {type(data).__name__}", file=str(path))
    check_unicode(data, text, path)
    return JsonDocument(path=path, data=data, text=text, nonstandard=nonstandard)


def parse_json(text: str, path: Path | str, *, what: str = "JSON file", nonstandard: list | None = None):
    """Any JSON value, with integers and nesting bounded; Infinity / NaN tokens are appended to `nonstandard`."""
    found = nonstandard if nonstandard is not None else []

    def _constant(token: str):
        found.append(token)
        return float(token.replace("Infinity", "inf").replace("NaN", "nan"))

    def _int(token: str) -> int:
        if len(token.lstrip("-")) > MAX_INT_DIGITS:
            raise _HugeInteger(token)
        return int(token)

    try:
        data = json.loads(text, parse_constant=_constant, parse_int=_int)
    except _HugeInteger as exc:
        key, line = _locate_huge(text)
        raise InputError(f"an integer with {len(exc.args[0].lstrip('-'))} digits at line {line}; numbers in "
                         f"{what} files have at most {MAX_INT_DIGITS} digits", file=str(path), field=key) from None
    except json.JSONDecodeError as exc:
        raise InputError(
            f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", file=str(path)
        ) from None
    except RecursionError:
        raise InputError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep", file=str(path)) from None
    if _deeper_than(data, MAX_JSON_DEPTH):
        raise InputError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep", file=str(path))
    return data


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(s: str) -> str | None:
    """What is wrong with `s` if it holds a lone surrogate (from a `\\ud800` escape), else None."""
    m = _SURROGATE.search(s)
    return None if m is None else f"a lone surrogate \\u{ord(m.group()):04x} in a string (not valid Unicode: " \
                                  f"UTF-8 cannot encode it)"


def check_unicode(data, text: str, path: Path | str) -> None:
    """Refuse a string (key or value) holding a lone surrogate (`"\\ud800"` unpaired): JSON Python reads but
    no UTF-8 writer, Rust parser (safetensors, tokenizers) or terminal takes; named by its field."""
    if "\\ud" not in text and "\\uD" not in text:  # only a \u escape makes one (UTF-8 text cannot hold it)
        return
    stack: list[tuple[object, str]] = [(data, "")]
    while stack:
        node, where = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            here = f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else k
            for s in ((k, v) if isinstance(v, str) else (k,)):
                if isinstance(s, str) and (problem := lone_surrogate(s)):
                    raise InputError(problem, file=str(path), field=here)
            if isinstance(v, (dict, list)):
                stack.append((v, here))


def _deeper_than(data, limit: int) -> bool:
    """Whether lists / objects nest more than `limit` levels (iterative: no recursion to exhaust)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


class _HugeInteger(Exception):
    """Raised from json's parse_int for a digit string longer than MAX_INT_DIGITS."""


def _locate_huge(text: str) -> tuple[str | None, int]:
    """The key (when the number is a mapping value) and 1-based line of the first over-long integer."""
    import re

    m = re.search(r"-?\d{%d,}" % (MAX_INT_DIGITS + 1), text)
    if m is None:
        return None, 1
    line = text.count("\n", 0, m.start()) + 1
    k = re.search(r'"((?:[^"\\\n]|\\.){1,200})"\s*:\s*$', text[max(0, m.start() - 300):m.start()])
    return (k.group(1) if k else None), line


def dump_json_like(data: dict, original_text: str | None = None) -> str:
    """Serialise a config the way transformers does (indent 2, sorted as given, trailing newline)."""
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"

