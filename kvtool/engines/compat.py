"""`kvtool lint --compat`: one row per engine release line, what each does with a config.

The rows are the minor releases kvtool knows (transformers 4.38.., vLLM 0.5..), each checked at its newest patch;
consecutive minors with the same verdict share a row so the table fits a screen. A verdict is "reads it as
written", "reads it differently: <what changes>" or "refuses: <the engine's own message>", from the engine facts
(kvtool/engines/facts.py). The other lint rules describe the newest releases (their docs cite them).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.engines.facts import effects
from kvtool.engines.releases import ENGINES, known

AS_WRITTEN = "reads it as written"


@dataclass(frozen=True)
class Row:
    engine: str
    first: str  # the first minor release of the row (newest patch checked), e.g. "4.38.2"
    last: str
    verdict: str  # "as written" | "differently" | "refuses"
    details: tuple[str, ...]  # what changes / the engine's messages

    @property
    def releases(self) -> str:
        a, b = _minor(self.first), _minor(self.last)
        return a if a == b else f"{a}-{b}"

    def text(self) -> str:
        if self.verdict == "as written":
            return AS_WRITTEN
        if self.verdict == "refuses":
            return "refuses: " + "; ".join(d.removeprefix("refuses ") for d in self.details)
        return "reads it differently: " + "; ".join(self.details)

    def as_dict(self) -> dict:
        return {"engine": self.engine, "releases": self.releases, "first": self.first, "last": self.last,
                "verdict": self.verdict, "details": list(self.details)}


def _minor(v: str) -> str:
    return ".".join(v.split(".")[:2])


def line_releases(engine: str) -> tuple[str, ...]:
    """The newest patch of every minor release kvtool knows, oldest first."""
    newest: dict[str, str] = {}
    for v in known()[engine]:
        newest[_minor(v)] = v  # known() is oldest first: the last patch wins
    return tuple(newest.values())


def verdict(spec, engine: str, version: str) -> tuple[str, tuple[str, ...]]:
    found = effects(spec, engine, (version,))
    refusals = tuple(dict.fromkeys(e.text for e in found if e.fact.effect == "refuses"))
    if refusals:
        return "refuses", refusals
    changes = tuple(dict.fromkeys(e.text for e in found))
    return ("differently", changes) if changes else ("as written", ())


def rows(spec, engines: tuple[str, ...] = ENGINES) -> list[Row]:
    out: list[Row] = []
    for engine in engines:
        for v in line_releases(engine):
            kind, details = verdict(spec, engine, v)
            if out and out[-1].engine == engine and (out[-1].verdict, out[-1].details) == (kind, details):
                out[-1] = Row(engine, out[-1].first, v, kind, details)
            else:
                out.append(Row(engine, v, v, kind, details))
    return out


def intended_by(spec) -> dict[str, str]:
    """engine -> the release lines that read the config as written ('4.43-5.25'), for kvtool's own outputs."""
    out = {}
    for engine in ENGINES:
        ok = [r.releases for r in rows(spec, (engine,)) if r.verdict == "as written"]
        out[engine] = ", ".join(ok) if ok else "none"
    return out


def read_as_written(config: dict) -> dict[str, str]:
    """For the kvtool.json of a checkpoint kvtool writes: engine -> the release lines that read its config as
    written ("none" when none does), from the facts table as it stands when the checkpoint is written."""
    from kvtool.model.spec import build_spec

    return intended_by(build_spec(config))


def render_text(model: str, table: list[Row]) -> str:
    width = max(len(f"{r.engine} {r.releases}") for r in table)
    lines = [f"{model}: what each engine release does with it (kvtool lint --compat)"]
    lines += [f"  {f'{r.engine} {r.releases}':<{width}}  {r.text()}" for r in table]
    return "\n".join(lines) + "\n"
