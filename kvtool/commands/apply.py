"""`kvtool apply`: run a YAML recipe (convert, rope, quantize-kv, lint, eval) as one gated pipeline."""

from __future__ import annotations

import re
from typing import Optional

import typer

from kvtool import progress as kv_progress
from kvtool.errors import UsageError

FORMATS = ("text", "json")
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d{1,3})?")


def register(app: typer.Typer) -> None:
    @app.command("apply", help="Run a recipe (ordered convert / rope / quantize-kv / lint / eval steps) with quality gates.")
    def apply(
        recipe: str = typer.Argument(..., help="Recipe YAML file (see recipes/)."),
        src: str = typer.Argument(..., help="Source model folder (never modified)."),
        dst: str = typer.Argument(..., help="Output folder; created only when every step and gate passes."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Validate the recipe against SRC and print the plan; do no work."),
        keep_intermediate: bool = typer.Option(False, "--keep-intermediate", help="Keep each step's output in DST.intermediate/."),
        force: bool = typer.Option(False, "--force", help="Replace a non-empty DST."),
        device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N for steps that run the model."),
        output_format: str = typer.Option("text", "--format", help="text | json (the run report on stdout)."),
        progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help=kv_progress.FLAG_HELP),
    ) -> int:
        import json
        import sys

        from kvtool.recipes.apply import apply_recipe

        if output_format not in FORMATS:
            raise UsageError(f"must be one of {', '.join(FORMATS)}, not {output_format!r}", field="--format")
        if not _DEVICE.fullmatch(device):
            raise UsageError(f"must be one of {', '.join(DEVICES)}, not {device!r}", field="--device")

        def echo(line: str) -> None:
            print(line, file=sys.stderr if output_format == "json" else sys.stdout)

        with kv_progress.session(progress):
            report = apply_recipe(recipe, src, dst, dry_run=dry_run, keep_intermediate=keep_intermediate,
                                  force=force, device=device, echo=echo)
        if output_format == "json":
            typer.echo(json.dumps(report, indent=2, default=str))
        elif not dry_run:
            typer.echo(f"wrote {dst} (report: {dst}/kvtool-report.md)")
        return 0
