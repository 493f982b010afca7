"""Whether a release is inside an engine fact's release range (a PEP 440 specifier set), mostly without packaging.

Importing packaging.specifiers costs ~15 ms (it imports packaging.tags, platform and logging): a tenth of a cold
`kvtool lint` that only asks whether the installed transformers 5.24.0 is inside `<4.43`. The ranges the facts
are written in, `<`, `<=`, `>`, `>=`, `==` or `!=` and a plain release number (`>=4.43,<4.51`), asked about a
plain release number (4.44.2) or a post-release of one (vLLM's 0.5.3.post1), are decided here: for those PEP 440
compares the release numbers with trailing zeros dropped (4.43 == 4.43.0), then the post-release number, and
none of its pre-release or local-version rules applies. Any other range or release (wildcards, `~=`, `===`,
`4.45.0rc1`, `1!2.0`) is packaging.specifiers' answer, as is a range given on the command line.
tests/engines/test_ranges.py checks the two agree.
"""

from __future__ import annotations

import operator
import re
from functools import lru_cache


_CLAUSE = re.compile(r"(<=|>=|<|>|==|!=)([0-9]+(?:\.[0-9]+)*)")
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
        "!=": operator.ne}


# a release the fast path decides: plain, or plain with a post-release number in PEP 440's spelling (0.5.3.post1)
_RELEASE = re.compile(r"([0-9]+(?:\.[0-9]+)*)(?:\.post([0-9]+))?")


def _release(v: str) -> tuple[int, ...]:
    """A plain release number as PEP 440 compares it: 4.43.0 -> (4, 43)."""
    parts = [int(p) for p in v.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


@lru_cache(maxsize=None)
def _plain_clauses(text: str) -> tuple[tuple[str, tuple[int, ...]], ...] | None:
    """((operator, release), ...) when every clause of `text` is a plain comparison, else None."""
    out = []
    for part in text.split(","):
        m = _CLAUSE.fullmatch(part.strip())
        if m is None:
            return None
        out.append((m.group(1), _release(m.group(2))))
    return tuple(out)


@lru_cache(maxsize=None)
def specifier(text: str):
    """packaging's SpecifierSet of `text` (InvalidSpecifier for a malformed one)."""
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(text)


def check(text: str) -> None:
    """Raise packaging's InvalidSpecifier when `text` is not a PEP 440 specifier set."""
    if _plain_clauses(text) is None:
        specifier(text)


def contains(text: str, version: str) -> bool:
    """`version in SpecifierSet(text)`."""
    clauses = _plain_clauses(text)
    m = _RELEASE.fullmatch(version)
    if clauses is None or m is None:
        return version in specifier(text)
    # PEP 440 orders X.postN after X and before the next release: (release, N), a plain release N = -1. Only `>`
    # differs: `>X` excludes X's post-releases (they are not greater than X "by release"), so it compares releases.
    v = (_release(m.group(1)), int(m.group(2)) if m.group(2) is not None else -1)
    return all(v[0] > release if op == ">" else _OPS[op](v, (release, -1)) for op, release in clauses)
