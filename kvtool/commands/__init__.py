"""The commands: one module each, whose `register(app)` adds its command(s) to the typer app.

`COMMANDS` (a kvtool.registry.Registry) holds them in `kvtool --help` order, imported by name from `MODULES`
on its first lookup (kvtool/commands/argv.py imports one command module alone): a new command is a module here
plus its name in `MODULES`; a listed module that is missing is an error.
"""

from __future__ import annotations

from kvtool.registry import Registry

MODULES = ("lint", "rules", "kv_budget", "convert", "eval", "rope", "quantize_kv", "apply", "fixtures")
COMMANDS: Registry = Registry("command", modules=(f"{__name__}.registered",))
