"""Which engine releases lint checks: `--engine` requirements, `[tool.kvtool] engines`, the installed ones.

A requirement is an engine name and a PEP 440 specifier (`transformers==4.44.2`, `vllm>=0.6,<0.9`); the range
is parsed by `packaging.specifiers`, never by hand. A range checks every release of schemas/engines/releases.json
inside it; `==X` checks X even when the table does not list it (a release newer than kvtool). Without any
requirement lint checks what the environment has installed, read from package metadata (kvtool.engines.installed:
the engine is never imported), else the newest release kvtool knows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtool.errors import UsageError
from kvtool.model.engine_tables import ENGINES  # the engines lint and kv-budget name: one tuple
# A PEP 508 distribution name at the start of a requirement; the rest is the specifier set packaging reads.
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)\Z", re.S)


@dataclass(frozen=True)
class Checked:
    """The releases of one engine lint checks, and where they came from."""

    engine: str
    versions: tuple[str, ...]  # oldest first
    source: str  # "--engine", "pyproject.toml", "recipe", "installed", "newest known"
    requirement: str = ""  # as the user wrote it

    def describe(self) -> str:
        vs = self.versions
        shown = vs[0] if len(vs) == 1 else f"{len(vs)} releases {vs[0]}..{vs[-1]}"
        # a requirement the user wrote is shown with where it came from; the defaults (installed, newest known) are
        # plain release numbers (the JSON output's "source" says which)
        return f"{self.engine} {shown}" + (f" ({self.requirement} from {self.source})" if self.requirement else "")


def known() -> dict[str, tuple[str, ...]]:
    """engine -> every release kvtool knows, oldest first (schemas/engines/releases.json, kvtool.model.engine_tables)."""
    from kvtool.model import engine_tables

    return {e: engine_tables.known(e) for e in ENGINES}


def newest(engine: str) -> str:
    return known()[engine][-1]


MAX_SEGMENT_DIGITS = 18  # no release number anywhere has a longer segment; int64-safe for every comparison
_LONG_NUMBER = re.compile(r"[0-9]{%d,}" % (MAX_SEGMENT_DIGITS + 1))


def parse(requirement: str, *, option: str | None = None, file: str | None = None, field: str | None = None):
    """'transformers>=4.45,<5' -> ('transformers', SpecifierSet('>=4.45,<5')); one-line UsageError otherwise."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    def bad(msg: str) -> UsageError:
        return UsageError(f"{requirement!r}: {msg}", option=option, file=file, field=field)

    m = _NAME.match(requirement) if isinstance(requirement, str) else None
    if m is None:
        raise bad("expected ENGINE or ENGINE<specifier>, e.g. transformers==4.44.2 or 'vllm>=0.6,<0.9'")
    name = m.group(1).lower().replace("_", "-")
    if name not in ENGINES:
        raise bad(f"unknown engine {m.group(1)!r}; choose from {', '.join(ENGINES)}")
    text = m.group(2).strip()
    if not text.isascii():  # packaging's patterns are ASCII; say so before it does, in one message
        raise bad("a version specifier is written in ASCII (digits 0-9)")
    if _LONG_NUMBER.search(text):  # packaging reads each release segment with int(): Python's 4300-digit limit
        raise bad(f"a release number segment has more than {MAX_SEGMENT_DIGITS} digits")
    try:
        spec = SpecifierSet(text)
    except (InvalidSpecifier, ValueError) as exc:
        raise bad(f"invalid version specifier: {exc}") from None
    return name, spec


def select(engine: str, spec, requirement: str = "", **where) -> tuple[str, ...]:
    """The releases a specifier set checks: the known ones inside it (pre-releases too when pinned)."""
    from packaging.version import InvalidVersion, Version

    inside = [v for v in known()[engine] if spec.contains(v, prereleases=True)]
    pins = [s.version for s in spec if s.operator in ("==", "===") and "*" not in s.version]
    for pin in pins:
        try:
            Version(pin)
        except InvalidVersion:
            raise UsageError(f"{requirement!r}: {pin!r} is not a release number", **where) from None
        if pin not in inside and spec.contains(pin, prereleases=True):
            inside.append(pin)
    if not inside:
        k = known()[engine]
        raise UsageError(f"{requirement!r} matches no {engine} release kvtool knows ({k[0]}..{k[-1]}); pin one "
                         "with ==", **where)
    return tuple(sorted(set(inside), key=Version))


