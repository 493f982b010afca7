"""How `kvtool eval` emulates each KV-cache dtype, as data (kv_emulations.json beside kv_dtypes.json). No torch.

A row names its codec (a key of kvtool.eval.codecs.CODECS, checked there: the core imports no feature) and the
codec's params, what vLLM does with a checkpoint's k/v scales, what vLLM's attention reads while it prefills
(`reads`: first / later chunk, raw | cache | a chunk-size threshold, cited; `first_prefill` derives from it), and
whether the round trip is checked bit for bit against vLLM's code (`match: exact`) or holds under a named
CUDA-only assumption (`assumed`). What a dtype stores (bits, boundary layers, group sizes) is its kv_dtypes.json
row (`kv_dtypes.get(name)`); an alias (fp8 -> fp8_e4m3) is a row with `alias_of`.

The same file is the one home of what vLLM reads for every --kv-cache-dtype (`reads()`: the emulated rows' reads
and `not_emulated`'s, one row per kv_dtypes.json name), which `kvtool eval --server` accounts its served figures
by (kvtool.eval.served_reads), with what vLLM's CPU build reads (`cpu_reads()`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Mapping

from kvtool.model.engine_tables import Citation, citation, load, path

SCALES = ("checkpoint", "ignored", "dynamic")  # what vLLM does with a checkpoint's k/v scales
FIRST_PREFILL = ("raw", "cache")  # what vLLM's first prefill chunk attends over (Reads.first_prefill)
READS = ("raw", "cache")  # a chunk's read, or an int N: from the cache when the chunk has at most N tokens, raw above
_READS_FIELDS = ("first", "later", "citation", "lossless", "why")
MATCH = ("exact", "assumed")
CITATION_KEYS = ("release", "file", "function")  # + optional "excerpt" (a file under tests/data/vllm/<release>/)
_FIELDS = ("codec", "params", "scales", "reads", "match", "assumption", "oracle", "fp8_attention",
           "citation")
NAME = "kvtool/model/kv_emulations.json"  # an engine table (kvtool.model.engine_tables.TABLES)
FILE = path(NAME)

# what the report says each `scales` value means
SCALES_WORDS = {"checkpoint": "the checkpoint's k/v scales (1.0 without them)",
                "ignored": "own per-token-head scales from each absmax; checkpoint scales ignored",
                "dynamic": "computed from the data as vLLM does; checkpoint scales ignored"}


@dataclass(frozen=True)
class Reads:
    """What vLLM's attention reads while it prefills a --kv-cache-dtype's prompt: its own chunk's K/V as computed
    (raw) or read back from the cache (cache), for the request's first chunk and for every later one."""

    name: str
    first: str | int | None  # the request's first chunk: raw | cache | N (cache up to N tokens) | None (unserved)
    later: str | int | None  # continuation chunks, the same
    citation: Citation
    lossless: bool = False  # auto: the cache holds the model's own dtype
    why: str | None = None  # first None: why

    @property
    def cite(self) -> str:
        return self.citation.cited("vLLM")

    def own_chunk_cached(self, first_chunk: bool, length: int) -> bool | None:
        """Whether a chunk of `length` tokens reads its own K/V back from the cache (None: not known)."""
        rule = self.first if first_chunk else self.later
        if rule is None:
            return None
        if isinstance(rule, int):
            return length <= rule
        return rule == "cache"

    @property
    def first_prefill(self) -> str | None:
        """What a first prefill chunk longer than any threshold attends over: raw | cache (None: unserved)."""
        return None if self.first is None else ("cache" if self.first == "cache" else "raw")


@dataclass(frozen=True)
class Emulation:
    name: str
    codec: str  # kvtool.eval.codecs.CODECS key
    params: Mapping[str, Any]
    scales: str  # SCALES
    reads: Reads  # what vLLM's attention reads while it prefills
    match: str  # MATCH
    assumption: str | None  # match "assumed": the CUDA-only rounding assumed, in one sentence
    oracle: str  # the test that checks the round trip against vLLM's code (path::name)
    citation: Citation
    # --fp8-attention's backends (queries / probabilities in e4m3) apply: true (all), false (none) or the names of
    # those that do (kvtool.eval.fp8_backends; fp8_e5m2: cache-only and cpu, vLLM's CPU build)
    fp8_attention: bool | tuple[str, ...] = False
    alias_of: str | None = None

    @property
    def cite(self) -> str:
        return self.citation.cited("vLLM")

    @property
    def first_prefill(self) -> str | None:
        """FIRST_PREFILL: whether vLLM's first prefill chunk attends over the raw K/V (a threshold row's longer
        chunks do: raw) or reads the cache; its reads' (never None here: parse refuses an emulated row with first
        null)."""
        return self.reads.first_prefill


