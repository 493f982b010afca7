"""Parsing and printing sizes (5GB, 80GiB) and percentages (2%)."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


class ValueRefused(ValueError):
    """The one error of kvtool's parsers of untrusted values (sizes, integers, numbers from the command line, a
    recipe, pyproject.toml or a model's files): the CLI shows it as one exit-2 line, a caller that knows the
    field names it (docs/input-limits.md)."""


# Python's int() refuses decimal strings over 4300 digits (sys.get_int_max_str_digits) with a ValueError, and
# str.isdigit() accepts digits int() refuses ('²'); kvtool reads integers written in ASCII digits only
INT_MAX_DIGITS = 4300
_PLAIN_INT = re.compile(r"-?[0-9]+")


def plain_int(text, *, max_digits: int = INT_MAX_DIGITS) -> int | None:
    """`text` as an int when it is an optionally signed run of ASCII digits of at most `max_digits` digits (what
    int() reads the same everywhere); None for anything else ('²', '٣', ' 1', '1_0', 5000 digits)."""
    if not isinstance(text, str) or not _PLAIN_INT.fullmatch(text) or len(text.lstrip("-")) > max_digits:
        return None
    return int(text)


def cli_number(text: str, kind: type) -> int | float:
    """A number typed on the command line as kvtool reads it everywhere (the fast reader, click, a recipe's YAML):
    ASCII only. int() alone also reads '٣', full-width digits, '1_000' and ' 7 ' (click's INT is int()), and
    refuses 4301 digits with a ValueError of its own; float() reads the same non-ASCII digits. ValueRefused for
    anything else."""
    if kind is int:
        value = plain_int(text.removeprefix("+") if isinstance(text, str) else text)
        if value is None:
            raise ValueRefused(f"{text!r:.60} is not a valid integer")
        return value
    if not isinstance(text, str) or not text.isascii() or "_" in text:
        raise ValueRefused(f"{text!r:.60} is not a valid float")
    try:
        return float(text)
    except ValueError:
        raise ValueRefused(f"{text!r:.60} is not a valid float") from None


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '80GiB' -> 85_899_345_920. Raises ValueRefused on nonsense or past 4 EiB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text), re.ASCII)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueRefused(f"not a size: {text!r} (use e.g. 5GB, 80GiB, 512MiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not value < 2**62:  # 4 EiB; also catches a digit string that overflows to inf
        raise ValueRefused(f"not a size: {text!r} is larger than 4 EiB")
    return int(value)


def parse_kv_budget(text: str) -> tuple[str, float]:
    """`--kv-budget`: ("bytes", n) for bytes with a unit (7.5KiB, 7680B), ("fraction", f) for 0.33 / 33%, with
    0 < f <= 1. Raises ValueRefused otherwise (a size past 4 EiB, a fraction above 1, a digit run float() makes 0
    or inf)."""
    t = str(text).strip()
    if t[-1:] in ("B", "b"):
        return "bytes", float(parse_size(t))
    try:
        if not t.isascii():
            raise ValueError
        frac = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueRefused(f"{text!r}: give bytes with a unit (7.5KiB, 7680B) or a fraction of the source's KV "
                           "cache (0.33, 33%)") from None
    if not t.endswith("%") and frac > 1 and math.isfinite(frac):
        raise ValueRefused(f"{text!r}: give bytes with a unit (e.g. {int(frac)}B) or a fraction of the source's KV "
                           "cache (0.33, 33%)")
    if not 0 < frac <= 1:
        raise ValueRefused(f"{text!r}: a fraction of the source's KV cache must be above 0 and at most 1")
    return "fraction", frac


def parse_percent(text: str) -> float:
    """'2%' -> 0.02, '0.02' -> 0.02."""
    s = str(text).strip()
    try:
        if not s.isascii():  # float() reads '٣' and full-width digits; nobody types them on purpose
            raise ValueError
        value = float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError:
        raise ValueRefused(f"not a percentage: {text!r} (use e.g. 2% or 0.02)") from None
    return gate_threshold(value, text)


def gate_threshold(value: float, text: object = None) -> float:
    """A quality-gate limit: finite and >= 0 (NaN would make every comparison pass)."""
    if not math.isfinite(value) or value < 0:
        raise ValueRefused(f"{text if text is not None else value!r} is not a finite number >= 0")
    return value


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"
