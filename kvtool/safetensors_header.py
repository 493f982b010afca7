"""Read safetensors headers (8-byte little-endian length + JSON) without touching tensor data.

Every malformation is returned as a `HeaderProblem`, never raised: lint reports them as findings.
"""

from __future__ import annotations

import json
import stat
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from kvtool.inputfile import kind_of

MAX_HEADER_BYTES = 100 * 1000 * 1000

# Bytes per element for safetensors dtype strings.
DTYPE_BYTES: dict[str, float] = {
    "F64": 8, "I64": 8, "U64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1,
    "F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75,
}


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

    @property
    def ok(self) -> bool:
        return not self.problems


def read_header(path: Path, file: str | None = None) -> SafetensorsHeader:
    """Parse one safetensors header; bounded by MAX_HEADER_BYTES and the file size."""
    name = file or path.name
    try:
        st = path.stat()
        size = st.st_size
    except OSError as exc:
        h = SafetensorsHeader(name, path, 0)
        h.problems.append(HeaderProblem("unreadable", f"cannot stat: {exc.strerror or exc}"))
        return h
    h = SafetensorsHeader(name, path, size)
    if not stat.S_ISREG(st.st_mode):  # a FIFO blocks and a device never ends: never opened
        h.problems.append(HeaderProblem("unreadable", f"is {kind_of(st.st_mode)}, not a regular file"))
        return h
    if size == 0:
        h.problems.append(HeaderProblem("empty", "file is empty"))
        return h
    if size < 8:
        h.problems.append(HeaderProblem("bad-length", f"file is {size} bytes, shorter than the 8-byte header length"))
        return h
    try:
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > MAX_HEADER_BYTES:
                h.problems.append(HeaderProblem("too-large", f"header length {n} exceeds the {MAX_HEADER_BYTES} byte limit"))
                return h
            if n == 0 or 8 + n > size:
                h.problems.append(HeaderProblem("bad-length", f"header length {n} does not fit a {size} byte file"))
                return h
            raw = fh.read(n)
    except OSError as exc:
        h.problems.append(HeaderProblem("unreadable", f"cannot read: {exc.strerror or exc}"))
        return h
    h.header_size = n
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        h.problems.append(HeaderProblem("bad-json", f"header is not valid JSON: {exc}"))
        return h
    if not isinstance(obj, dict):
        h.problems.append(HeaderProblem("bad-json", "header is not a JSON object"))
        return h
    data_len = size - 8 - n
    meta = obj.pop("__metadata__", None)
    if isinstance(meta, dict):
        h.metadata = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    elif meta is not None:
        h.problems.append(HeaderProblem("bad-entry", "__metadata__ is not an object"))
    for tname, entry in obj.items():
        info = _tensor_entry(tname, entry, name, data_len, h.problems)
        if info is not None:
            h.tensors[tname] = info
    return h


def _tensor_entry(tname, entry, file, data_len, problems) -> TensorInfo | None:
    if not isinstance(entry, dict):
        problems.append(HeaderProblem("bad-entry", "entry is not an object", tname))
        return None
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        problems.append(HeaderProblem("bad-entry", f"unknown dtype {dtype!r}", tname))
        return None
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        problems.append(HeaderProblem("bad-entry", f"invalid shape {shape!r}", tname))
        return None
    if (
        not isinstance(offs, list) or len(offs) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
    ):
        problems.append(HeaderProblem("bad-entry", f"invalid data_offsets {offs!r}", tname))
        return None
    begin, end = offs
    if begin < 0 or end < begin or end > data_len:
        problems.append(HeaderProblem("offsets", f"data_offsets [{begin}, {end}] outside the {data_len} byte data section", tname))
        return None
    expected = prod(shape) * DTYPE_BYTES[dtype] if shape else DTYPE_BYTES[dtype]
    if end - begin != int(expected):
        problems.append(HeaderProblem("offsets", f"{end - begin} bytes stored but {dtype}{shape} needs {int(expected)}", tname))
        return None
    return TensorInfo(tname, dtype, tuple(shape), file, (begin, end))