def resolve(requirements, *, source: str, option: str | None = None, file: str | None = None,
            field: str | None = None) -> tuple[Checked, ...]:
    """Requirements (from the flag, pyproject.toml or a recipe) -> what to check; engines not named: `defaults()`."""
    where = {"option": option, "file": file, "field": field}
    named: dict[str, list[tuple[str, object]]] = {}
    for req in requirements:
        name, spec = parse(req, **where)
        named.setdefault(name, []).append((req, spec))
    out = []
    for engine in ENGINES:
        if engine not in named:
            out.append(default(engine))
            continue
        versions: set[str] = set()
        for req, spec in named[engine]:
            versions.update(select(engine, spec, req, **where))
        from packaging.version import Version

        out.append(Checked(engine, tuple(sorted(versions, key=Version)), source,
                           " ".join(req.strip() for req, _ in named[engine])))
    return tuple(out)


def checked_default() -> tuple[Checked, ...]:
    """What lint checks when nothing names an engine: each engine's installed release, else its newest known."""
    return tuple(default(e) for e in ENGINES)


def default(engine: str) -> Checked:
    """The installed release (package metadata, never an import), else the newest known."""
    v = installed(engine)
    if v is not None:
        return Checked(engine, (v,), "installed")
    return Checked(engine, (newest(engine),), "newest known")


def installed(engine: str) -> str | None:
    """The installed release from the package metadata (kvtool.engines.installed reads it as importlib.metadata
    does, without importing it); None when absent, broken or not a PEP 440 version."""
    from kvtool.engines.installed import PLAIN_RELEASE, version

    v = version(engine)
    if v is not None and _LONG_NUMBER.search(v):
        return None  # not a release kvtool can compare (packaging's int() of every segment)
    if v is None or PLAIN_RELEASE.fullmatch(v):  # a plain release number is a valid version: no packaging import
        return v
    from packaging.version import InvalidVersion, Version

    try:
        Version(v)
    except (InvalidVersion, ValueError):
        return None
    return v


def one_release(requirement: str | None, engine: str, *, option: str) -> Checked:
    """The single release an arithmetic follows (kv-budget, rope --show): `engine==X`, else the installed or
    newest known one. A range names several releases whose arithmetic may differ: refused."""
    if requirement is None:
        return default(engine)
    name, spec = parse(requirement, option=option)
    if name != engine:
        raise UsageError(f"{requirement!r}: this option takes a {engine} release", option=option)
    versions = select(engine, spec, requirement, option=option)
    if len(versions) != 1:
        raise UsageError(f"{requirement!r} matches {len(versions)} releases; give one ({engine}==X)", option=option)
    return Checked(engine, versions, "--engine", requirement)


def one_release_of(requirements, engine: str, *, option: str) -> Checked:
    """The one release of `engine` a command follows, from `--engine` as every command declares it (a list of
    requirements, kvtool.options.fields.engine_option; a lone string from the Python API counts as one). Two
    requirements for this engine are refused by name, never the last kept; one for another engine is refused
    by `one_release` (this command follows `engine` only)."""
    reqs = [requirements] if isinstance(requirements, str) else [r for r in (requirements or ()) if r is not None]
    for req in reqs:  # another engine's requirement is refused as itself, never counted as a second release
        if len(reqs) > 1 and parse(req, option=option)[0] != engine:
            return one_release(req, engine, option=option)  # raises: "this option takes a vllm release"
    if len(reqs) > 1:
        from kvtool.errors import listed

        raise UsageError(f"given {len(reqs)} times ({listed(repr(r) for r in reqs)}); this command follows one "
                         f"{engine} release: give --engine once", option=option)
    return one_release(reqs[0] if reqs else None, engine, option=option)


def vllm_max_len_switches(requirement, *, option: str = "engine") -> tuple[Checked, frozenset[str]]:
    """(the vLLM release, the arithmetic switches of schemas/engines/facts.json that hold there); `requirement`:
    --engine's requirements (none: the installed or newest known release)."""
    from kvtool.engines.facts import arithmetic

    release = one_release_of(requirement, "vllm", option=option)
    return release, arithmetic("vllm", release.versions[0])
