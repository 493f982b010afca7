"""The commands: one module each, whose `register(app)` adds its command(s) to the typer app.

`COMMANDS` (a kvtool.registry.Registry) holds them in `kvtool --help` order, imported by name from `MODULES`:
a new command is a module here plus its name in `MODULES`; a listed module that is missing is an error.
"""

from __future__ import annotations

from importlib import import_module

from kvtool.registry import Registry

MODULES = ("lint", "rules", "kv_budget", "convert", "eval", "rope", "quantize_kv", "apply", "fixtures")
COMMANDS: Registry = Registry("command")
for _module in MODULES:
    COMMANDS.add(_module.replace("_", "-"), import_module(f"{__name__}.{_module}").register)
del _module
