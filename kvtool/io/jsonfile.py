"""Strict-but-forgiving JSON reading: clear errors with line/column, non-standard tokens recorded."""

from __future__ import annotations

import gc
import json
import re
from contextlib import contextmanager
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
    raw = inputfile.read_bytes(path, what=what, limit=MAX_JSON_BYTES)
    text = inputfile.decode(raw, path, what=what, bom=False)  # no BOM: raw is text's UTF-8, byte for byte
    nonstandard: list[str] = []
    data = parse_json(text, path, what=what, nonstandard=nonstandard, raw=raw)
    if not isinstance(data, dict):
        raise InputError(f"expected a JSON object, found {type(data).__name__}", file=str(path))
    check_unicode(data, raw, path)
    return JsonDocument(path=path, data=data, text=text, nonstandard=nonstandard)


def parse_json(text: str, path: Path | str, *, what: str = "JSON file", nonstandard: list | None = None,
               raw: bytes | None = None, unique_keys: bool = False):
    """Any JSON value, with integers and nesting bounded; Infinity / NaN tokens are appended to `nonstandard`.
    `raw`: the UTF-8 bytes of `text`, when the caller has them (spares encoding it again). unique_keys: a key twice
    in one object is refused (json keeps the last silently; a reader that keeps the first sees another document).

    The bounds are checked on the text at C speed (bytes.translate, bytes.replace, re), not by a Python call per
    integer or a Python walk of the parsed value: on a 3.5 MB tokenizer.json those cost more than the parse."""
    found = nonstandard if nonstandard is not None else []

    def _constant(token: str):
        found.append(token)
        return float(token.replace("Infinity", "inf").replace("NaN", "nan"))

    structure = (text.encode("utf-8", "surrogatepass") if raw is None else raw).translate(_STRUCTURE)
    # every over-long integer is a run of more than MAX_INT_DIGITS digits: only then does each integer go
    # through the bounded parse (a run inside a string or a float makes this check slower, never wrong)
    bounded_int = _bounded_int if b"0" * (MAX_INT_DIGITS + 1) in structure else None
    try:
        with collector_paused():
            data = json.loads(text, parse_constant=_constant, parse_int=bounded_int,
                              object_pairs_hook=_unique if unique_keys else None)
    except _DuplicateKey as exc:
        raise InputError(f"the key {exc.args[0][:80]!r} appears twice in one object", file=str(path)) from None
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
    if _nests_deeper(structure, MAX_JSON_DEPTH):
        raise InputError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep", file=str(path))
    return data


@contextmanager
def collector_paused():
    """No cyclic garbage collection while json builds a document (and, for a caller that holds the pause, while
    it is read and dropped): a parsed document has no cycles, and on a 3.5 MB tokenizer.json the collections its
    ~150k new lists and dicts set off, and the walks of them once built, cost a sixth of the parse."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE, _SURROGATE_ESCAPE_B = re.compile(r"\\u[dD]"), re.compile(rb"\\u[dD]")


def may_hold_surrogate(text: str | bytes) -> bool:
    """Whether a JSON text (or its UTF-8 bytes) can decode to a string holding a surrogate: only a `\\ud..` escape
    makes one (UTF-8 cannot hold it). re finds it by its literal prefix, ~4x faster than `in` on 3.5 MB."""
    if isinstance(text, bytes):
        return _SURROGATE_ESCAPE_B.search(text) is not None
    return _SURROGATE_ESCAPE.search(text) is not None


def lone_surrogate(s: str) -> str | None:
    """What is wrong with `s` if it holds a lone surrogate (from a `\\ud800` escape), else None."""
    m = _SURROGATE.search(s)
    return None if m is None else f"a lone surrogate \\u{ord(m.group()):04x} in a string (not valid Unicode: " \
                                  f"UTF-8 cannot encode it)"


def check_unicode(data, text: str | bytes, path: Path | str) -> None:
    """Refuse a string (key or value) holding a lone surrogate (`"\\ud800"` unpaired): JSON Python reads but
    no UTF-8 writer, Rust parser (safetensors, tokenizers) or terminal takes; named by its field. `text`: the
    JSON text, or its UTF-8 bytes (searched faster)."""
    if not may_hold_surrogate(text):
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


# The text's UTF-8 bytes mapped to what the bounds need: digits -> "0"; '"', backslash and brackets kept ("{}" ->
# "[]"); every other byte (multi-byte UTF-8 sequences are all >= 0x80) -> " ". Same length as the bytes.
_KEPT = dict(zip(b'0123456789"\\[]{}', b'0000000000"\\[][]'))
_STRUCTURE = bytes(_KEPT.get(b, ord(" ")) for b in range(256))
_ESCAPE_PAIR = re.compile(rb'\\[\\"]')  # an escaped backslash or quote, paired from the left as JSON pairs them
_STRING_WITH_BRACKETS = re.compile(rb'"[^"]*"')


def _nests_deeper(structure: bytes, limit: int) -> bool:
    """Whether the lists / objects of a text json.loads accepted nest more than `limit` levels (the top
    level is 1), from its _STRUCTURE bytes: brackets inside strings (escaped quotes too) do not count."""
    if b"\\" in structure:
        structure = _ESCAPE_PAIR.sub(b"", structure)  # no escaped quote is left to end a string early
    # quotes and brackets only; "" drops an empty string or joins two strings with nothing between them
    s = structure.translate(None, b" 0\\").replace(b'""', b"")
    s = _STRING_WITH_BRACKETS.sub(b"", s)  # the strings left hold brackets: dropped with them
    too_deep = b"[" * (limit + 1)
    for _ in range(limit):  # each pass removes every innermost pair, so one level of every branch
        if not s:
            return False
        if too_deep in s:
            return True
        s = s.replace(b"[]", b"")
    return bool(s)


def _bounded_int(token: str) -> int:
    if len(token.lstrip("-")) > MAX_INT_DIGITS:
        raise _HugeInteger(token)
    return int(token)


class _DuplicateKey(Exception):
    """Raised from json's object_pairs_hook for a key given twice in one object."""


def _unique(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


class _HugeInteger(Exception):
    """Raised from json's parse_int for a digit string longer than MAX_INT_DIGITS."""


# a string (skipped whole) or a number token; group 1: the integer part, when there is no fraction or exponent
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|(-?[0-9]+)(?![0-9.eE])|-?[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]*)?',
                    re.S)


def _locate_huge(text: str) -> tuple[str | None, int]:
    """The key (when the number is a mapping value) and 1-based line of the first over-long integer token
    (digits inside strings and in floats are not integers)."""
    for m in _TOKEN.finditer(text):
        if m.group(1) and len(m.group(1).lstrip("-")) > MAX_INT_DIGITS:
            break
    else:
        return None, 1
    line = text.count("\n", 0, m.start()) + 1
    k = re.search(r'"((?:[^"\\\n]|\\.){1,200})"\s*:\s*$', text[max(0, m.start() - 300):m.start()])
    return (k.group(1) if k else None), line


def dump_json_like(data: dict, original_text: str | None = None) -> str:
    """Serialise a config the way transformers does (indent 2, sorted as given, trailing newline)."""
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"

