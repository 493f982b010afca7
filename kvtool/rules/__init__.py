"""Lint rules. Every module in this package except the plumbing ones is a topic of rules."""

from __future__ import annotations

import importlib
import pkgutil

_PLUMBING = {"registry", "context"}
_loaded = False


def load_all() -> None:
    """Import every topic module once so their rules and checkers register."""
    global _loaded
    if _loaded:
        return
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name not in _PLUMBING:
            importlib.import_module(f"{__name__}.{mod.name}")
    _loaded = True
