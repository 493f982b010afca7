"""File paths as CI systems want them: relative to the working directory when inside it."""

from __future__ import annotations

import os
from pathlib import Path


def display_path(file: str | None) -> str | None:
    """A finding's file relative to the current directory when it lies inside it, else absolute."""
    if not file:
        return None
    p = Path(file)
    try:
        absolute = p if p.is_absolute() else Path.cwd() / p
        rel = os.path.relpath(absolute, Path.cwd())
    except (OSError, ValueError):  # another drive on Windows, a deleted cwd
        return str(p)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return str(absolute)
    return rel
