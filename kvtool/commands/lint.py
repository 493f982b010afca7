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
