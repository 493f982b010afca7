"""Read safetensors headers (8-byte little-endian length + JSON) without touching tensor data.

The validity rules are those of the safetensors library itself, version 0.8.0
(huggingface/safetensors, safetensors/src/tensor.rs: `SafeTensors::read_metadata`,
`Metadata::validate`, and serde_json's parsing of `HashMetadata` / `TensorInfo`), so that a file
the library refuses is refused here and a file it accepts is accepted
(tests/hostile/test_safetensors_differential.py checks both against the installed library):

- the file holds at least the 8 length bytes; the length is at most 100,000,000 and fits the file;
- the header is UTF-8 and one JSON value (surrounding JSON whitespace allowed, nothing else), in
  serde_json's grammar: no NaN/Infinity, no lone surrogate escapes, numbers within f64 range,
  nesting at most 127 deep;
- it is an object; `__metadata__` appears at most once and is null or a string -> string map;
- every other key is a tensor: a map (or a 3-item array) with dtype, shape and data_offsets, each
  given once (unknown fields are ignored); dtype a known name (or serde's `{"F32": null}`);
  shape and offsets unsigned 64-bit integers; offsets exactly two;
- a tensor name given twice keeps the last entry (serde's map), but every entry must parse;
- sorted by (begin, end), the tensors tile the data section from 0 with no gap or overlap, each
  holds exactly shape x dtype bits / 8 bytes (whole bytes, no u64 overflow), and the last one
  ends at the end of the file.

Every malformation is returned as a `HeaderProblem`, never raised: lint reports them as findings.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from kvtool.io.jsonfile import lone_surrogate, may_hold_surrogate

MAX_HEADER_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE
MAX_JSON_DEPTH = 127  # serde_json's recursion limit (128) as nesting depth
U64_MAX = 2**64 - 1

# Bits per element of each safetensors dtype (safetensors `Dtype::bitsize`).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
# Bytes per element (fractional for the sub-byte floats).
DTYPE_BYTES: dict[str, float] = {k: v / 8 for k, v in DTYPE_BITS.items()}
TENSOR_FIELDS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # file name relative to the model folder
    data_offsets: tuple[int, int]

    @property
    def numel(self) -> int:
        return prod(self.shape) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]


@dataclass(frozen=True)
class HeaderProblem:
    kind: str  # too-large | bad-length | bad-json | bad-entry | offsets | empty | unreadable
    message: str
    tensor: str | None = None


@dataclass
class SafetensorsHeader:
    file: str
    path: Path
    file_size: int
    header_size: int = 0
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    problems: list[HeaderProblem] = field(default_factory=list)
    # (st_dev, st_ino, st_size, st_mtime_ns) of the file validated (kvtool.io.outputfile.Identity): a copy
    # of its bytes checks the source is still this file
    identity: tuple[int, int, int, int] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


class _Invalid(ValueError):
    """One header problem; parsing stops at the first, as the library's does."""

    def __init__(self, kind: str, message: str, tensor: str | None = None):
        super().__init__(message)
        self.problem = HeaderProblem(kind, message, tensor)


class _Pairs(list):
    """A JSON object as its (key, value) pairs in order: duplicates stay visible."""


