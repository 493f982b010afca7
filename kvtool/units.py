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


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '80GiB' -> 85_899_345_920. Raises ValueError on nonsense."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 5GB, 80GiB, 512MiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not value < 2**62:  # 4 EiB; also catches a digit string that overflows to inf
        raise ValueError(f"not a size: {text!r} is larger than 4 EiB")
    return int(value)


def parse_percent(text: str) -> float:
    """'2%' -> 0.02, '0.02' -> 0.02."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError:
        raise ValueError(f"not a percentage: {text!r} (use e.g. 2% or 0.02)") from None
    return gate_threshold(value, text)


def gate_threshold(value: float, text: object = None) -> float:
    """A quality-gate limit: finite and >= 0 (NaN would make every comparison pass)."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text if text is not None else value!r} is not a finite number >= 0")
    return value


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"