def _reads_problem(row: Any) -> str | None:
    """Why a reads row is malformed (its field and what is wrong), or None."""
    if not isinstance(row, dict):
        return "must be an object"
    unknown = set(row) - set(_READS_FIELDS)
    if unknown:
        return f"{sorted(unknown)[0]}: unknown field"
    for key in ("first", "later"):
        v = row.get(key, "missing")
        if not (v is None or v in READS or (isinstance(v, int) and not isinstance(v, bool) and v > 0)):
            return f"{key}: must be raw, cache, a positive token count or null, got {v!r}"
    if (row["first"] is None) != (row["later"] is None) or (row["first"] is None and not row.get("why")):
        return "first / later null only together, with why"
    return None


def _reads(name: str, row: dict, where: str) -> Reads:
    problem = _reads_problem(row)
    if problem:
        raise ValueError(f"{where}.{problem}")
    return Reads(name, row["first"], row["later"], citation(row.get("citation"), f"{where}.citation"),
                 bool(row.get("lossless")), row.get("why"))


def _problem(row: Any, codecs) -> str | None:
    """Why a row of the table is malformed (the field and what is wrong), or None."""
    if not isinstance(row, dict):
        return "must be an object"
    unknown = set(row) - set(_FIELDS) - {"alias_of"}
    if unknown:
        return f"{sorted(unknown)[0]}: unknown field"
    if "alias_of" in row:
        return None if set(row) == {"alias_of"} else "alias_of: an alias has no other field"
    for f in _FIELDS:
        if f not in row and f != "fp8_attention":
            return f"{f}: missing"
    if not isinstance(row["codec"], str) or (codecs is not None and row["codec"] not in codecs):
        return f"codec: {row['codec']!r} is not a codec" + (f" ({', '.join(codecs)})" if codecs is not None else "")
    if not isinstance(row["params"], dict):
        return "params: must be an object"
    for f, allowed in (("scales", SCALES), ("match", MATCH)):
        if row[f] not in allowed:
            return f"{f}: {row[f]!r} is not one of {', '.join(allowed)}"
    if (row["match"] == "assumed") != isinstance(row["assumption"], str):
        return "assumption: a sentence exactly when match is assumed"
    if not isinstance(row["oracle"], str) or "::" not in row["oracle"]:
        return "oracle: a test as path::name"
    c = row["citation"]
    if not isinstance(c, dict) or set(c) - {*CITATION_KEYS, "excerpt"} or any(
            not isinstance(c.get(k), str) or not c.get(k) for k in CITATION_KEYS):
        return f"citation: an object of {', '.join(CITATION_KEYS)} (and optionally excerpt), each a string"
    fa = row.get("fp8_attention", False)
    if not isinstance(fa, bool) and not (isinstance(fa, list) and fa and all(isinstance(n, str) for n in fa)):
        return "fp8_attention: true, false or a list of --fp8-attention names"
    if (problem := _reads_problem(row["reads"])) is not None:
        return f"reads.{problem}"
    if row["reads"]["first"] is None:
        return "reads.first: an emulated dtype is one vLLM serves (null only in not_emulated)"
    return None


