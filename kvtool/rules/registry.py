"""Rule codes and checkers: one registry, like ruff's codes table.

Topic modules declare their rules with `define(...)` (stable code, kebab-case name, severity, doc
with What it does / Why it matters / Example / Fix) and their checkers with `@checker`. A checker
receives a LintContext and reports findings by code; reporting an undefined code is a bug.
`RULES` and `CHECKERS` are kvtool.registry.Registry objects filled by the modules in `TOPICS`
(imported by name on first lookup): a new topic module is one line there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from typing import Callable

from kvtool.console import escape
from kvtool.registry import Registry

SEVERITY_ORDER = {"info": 0, "warning": 1, "error": 2}


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    severity: Severity
    summary: str  # one line, shown by `kvtool rules`
    written_doc: str  # the doc as written in the topic module (indented); `doc` is it dedented
    hint: str = ""  # default fix hint
    topic: str = ""

    @property
    def doc(self) -> str:
        """Full text for `kvtool rule CODE`: dedented when read, not when ~80 rules load (a cold lint reads none)."""
        return _dedent(self.written_doc)


@dataclass
class Finding:
    code: str
    name: str
    severity: str
    message: str
    path: str | None  # dotted config key or tensor name
    file: str | None
    hint: str
    line: int | None = None

    def __post_init__(self) -> None:
        # a message is one display line: a config key or tensor name it quotes may hold a newline or an escape
        # sequence (a rope_scaling key "\n" once split a message); the path keeps the name as the file has it
        object.__setattr__(self, "message", escape(self.message))

    def as_dict(self) -> dict:
        return {
            "code": self.code, "name": self.name, "severity": self.severity, "message": self.message,
            "path": self.path, "file": self.file, "hint": self.hint, "line": self.line,
        }


# The modules that define rules and checkers, in checker order (a topic module is listed here, once).
TOPICS = tuple(f"kvtool.rules.{m}" for m in (
    "dtype", "engines", "heads", "internal", "mla_moe", "numbers", "positions", "quantization", "recipe", "rope", "schema",
    "security", "sliding", "vocab", "weights"))
RULES: Registry[Rule] = Registry("rule", modules=TOPICS, unknown="unknown {kind} {name!r}; `kvtool rules` lists them")
CHECKERS: Registry[tuple[str, Callable]] = Registry("checker", modules=TOPICS)  # "topic.function" -> (topic, function)
# Renamed or merged codes keep working: old -> new (ruff's redirect table).
REDIRECTS: dict[str, str] = {}


def define(code: str, name: str, severity: Severity | str, summary: str, doc: str, *, hint: str = "",
           topic: str = "") -> Rule:
    if code in RULES.registered():
        raise ValueError(f"rule code {code} defined twice")
    if any(r.name == name for r in RULES.registered().values()):
        raise ValueError(f"rule name {name} defined twice")
    return RULES.add(code, Rule(code, name, Severity(severity), summary, doc, hint, topic))


def checker(topic: str) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        CHECKERS.add(f"{topic}.{fn.__name__}", (topic, fn))
        return fn
    return deco


def resolve_code(code: str) -> str:
    return REDIRECTS.get(code, code)


@lru_cache(maxsize=None)
def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text).strip("\n")


@dataclass
class Selection:
    """--select / --ignore by code or prefix (KV1 selects KV100..KV199)."""

    select: tuple[str, ...] = ("KV",)
    ignore: tuple[str, ...] = ()

    def allows(self, code: str) -> bool:
        def best(prefixes):
            hits = [p for p in prefixes if code.startswith(resolve_code(p) if p in REDIRECTS else p)]
            return max((len(p) for p in hits), default=-1)

        s, i = best(self.select), best(self.ignore)
        return s >= 0 and s > i


@dataclass
class LintOptions:
    tensor_parallel_size: int | None = None
    selection: Selection = field(default_factory=Selection)
    strict: bool = False
    require_weights: bool = False  # KV613 (weights not pulled, LFS pointers) becomes an error
    # [tool.kvtool.per-file-ignores]: glob on the model path or a finding's file -> codes / prefixes switched off
    per_file_ignores: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the engine releases checked (kvtool.engines.releases.Checked); empty: the installed ones, else the newest known
    engines: tuple = ()