class _Number:
    """A JSON number that is not an unsigned 64-bit integer (floats, negatives, -0, huge ints)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _parse_float(text: str) -> _Number:
    if math.isinf(float(text)):
        raise _Invalid("bad-json", f"number {text[:20]} is out of range")
    return _Number(text)


def _parse_int(text: str):
    if text.startswith("-") or len(text) > 20 or int(text) > U64_MAX:
        return _parse_float(text)  # serde_json reads these as i64 or f64, never as an unsigned size
    return int(text)


def _reject_constant(text: str):
    raise _Invalid("bad-json", f"header is not valid JSON: {text} is not a JSON value")


def read_header(path: Path, file: str | None = None) -> SafetensorsHeader:
    """Parse and validate one safetensors header, reading only the 8 + header-length bytes."""
    name = file or path.name
    try:
        st = path.stat()
    except OSError as exc:
        h = SafetensorsHeader(name, path, 0)
        h.problems.append(HeaderProblem("unreadable", f"cannot stat: {exc.strerror or exc}"))
        return h
    h = SafetensorsHeader(name, path, st.st_size)
    if not stat.S_ISREG(st.st_mode):
        h.problems.append(HeaderProblem("unreadable", "is not a regular file"))
        return h
    try:
        with path.open("rb") as fh:
            now = os.fstat(fh.fileno())
            if (now.st_dev, now.st_ino, now.st_size) != (st.st_dev, st.st_ino, st.st_size):
                raise _Invalid("unreadable", "changed while it was being read")
            h.identity = (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns)
            _validate(h, fh)
    except _Invalid as exc:
        h.tensors, h.metadata = {}, {}
        h.problems.append(exc.problem)
    except OSError as exc:
        h.problems.append(HeaderProblem("unreadable", f"cannot read: {exc.strerror or exc}"))
    return h


def _validate(h: SafetensorsHeader, fh) -> None:
    size = h.file_size
    if size < 8:
        raise _Invalid("empty" if size == 0 else "bad-length",
                       f"file is {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", fh.read(8))
    if n > MAX_HEADER_BYTES:
        raise _Invalid("too-large", f"header length {n} exceeds the {MAX_HEADER_BYTES} byte limit")
    if 8 + n > size:
        raise _Invalid("bad-length", f"header length {n} does not fit a {size} byte file")
    raw = fh.read(n)
    if len(raw) != n:
        raise _Invalid("bad-length", "file ends inside the header")
    h.header_size = n
    obj = _parse_json(raw)
    if not isinstance(obj, _Pairs):
        raise _Invalid("bad-json", "header is not a JSON object")
    entries: dict[str, TensorInfo] = {}
    seen_metadata = False
    for key, value in obj:
        if key == "__metadata__":
            if seen_metadata:
                raise _Invalid("bad-entry", "__metadata__ is given twice")
            seen_metadata = True
            h.metadata = _metadata(value)
        else:
            entries.pop(key, None)  # serde's map: the last entry of a repeated name wins
            entries[key] = _tensor_entry(key, value, h.file)
    end = _check_layout(entries.values())
    data_len = size - 8 - n
    if end != data_len:
        what = "bytes after the last tensor" if end < data_len else "the file ends before the last tensor"
        raise _Invalid("offsets", f"tensors cover {end} bytes of a {data_len} byte data section ({what})")
    h.tensors = entries


def _parse_json(raw: bytes):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Invalid("bad-json", f"header is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        obj = json.loads(text, object_pairs_hook=_Pairs, parse_float=_parse_float, parse_int=_parse_int,
                         parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise _Invalid("bad-json", f"header is not valid JSON: {exc}") from None
    except RecursionError:
        raise _Invalid("bad-json", f"header JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_tree(obj, strings=may_hold_surrogate(text))
    return obj


def _check_tree(obj, *, strings: bool = True) -> None:
    """serde_json's limits Python's json does not have: nesting depth and lone surrogate escapes. `strings`:
    whether any string can hold a surrogate (the header text has a `\\ud` escape: UTF-8 text cannot hold one)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if strings:
                _check_string(node)
        elif isinstance(node, list):  # arrays and _Pairs objects
            if depth > MAX_JSON_DEPTH:
                raise _Invalid("bad-json", f"header JSON nests deeper than {MAX_JSON_DEPTH} levels")
            for item in node:
                if isinstance(item, tuple):  # an object's (key, value)
                    if strings:
                        _check_string(item[0])
                    stack.append((item[1], depth + 1))
                else:
                    stack.append((item, depth + 1))


def _check_string(s: str) -> None:
    if lone_surrogate(s):
        raise _Invalid("bad-json", "header is not valid JSON: a string holds a lone surrogate escape")


