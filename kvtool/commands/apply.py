"""`kvtool apply`: run a YAML recipe (convert, rope, quantize-kv, lint, eval) as one gated pipeline."""

from __future__ import annotations

import typer

from kvtool import console
from kvtool import progress as kv_progress
from kvtool.commands.options_cli import command
from kvtool.options.apply import ApplyOptions


def register(app: typer.Typer) -> None:
    @command(app, ApplyOptions, help="Run a recipe (ordered convert / rope / quantize-kv / lint / eval steps) with "
                                     "quality gates.")
    def apply(o: ApplyOptions) -> int:
        from kvtool.recipes.apply import apply_recipe

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
