"""Predicates on raw config.json values, shared by the lint rules and the RoPE table.

JSON booleans are Python ints, and configs carry Infinity / NaN: both must fail a "number" check.
"""

from __future__ import annotations

import math


def is_int(v) -> bool:
    """An integer that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