def _metadata(value) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, _Pairs):
        raise _Invalid("bad-entry", "__metadata__ is not a map of strings to strings")
    out: dict[str, str] = {}
    for k, v in value:
        if not isinstance(v, str):
            raise _Invalid("bad-entry", f"__metadata__ value of {k!r} is not a string: {_show(v)}")
        out[k] = v
    return out


def _tensor_entry(name: str, entry, file: str) -> TensorInfo:
    if isinstance(entry, _Pairs):
        fields: dict = {}
        for k, v in entry:
            if k in TENSOR_FIELDS:
                if k in fields:
                    raise _Invalid("bad-entry", f"field {k} is given twice", name)
                fields[k] = v
        missing = [k for k in TENSOR_FIELDS if k not in fields]
        if missing:
            raise _Invalid("bad-entry", f"entry has no {missing[0]}", name)
        dtype, shape, offsets = (fields[k] for k in TENSOR_FIELDS)
    elif isinstance(entry, list) and len(entry) == 3:  # serde also reads a struct from a sequence
        dtype, shape, offsets = entry
    else:
        raise _Invalid("bad-entry", f"entry is not an object with dtype, shape and data_offsets: {_show(entry)}", name)
    dtype = _dtype(name, dtype)
    if not isinstance(shape, list) or isinstance(shape, _Pairs) or not all(_is_u64(d) for d in shape):
        raise _Invalid("bad-entry", f"invalid shape {_show(shape)}", name)
    if (not isinstance(offsets, list) or isinstance(offsets, _Pairs) or len(offsets) != 2
            or not all(_is_u64(o) for o in offsets)):
        raise _Invalid("bad-entry", f"invalid data_offsets {_show(offsets)}", name)
    return TensorInfo(name, dtype, tuple(shape), file, (offsets[0], offsets[1]))


def _dtype(name: str, value) -> str:
    if isinstance(value, _Pairs) and len(value) == 1 and value[0][1] is None:
        value = value[0][0]  # serde's externally tagged form of a unit variant: {"F32": null}
    if not isinstance(value, str) or value not in DTYPE_BITS:
        raise _Invalid("bad-entry", f"unknown dtype {_show(value)}", name)
    return value


def _is_u64(x) -> bool:
    return type(x) is int and 0 <= x <= U64_MAX


def _check_layout(entries) -> int:
    """safetensors' Metadata::validate: offsets tile [0, end) in (begin, end) order; sizes match shapes."""
    start, prev = 0, None
    for info in sorted(entries, key=lambda t: t.data_offsets):
        begin, end = info.data_offsets
        if begin != start or end < begin:
            if end < begin:
                why = "end before begin"
            elif begin < start:
                why = f"overlaps {prev!r}, which ends at {start}"
            else:
                why = f"leaves a gap of {begin - start} bytes after {prev!r}" if prev else f"the first tensor starts at {begin}, not 0"
            raise _Invalid("offsets", f"data_offsets [{begin}, {end}]: {why}", info.name)
        start, prev = end, info.name
        numel = 1
        for d in info.shape:  # the library's checked fold: overflow anywhere is an error, even before a 0
            numel *= d
            if numel > U64_MAX:
                raise _Invalid("offsets", f"shape {list(info.shape)} overflows 64 bits", info.name)
        bits = numel * DTYPE_BITS[info.dtype]
        if bits > U64_MAX:
            raise _Invalid("offsets", f"{info.dtype}{list(info.shape)} overflows 64 bits", info.name)
        if bits % 8:
            raise _Invalid("offsets", f"{info.dtype}{list(info.shape)} is not a whole number of bytes", info.name)
        if end - begin != bits // 8:
            raise _Invalid("offsets", f"{end - begin} bytes stored but {info.dtype}{list(info.shape)} needs {bits // 8}",
                           info.name)
    return start


def _show(value) -> str:
    if isinstance(value, _Pairs):
        value = dict(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
