"""`kvtool lint`: validate checkpoints before deployment."""

from __future__ import annotations

from typing import List, Optional

import typer

from kvtool.errors import EXIT_FINDINGS, EXIT_INPUT, EXIT_OK


def register(app: typer.Typer) -> None:
    @app.command("lint", help="Validate config.json and safetensors headers of one or more checkpoints (no weights loaded).")
    def lint(
        paths: List[str] = typer.Argument(..., help="Model folders, config.json files or hub ids."),
        output_format: str = typer.Option("text", "--format", "--output-format", help="text | json | sarif | github"),
        select: Optional[str] = typer.Option(None, help="Comma-separated codes or prefixes to enable (default: all)."),
        ignore: Optional[str] = typer.Option(None, help="Comma-separated codes or prefixes to disable."),
        strict: bool = typer.Option(False, "--strict", help="Warnings fail too (exit 1)."),
        tensor_parallel_size: Optional[int] = typer.Option(None, "--tensor-parallel-size", "-tp", help="Check vLLM's divisibility rules for this TP size."),
    ) -> int:
        from kvtool.lint import lint_one
        from kvtool.output import FORMATS, render
        from kvtool.rules.registry import LintOptions, Selection

        if output_format not in FORMATS:
            raise typer.BadParameter(f"unknown format {output_format!r}; choose from {', '.join(FORMATS)}", param_hint="--format")
        sel = Selection(
            select=tuple(_split(select)) or ("KV",),
            ignore=tuple(_split(ignore)),
        )
        opts = LintOptions(tensor_parallel_size=tensor_parallel_size, selection=sel, strict=strict)
        reports = [lint_one(p, opts) for p in paths]
        typer.echo(render(reports, output_format), nl=False)
        if any(r.error for r in reports):
            return EXIT_INPUT
        if any(r.failing(strict) for r in reports):
            return EXIT_FINDINGS
        return EXIT_OK


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]
