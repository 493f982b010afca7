"""Fills kvtool.commands.COMMANDS from MODULES, in order (imported by its first lookup)."""

from __future__ import annotations

from importlib import import_module

from kvtool.commands import COMMANDS, MODULES

for _module in MODULES:
    COMMANDS.add(_module.replace("_", "-"), import_module(f"kvtool.commands.{_module}").register)
