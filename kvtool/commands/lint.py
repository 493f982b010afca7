"""`kvtool lint`: validate checkpoints before deployment."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtool import console
from kvtool.commands.options_cli import command
from kvtool.errors import EXIT_FINDINGS, EXIT_INPUT, EXIT_OK
from kvtool.options.lint import LintOptions


if TYPE_CHECKING:  # typer is imported by the typer CLI only (kvtool/commands/argv.py)
    import typer


def register(app: typer.Typer) -> None:
    @command(app, LintOptions, help="Validate config.json and safetensors headers of one or more checkpoints (no "
                                    "weights loaded). Exit 0: clean; 1: findings at failing severity; 2: bad input "
                                    "or usage. Defaults come from [tool.kvtool] in the nearest pyproject.toml.")
    def lint(o: LintOptions) -> int:
        from kvtool.output import FORMATS, render
        from kvtool.rules.run import apply, plan

        p = plan(o, formats=tuple(FORMATS))
        if p.compat:
            return _compat(p)
        reports = apply(p, by_suffix={".yaml": _lint_recipe, ".yml": _lint_recipe})
        if p.format == "text":  # unusable inputs as one line each on stderr, like every other kvtool error
            from kvtool.output.text import error_line

            for rep in reports:
                if rep.error:
                    console.out(error_line(rep), err=True)
        rendered = render(reports, p.format)
        if rendered.strip():
            console.out(rendered)
        if any(r.error for r in reports):
            return EXIT_INPUT
        if any(r.failing(p.engine.strict) for r in reports):
            return EXIT_FINDINGS
        return EXIT_OK


def _lint_recipe(*args, **kwargs):
    """kvtool.recipes.lint.lint_recipe, imported (with PyYAML) only when a recipe is linted."""
    from kvtool.recipes.lint import lint_recipe

    return lint_recipe(*args, **kwargs)


def _compat(p) -> int:
    """`kvtool lint --compat`: one table per model; exit 2 when a model could not be read."""
    from kvtool.engines.compat import render_text
    from kvtool.rules.run import apply_compat

    results = apply_compat(p)
    for path, _, error in results:
        if error:
            console.out(f"kvtool: error: {error}" if error.startswith(path) else f"kvtool: error: {path}: {error}",
                        err=True)
    if p.format == "json":
        doc = {"models": [{"model": path, "compat": [r.as_dict() for r in table]}
                          for path, table, _ in results if table is not None]}
        console.out(console.json_text(doc, indent=2, sort_keys=True))
    else:
        for path, table, _ in results:
            if table is not None:
                console.out(console.lines(render_text(path, table).splitlines()))
    return EXIT_INPUT if any(error for _, _, error in results) else EXIT_OK
