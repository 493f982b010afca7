"""`kvtool lint`: validate checkpoints before deployment."""

from __future__ import annotations

import typer

from kvtool.commands.options_cli import command
from kvtool.errors import EXIT_FINDINGS, EXIT_INPUT, EXIT_OK
from kvtool.options.lint import LintOptions


def register(app: typer.Typer) -> None:
    @command(app, LintOptions, help="Validate config.json and safetensors headers of one or more checkpoints (no "
                                    "weights loaded). Exit 0: clean; 1: findings at failing severity; 2: bad input "
                                    "or usage. Defaults come from [tool.kvtool] in the nearest pyproject.toml.")
    def lint(o: LintOptions) -> int:
        from kvtool.output import FORMATS, render
        from kvtool.recipes.lint import lint_recipe
        from kvtool.rules.run import apply, plan

        p = plan(o, formats=tuple(FORMATS))
        if p.compat:
            return _compat(p)
        reports = apply(p, by_suffix={".yaml": lint_recipe, ".yml": lint_recipe})
        if p.format == "text":  # unusable inputs as one line each on stderr, like every other kvtool error
            from kvtool.output.text import error_line

            for rep in reports:
                if rep.error:
                    typer.echo(error_line(rep), err=True)
        rendered = render(reports, p.format)
        if rendered.strip():
            typer.echo(rendered, nl=False)
        if any(r.error for r in reports):
            return EXIT_INPUT
        if any(r.failing(p.engine.strict) for r in reports):
            return EXIT_FINDINGS
        return EXIT_OK


def _compat(p) -> int:
    """`kvtool lint --compat`: one table per model; exit 2 when a model could not be read."""
    import json

    from kvtool.engines.compat import render_text
    from kvtool.rules.run import apply_compat

    results = apply_compat(p)
    for path, _, error in results:
        if error:
            typer.echo(f"kvtool: error: {error}" if error.startswith(path) else f"kvtool: error: {path}: {error}",
                       err=True)
    if p.format == "json":
        doc = {"models": [{"model": path, "compat": [r.as_dict() for r in table]}
                          for path, table, _ in results if table is not None]}
        typer.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        for path, table, _ in results:
            if table is not None:
                typer.echo(render_text(path, table), nl=False)
    return EXIT_INPUT if any(error for _, _, error in results) else EXIT_OK
