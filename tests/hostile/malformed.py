"""Generated safetensors files, valid and malformed, for the differential test and the refusal tests.

A case starts from a small valid file (random dtypes, shapes including scalars and zero-size
tensors, offsets in random key order) and applies one mutation. The header is built as raw JSON
text, so duplicate keys, odd numbers and bad escapes survive. Deterministic: case i uses
random.Random(i). Nothing here decides validity: the tests ask the safetensors library.
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass, field

DTYPES = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
          "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
          "C64": 64, "F4": 4, "F6_E2M3": 6, "F8_E4M3FNUZ": 8}


@dataclass
class Tensor:
    name: str
    dtype: str
    shape: list
    begin: int = 0
    end: int = 0
    text: str | None = None  # raw JSON for the entry, when a mutation wrote it by hand

    def json(self) -> str:
        if self.text is not None:
            return self.text
        return json.dumps({"dtype": self.dtype, "shape": self.shape, "data_offsets": [self.begin, self.end]})


@dataclass
class Doc:
    """A safetensors file in parts: header entries (key, raw JSON) in order, data, and byte-level edits."""

    tensors: list[Tensor]
    data: bytes
    extra: list[tuple[str, str]] = field(default_factory=list)  # (key, raw JSON) appended to the header
    metadata: str | None = None  # raw JSON of __metadata__, first key when given
    lead: str = ""
    trail: str = ""
    length_delta: int = 0
    length: int | None = None
    raw: bytes | None = None  # the whole file, when a mutation works on bytes

    def header(self) -> bytes:
        pairs = ([("__metadata__", self.metadata)] if self.metadata is not None else [])
        pairs += [(t.name, t.json()) for t in self.tensors] + self.extra
        return (self.lead + "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in pairs) + "}" + self.trail).encode()

    def bytes(self) -> bytes:
        if self.raw is not None:
            return self.raw
        h = self.header()
        n = self.length if self.length is not None else len(h) + self.length_delta
        return struct.pack("<Q", n) + h + self.data


def valid_doc(rng: random.Random, n_max: int = 4) -> Doc:
    tensors = []
    for i in range(rng.randint(1, n_max)):
        dtype = rng.choice(list(DTYPES))
        kind = rng.random()
        if kind < 0.1:
            shape = []
        elif kind < 0.2:
            shape = [rng.randint(0, 3), 0]
        else:
            shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        numel = 1
        for d in shape:
            numel *= d
        if numel * DTYPES[dtype] % 8:  # sub-byte dtypes: keep whole bytes in the valid base
            shape = shape + [8]
        tensors.append(Tensor(f"model.t{i}.weight", dtype, shape))
    order = tensors[:]
    rng.shuffle(order)
    pos = 0
    for t in order:
        numel = 1
        for d in t.shape:
            numel *= d
        t.begin, t.end = pos, pos + numel * DTYPES[t.dtype] // 8
        pos = t.end
    return Doc(tensors, bytes(rng.getrandbits(8) for _ in range(pos)))


def _some(rng, doc, nonempty=False) -> Tensor | None:
    ts = [t for t in doc.tensors if t.end > t.begin] if nonempty else doc.tensors
    return rng.choice(ts) if ts else None


def _entry(t: Tensor, **over) -> str:
    d = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [t.begin, t.end]}
    d.update(over)
    return json.dumps(d)


def _raw_entry(t: Tensor, dtype=None, shape=None, offsets=None, extra: str = "") -> str:
    dtype = dtype if dtype is not None else json.dumps(t.dtype)
    shape = shape if shape is not None else json.dumps(t.shape)
    offsets = offsets if offsets is not None else json.dumps([t.begin, t.end])
    return '{"dtype":' + dtype + ',"shape":' + shape + ',"data_offsets":' + offsets + extra + "}"


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


# Each mutation edits the doc in place (returning nothing) or returns False when it does not apply.
def m_none(rng, d): pass
def m_metadata(rng, d): d.metadata = json.dumps({"format": "pt", "note": "ok"})
def m_metadata_null(rng, d): d.metadata = "null"
def m_metadata_empty(rng, d): d.metadata = "{}"
def m_metadata_int(rng, d): d.metadata = json.dumps({"format": "pt", "step": rng.randint(0, 9)})
def m_metadata_nested(rng, d): d.metadata = json.dumps({"format": {"a": "b"}})
def m_metadata_list(rng, d): d.metadata = json.dumps([["format", "pt"]])
def m_metadata_string(rng, d): d.metadata = json.dumps("pt")
def m_metadata_null_value(rng, d): d.metadata = json.dumps({"format": None})
def m_metadata_twice(rng, d):
    d.metadata = json.dumps({"a": "1"})
    d.extra.append(("__metadata__", rng.choice(['{"b":"2"}', "null"])))
def m_metadata_escaped_twice(rng, d):
    d.metadata = "{}"
    d.extra.append(("__metadata\u005f_", "{}"))  # json.dumps writes it plainly; the key decodes the same
def m_metadata_key_twice(rng, d): d.metadata = '{"a":"1","a":"2"}'
def m_metadata_after_tensors(rng, d): d.extra.append(("__metadata__", json.dumps({"x": "y"})))


def m_overlap(rng, d):
    ts = [t for t in d.tensors if t.end > t.begin]
    if len(ts) < 2:
        return False
    a, b = rng.sample(ts, 2)
    b.begin, b.end = a.begin, a.begin + (b.end - b.begin)
def m_overlap_same_range(rng, d):
    ts = [t for t in d.tensors if t.end > t.begin]
    if len(ts) < 2:
        return False
    a, b = rng.sample(ts, 2)
    b.text = _entry(b, dtype=a.dtype, shape=a.shape, data_offsets=[a.begin, a.end])
def m_gap(rng, d):
    t = _some(rng, d, nonempty=True)
    if t is None:
        return False
    k = rng.randint(1, 8)
    for u in d.tensors:
        if u.begin >= t.begin:  # t and everything after it move k bytes on
            u.begin += k
            u.end += k
    d.data = d.data + bytes(k)
def m_first_not_zero(rng, d):
    for u in d.tensors:
        u.begin += 4
        u.end += 4
    d.data = bytes(4) + d.data
def m_trailing_bytes(rng, d): d.data += bytes(rng.randint(1, 16))
def m_short(rng, d):
    if not d.data:
        return False
    d.data = d.data[:-rng.randint(1, len(d.data))]
def m_end_before_begin(rng, d):
    t = _some(rng, d, nonempty=True)
    if t is None:
        return False
    t.text = _entry(t, data_offsets=[t.end, t.begin])
def m_size_mismatch(rng, d):
    t = rng.choice(d.tensors)
    t.text = _entry(t, shape=(t.shape + [2]) if t.shape else [2])
def m_dim_plus_one(rng, d):
    t = _some(rng, d, nonempty=True)
    if t is None or not t.shape:
        return False
    t.text = _entry(t, shape=[t.shape[0] + 1] + t.shape[1:])


def m_dup_same(rng, d):
    t = rng.choice(d.tensors)
    d.extra.append((t.name, t.json()))
def m_dup_different(rng, d):
    t = rng.choice(d.tensors)
    other = rng.choice(d.tensors)
    d.extra.append((t.name, other.json()))
def m_dup_first_invalid(rng, d):
    t = rng.choice(d.tensors)
    d.tensors.insert(0, Tensor(t.name, t.dtype, t.shape, text="null"))
def m_dup_field(rng, d):
    t = rng.choice(d.tensors)
    f = rng.choice(["dtype", "shape", "data_offsets"])
    extra = {"dtype": json.dumps(t.dtype), "shape": json.dumps(t.shape), "data_offsets": json.dumps([t.begin, t.end])}[f]
    t.text = _raw_entry(t, extra=f',"{f}":{extra}')
def m_unknown_field(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, extra=',"note":' + rng.choice(['"x"', "1.5", "[1,{}]", "null", "-7"]))
def m_unknown_field_twice(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, extra=',"note":1,"note":2')
def m_missing_field(rng, d):
    t = rng.choice(d.tensors)
    keep = [k for k in ("dtype", "shape", "data_offsets") if k != rng.choice(["dtype", "shape", "data_offsets"])]
    full = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [t.begin, t.end]}
    t.text = json.dumps({k: full[k] for k in keep})
def m_entry_not_object(rng, d): rng.choice(d.tensors).text = rng.choice(["null", "1", '"F32"', "[]", "true"])
def m_entry_as_array(rng, d):
    t = rng.choice(d.tensors)
    t.text = json.dumps([t.dtype, t.shape, [t.begin, t.end]])
def m_entry_array_length(rng, d):
    t = rng.choice(d.tensors)
    t.text = json.dumps(rng.choice([[t.dtype, t.shape], [t.dtype, t.shape, [t.begin, t.end], 0]]))


def m_bad_dtype(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, dtype=rng.choice(['"f32"', '"FP32"', '"float32"', "1", "null", '""', '"F8"', "[]"]))
def m_dtype_tagged(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, dtype=rng.choice(['{"%s":null}', '{"%s":{}}', '{"%s":1}', '{"%s":null,"U8":null}']) % t.dtype)
def m_dtype_escaped(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, dtype='"' + "".join(f"\\u{ord(c):04x}" for c in t.dtype) + '"')
def m_bad_shape(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, shape=rng.choice(["[-1]", "[1.0]", "[true]", '["2"]', "[-0]", "[1e0]", "{}", "null", "2",
                                             "[18446744073709551616]"]))
def m_huge_shape(rng, d):
    t = rng.choice(d.tensors)
    dims = rng.choice([[2**63, 4, 0], [0, 2**63, 4], [2**64 - 1, 0], [2**61, 1], [2**32, 2**32]])
    t.text = _raw_entry(t, shape=json.dumps(dims), offsets=json.dumps([t.begin, t.begin]))
def m_bad_offsets(rng, d):
    t = rng.choice(d.tensors)
    b, e = t.begin, t.end
    t.text = _raw_entry(t, offsets=rng.choice([f"[{b},{e},{e}]", f"[{b}]", f'["{b}",{e}]', f"[{b}.0,{e}]",
                                               f"[-{b},{e}]" if b else f"[-0,{e}]", f"[{b},{e}e0]", "null",
                                               f'{{"0":{b},"1":{e}}}']))
def m_subbyte(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, dtype=json.dumps(rng.choice(["F4", "F6_E3M2"])), shape="[3]",
                        offsets=json.dumps([t.begin, t.begin + rng.choice([1, 2, 3])]))


def m_length_plus(rng, d): d.length_delta = rng.randint(1, 3)
def m_length_minus(rng, d): d.length_delta = -rng.randint(1, 3)
def m_length_huge(rng, d): d.length = rng.choice([100_000_000, 100_000_001, 2**63, 2**64 - 1])
def m_length_zero(rng, d): d.length = 0
def m_space_padding(rng, d): d.trail = " " * rng.randint(1, 7)
def m_whitespace_padding(rng, d): d.trail = rng.choice(["\n", "\t", "\r\n ", " \t"])
def m_leading_space(rng, d): d.lead = rng.choice([" ", "\n", "\t "])
def m_nul_padding(rng, d): d.trail = "\0" * rng.randint(1, 7)
def m_other_padding(rng, d): d.trail = rng.choice(["\x0c", "\x0b", "x", ";", "\u00a0"])
def m_bom(rng, d): d.lead = "\ufeff"
def m_trailing_comma(rng, d):
    h = d.header()
    h = h[:-1] + b",}"
    d.raw = struct.pack("<Q", len(h)) + h + d.data
def m_nan(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, extra=',"note":' + rng.choice(["NaN", "Infinity", "-Infinity"]))
def m_big_number(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, extra=',"note":' + rng.choice(["1e400", "-1e400", "1e300", "1e-400", "9" * 400, "9" * 300,
                                                          "-9223372036854775809"]))
def m_lone_surrogate(rng, d):
    t = rng.choice(d.tensors)
    esc = rng.choice(["\\ud800", "\\udc00", "\\ud83d\\ude00", "\\ud83dx"])
    t.text = _raw_entry(t, extra=',"note":"' + esc + '"')
def m_control_char(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, extra=',"note":"a' + rng.choice(["\t", "\n", "\x01", "\x7f"]) + 'b"')
def m_bad_escape(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, extra=',"note":"' + rng.choice(["\\q", "\\u12", "\\x41", "\\/"]) + '"')
def m_deep(rng, d):
    t = rng.choice(d.tensors)
    t.text = _raw_entry(t, extra=',"note":' + _nest(rng.choice([100, 124, 125, 126, 127, 400])))
def m_non_utf8(rng, d):
    h = d.header()
    i = rng.randint(1, len(h) - 2)
    bad = rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"])
    h2 = h[:i] + bad + h[i:]
    d.raw = struct.pack("<Q", len(h2)) + h2 + d.data
def m_utf8_name(rng, d): rng.choice(d.tensors).name = rng.choice(["é", "模型.weight", "a\u00a0b", ""])
def m_not_object(rng, d):
    h = rng.choice(["[]", '"x"', "1", "null", "true", "[{}]"]).encode()
    d.raw = struct.pack("<Q", len(h)) + h
def m_empty_header(rng, d):
    h = b"{}"
    d.raw = struct.pack("<Q", len(h)) + h + (b"" if rng.random() < 0.5 else bytes(rng.randint(1, 8)))
def m_tiny_file(rng, d): d.raw = bytes(rng.randint(0, 7))
def m_cut(rng, d):
    b = d.bytes()
    d.raw = b[:rng.randint(0, len(b) - 1)]
def m_garbage(rng, d): d.raw = bytes(rng.getrandbits(8) for _ in range(rng.randint(8, 64)))


MUTATIONS = [v for k, v in sorted(globals().items()) if k.startswith("m_")]


def case(i: int) -> tuple[str, bytes]:
    """(mutation name, file bytes) for case i; the same i always gives the same bytes."""
    rng = random.Random(i)
    mutate = MUTATIONS[i % len(MUTATIONS)]
    for _ in range(20):
        doc = valid_doc(rng)
        if mutate(rng, doc) is not False:
            return mutate.__name__[2:], doc.bytes()
    return "none", valid_doc(rng).bytes()


def st_bytes(tensors: dict[str, tuple[str, list[int], tuple[int, int]]], data: bytes, *, metadata=None,
             extra: str = "") -> bytes:
    """A safetensors file from explicit entries {name: (dtype, shape, (begin, end))}: for hand-made corrupt files."""
    head = {} if metadata is None else {"__metadata__": metadata}
    head.update({n: {"dtype": dt, "shape": sh, "data_offsets": list(off)} for n, (dt, sh, off) in tensors.items()})
    text = json.dumps(head)[:-1] + extra + "}" if extra else json.dumps(head)
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + data


def edited(data: bytes, edit=None, *, tail: bytes = b"", length_delta: int = 0) -> bytes:
    """A safetensors file with its header dict changed by `edit` (in place, or returning raw header bytes)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    raw = edit(header) if edit is not None else None
    if raw is None:
        raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) + length_delta) + raw + data[8 + n:] + tail
