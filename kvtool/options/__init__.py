"""One options object per operation (lint, kv-budget, convert, rope, quantize-kv, eval, apply), declared once.

kvtool/options/fields.py is the declaration machinery; each operation's module declares its fields. The typer
flags, the recipe-step schema and the docs tables are generated from them (`python -m kvtool.options --write`
regenerates the committed ones). No typer, no torch.
"""

from __future__ import annotations

import importlib

from kvtool.options.fields import OPERATIONS

# every operation's declaring module, in `kvtool --help` order
MODULES = ("lint", "kv_budget", "convert", "eval", "rope", "quantize_kv", "apply")


def load_all() -> dict[str, type]:
    """Command name -> options class, for every declared operation."""
    for name in MODULES:
        importlib.import_module(f"kvtool.options.{name}")
    return {cmd: cls for cmd, cls in OPERATIONS.items() if cls.__module__.startswith("kvtool.options.")}
