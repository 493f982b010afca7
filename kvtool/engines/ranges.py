"""Whether a release is inside an engine fact's release range: a PEP 440 specifier set, read by packaging.

STYLE.md 14: ranges are parsed by `packaging.specifiers`, never by hand. It is imported on first use (~15 ms of a
cold `kvtool lint`), and each range is parsed once per process.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=None)
def specifier(text: str):
    """packaging's SpecifierSet of `text` (InvalidSpecifier for a malformed one)."""
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(text)


def contains(text: str, version: str) -> bool:
    """`version in SpecifierSet(text)` (pre-releases only where packaging admits them)."""
    return version in specifier(text)
