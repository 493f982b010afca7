"""`kvtool rope`: apply, verify and explain RoPE scaling (config edit only; never imports torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtool import console
from kvtool.commands.options_cli import command
from kvtool.options.rope import RopeOptions


if TYPE_CHECKING:  # typer is imported by the typer CLI only (kvtool/commands/argv.py)
    import typer


def register(app: typer.Typer) -> None:
    @command(app, RopeOptions, help="Apply, verify and explain RoPE scaling (yarn, llama3, longrope, linear, dynamic); "
                                    "writes config.json only, other files are copied unchanged.")
    def rope(opts: RopeOptions) -> int:
        from kvtool.rope.command import run

        return run(opts, echo=console.out)
