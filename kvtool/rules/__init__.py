"""Lint rules: `registry.py` holds the codes and checkers, one module per topic defines them (listed in
registry.TOPICS), `engine.py` runs them."""

from __future__ import annotations


def load_all() -> None:
    """Import every topic module (registry.TOPICS) once, so their rules and checkers are registered."""
    from kvtool.rules.registry import CHECKERS, RULES

    RULES.load()
    CHECKERS.load()