def parse(data: Any, codecs=None, dtypes=None, file: str = str(FILE)) -> tuple[str, dict[str, Emulation]]:
    """(release, name -> row) from the table's JSON; a malformed row is a ValueError naming file and field.
    codecs: the codec names a row may name (kvtool.eval.codecs.CODECS; None: not checked here); dtypes: the
    --kv-cache-dtype names a key may be (default: kv_dtypes.json's)."""
    from kvtool.model import kv_dtypes

    known = kv_dtypes.names() if dtypes is None else dtypes
    if not isinstance(data, dict) or not isinstance(data.get("emulations"), dict) or \
            not isinstance(data.get("release"), str):
        raise ValueError(f"{file}: must hold release and emulations")
    raw = data["emulations"]
    rows: dict[str, Emulation] = {}
    for name, row in raw.items():
        if name not in known:
            raise ValueError(f"{file}: emulations.{name}: not a --kv-cache-dtype of kv_dtypes.json")
        problem = _problem(row, codecs)
        if problem:
            raise ValueError(f"{file}: emulations.{name}.{problem}")
    for name, row in raw.items():
        source = row.get("alias_of", name)
        if source not in raw or "alias_of" in raw[source]:
            raise ValueError(f"{file}: emulations.{name}.alias_of: {source!r} is not a row of the table")
        r = raw[source]
        rows[name] = Emulation(
            name=name, codec=r["codec"], params=MappingProxyType(dict(r["params"])), scales=r["scales"],
            reads=_reads(name, r["reads"], f"{file}: emulations.{source}.reads"), match=r["match"], assumption=r["assumption"], oracle=r["oracle"],
            citation=citation(r["citation"], f"{file}: emulations.{source}.citation"),
            fp8_attention=_fp8_attention(r.get("fp8_attention", False)),
            alias_of=row.get("alias_of"))
    return data["release"], rows


def _fp8_attention(value: bool | list) -> bool | tuple[str, ...]:
    return value if isinstance(value, bool) else tuple(value)


def takes_fp8_attention(row: Emulation, name: str) -> bool:
    """The row's cache goes with --fp8-attention `name` (a row's fp8_attention: true, or a list naming it)."""
    return row.fp8_attention is True or (isinstance(row.fp8_attention, tuple) and name in row.fp8_attention)


def parse_reads(data: Any, rows: Mapping[str, Emulation], dtypes=None, file: str = str(FILE)) -> dict[str, Reads]:
    """--kv-cache-dtype -> Reads for every name of kv_dtypes.json: the emulated rows' (`rows`, from parse) and
    not_emulated's, in kv_dtypes.json's order; a name with none or two is a ValueError naming file and field."""
    from kvtool.model import kv_dtypes

    known = kv_dtypes.names() if dtypes is None else dtypes
    rest = data.get("not_emulated") if isinstance(data, dict) else None
    if not isinstance(rest, dict):
        raise ValueError(f"{file}: not_emulated: the reads of the dtypes eval does not emulate, by name")
    out: dict[str, Reads] = {}
    for name, row in rest.items():
        if name not in known:
            raise ValueError(f"{file}: not_emulated.{name}: not a --kv-cache-dtype of kv_dtypes.json")
        if name in rows:
            raise ValueError(f"{file}: not_emulated.{name}: an emulated dtype's reads are its row's")
        out[name] = _reads(name, row, f"{file}: not_emulated.{name}")
    missing = [n for n in known if n not in rows and n not in out]
    if missing:
        raise ValueError(f"{file}: not_emulated.{missing[0]}: missing (every --kv-cache-dtype has its reads)")
    return {n: rows[n].reads if n in rows else out[n] for n in known}


@lru_cache(maxsize=1)
def _load() -> tuple[str, dict[str, Emulation], dict[str, Reads], Any]:
    t = load(NAME)  # the one table format (about, release, emulations, ...; every citation in the one form)
    data = json.loads(path(NAME).read_text(encoding="utf-8"))
    release, rows = parse(data)
    return release, rows, parse_reads(data, rows), t


def release() -> str:
    return _load()[0]


def table() -> dict[str, Emulation]:
    """name -> row, in the file's order."""
    return _load()[1]


def reads() -> dict[str, Reads]:
    """What vLLM's attention reads while it prefills, for every --kv-cache-dtype (emulated or not)."""
    return _load()[2]


def reads_of(name: str) -> Reads | None:
    return reads().get(name)


def cpu_reads() -> dict:
    """What vLLM's CPU build reads (the lane's engine): {"about", "release", "first", "later", "dtypes",
    "citation": Citation}."""
    return _load()[3]["cpu"]


def skip_prefix_cache_citation() -> Citation:
    """Where vLLM skips the prefix cache for a request that asks for prompt log-probabilities."""
    return _load()[3]["prompt_logprobs_skip_prefix_cache_citation"]


def names() -> tuple[str, ...]:
    return tuple(table())


def get(name: str) -> Emulation | None:
    return table().get(name)
