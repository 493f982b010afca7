"""`kvtool lint`: validate checkpoints before deployment."""

from __future__ import annotations

import typer

from kvtool.commands.options_cli import command
from kvtool.errors import EXIT_FINDINGS, EXIT_INPUT, EXIT_OK, UsageError
from kvtool.options.lint import LintOptions


def register(app: typer.Typer) -> None:
    @command(app, LintOptions, help="Validate config.json and safetensors headers of one or more checkpoints (no "
                                    "weights loaded). Exit 0: clean; 1: findings at failing severity; 2: bad input "
                                    "or usage. Defaults come from [tool.kvtool] in the nearest pyproject.toml.")
    def lint(o: LintOptions) -> int:
        from kvtool.rules.config_file import find_pyproject, load_settings
        from kvtool.io.inputfile import not_regular
        from kvtool.recipes.lint import lint_recipe
        from kvtool.rules.engine import lint_one
        from kvtool.output import FORMATS, render
        from kvtool.rules.registry import LintOptions as EngineOptions, Selection

        if o.config is not None and o.isolated:
            raise UsageError("--config and --isolated exclude each other")
        why = not_regular(o.config) if o.config is not None else None
        if why:  # "not found", or what it is instead of a file (a folder, a FIFO)
            raise UsageError(why, file=str(o.config), option="config")
        settings = load_settings(None if o.isolated else (o.config or find_pyproject()), formats=tuple(FORMATS))
        fmt = o.format or settings.format or "text"
        if fmt not in FORMATS:
            raise UsageError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}", option="format")
        tp = o.tensor_parallel_size if o.tensor_parallel_size is not None else settings.tensor_parallel_size
        if tp is not None and tp < 1:
            raise UsageError(f"must be a positive integer, got {tp}", option="tensor_parallel_size")
        chosen = tuple(c.upper() for c in _split(o.select)) or settings.select or ("KV",)
        dropped = tuple(c.upper() for c in _split(o.ignore)) if o.ignore is not None else (settings.ignore or ())
        _check_selectors([*chosen, *dropped, *(c for cs in settings.per_file_ignores.values() for c in cs)])
        is_strict = o.strict if o.strict is not None else bool(settings.strict)
        opts = EngineOptions(tensor_parallel_size=tp, selection=Selection(select=chosen, ignore=dropped),
                             strict=is_strict, require_weights=o.require_weights,
                             per_file_ignores=settings.per_file_ignores)
        reports = [lint_recipe(p, opts) if p.endswith((".yaml", ".yml")) else lint_one(p, opts) for p in o.paths]
        if fmt == "text":  # unusable inputs as one line each on stderr, like every other kvtool error
            from kvtool.output.text import error_line

            for rep in reports:
                if rep.error:
                    typer.echo(error_line(rep), err=True)
        rendered = render(reports, fmt)
        if rendered.strip():
            typer.echo(rendered, nl=False)
        if any(r.error for r in reports):
            return EXIT_INPUT
        if any(r.failing(is_strict) for r in reports):
            return EXIT_FINDINGS
        return EXIT_OK


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def _check_selectors(selectors) -> None:
    from kvtool.rules.engine import check_selectors

    check_selectors(selectors, field="--select/--ignore")
