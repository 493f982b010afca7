"""`kvtool apply`: run a YAML recipe (convert, rope, quantize-kv, lint, eval) as one gated pipeline."""

from __future__ import annotations

import re

import typer

from kvtool import console
from kvtool import progress as kv_progress
from kvtool.commands.options_cli import command
from kvtool.errors import UsageError
from kvtool.options.apply import DEVICES, FORMATS, ApplyOptions

_DEVICE = re.compile(r"auto|cpu|cuda(:\d{1,3})?")


def register(app: typer.Typer) -> None:
    @command(app, ApplyOptions, help="Run a recipe (ordered convert / rope / quantize-kv / lint / eval steps) with "
                                     "quality gates.")
    def apply(o: ApplyOptions) -> int:
        from kvtool.recipes.apply import apply_recipe

        if o.format not in FORMATS:
            raise UsageError(f"must be one of {', '.join(FORMATS)}, not {o.format!r}", option="format")
        if not _DEVICE.fullmatch(o.device):
            raise UsageError(f"must be one of {', '.join(DEVICES)}, not {o.device!r}", option="device")

        def echo(line: str) -> None:
            console.out(line, err=o.format == "json")

        with kv_progress.session(o.progress):
            report = apply_recipe(o.recipe, o.src, o.dst, dry_run=o.dry_run, keep_intermediate=o.keep_intermediate,
                                  force=o.force, device=o.device, echo=echo)
        if o.format == "json":
            console.out(console.json_text(report, indent=2, default=str))
        elif not o.dry_run:
            console.out(f"wrote {o.dst} (report: {o.dst}/kvtool-report.md)")
        return 0
