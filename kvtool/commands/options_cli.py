"""Typer commands generated from an operation's declared options (kvtool/options): the one place that turns a
field into a flag, and an error that names a field into one that names the flag. typer is imported only to
build the typer command (kvtool/commands/argv.py runs lint, kv-budget and rope without it)."""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, List, Optional

from kvtool.errors import KvtoolError
from kvtool.options.fields import Field, check_paths, field_named, fields_of

if TYPE_CHECKING:
    import typer


def typer_annotation(f: Field) -> Any:
    """The annotation typer reads for a field: Optional[...] / List[...] spelled the typing way."""
    base = f.base_type
    if f.is_list:
        t = List[base]
        return Optional[t] if f.default is None else t
    return Optional[base] if f.default is None else base


def typer_default(f: Field) -> Any:
    """typer.Argument / typer.Option for a field (its default, flags and help)."""
    import typer

    s = f.spec
    default = ... if f.required else f.default
    extra: dict = {}
    if s.metavar:
        extra["metavar"] = s.metavar
    if not s.show_default:
        extra["show_default"] = False
    if f.applies_to:  # its own section of --help (kvtool.cli._plain_help writes the sections)
        extra["rich_help_panel"] = f"With {f.applies_to}"
    if s.positional:
        return typer.Argument(default, help=s.help, **extra)
    names = list(f.flags)
    if s.negatable:  # --eval/--no-eval
        names = [f"{n}/--no-{n[2:]}" for n in names]
    if s.short:
        names.append(s.short)
    if f.base_type in (int, float) and not f.is_list:
        extra["click_type"] = _number_type(f.base_type)
    return typer.Option(default, *names, help=s.help, **extra)


def _number_type(kind: type):
    """click's INT / FLOAT read with kvtool.units.cli_number: ASCII digits only, one meaning with the fast reader
    (kvtool/commands/argv.py) and a recipe (issue 39: '٣' was 3 here and refused elsewhere)."""
    import click

    from kvtool.units import ValueRefused, cli_number

    class AsciiNumber(click.ParamType):
        name = "integer" if kind is int else "float"

        def convert(self, value, param, ctx):
            if isinstance(value, kind) and not isinstance(value, bool):
                return value
            try:
                return cli_number(str(value), kind)
            except ValueRefused as exc:
                self.fail(str(exc), param, ctx)

    return AsciiNumber()


def signature_of(cls) -> tuple[inspect.Signature, dict]:
    """(__signature__, __annotations__) of a command function taking every CLI field of `cls`."""
    params, annotations = [], {}
    for f in fields_of(cls):
        if not f.spec.cli:
            continue
        ann = typer_annotation(f)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=typer_default(f),
                                        annotation=ann))
        annotations[f.name] = ann
    annotations["return"] = int
    return inspect.Signature(params, return_annotation=int), annotations


def command(app: typer.Typer, options, help: str, **command_kw) -> Callable:
    """Decorator: register `body(opts) -> int` as the command `options.COMMAND`, its flags generated from the
    options class (command_kw go to typer, e.g. cls=a click command class).
    A KvtoolError naming an options field leaves it naming the flag (`groups` -> `--groups`)."""

    def decorate(body: Callable[[Any], int]) -> Callable:
        @functools.wraps(body)
        def callback(**kwargs: Any) -> int:
            try:
                check_paths(options, kwargs)
                return body(options(**kwargs))  # the options check themselves (kvtool.options.fields.check)
            except KvtoolError as exc:
                if exc.option and not exc.field:
                    exc.name_option(cli_spelling(options, exc.option))
                raise

        del callback.__wrapped__  # typer reads the generated signature, not body's
        if not getattr(app, "direct", False):  # a kvtool.commands.argv.Direct needs no flags
            callback.__signature__, callback.__annotations__ = signature_of(options)
        app.command(options.COMMAND, help=help, **command_kw)(callback)
        return body

    return decorate


def cli_spelling(cls, name: str) -> str:
    """The flag of field `name`; a field another operation declares (a shared library raised it) is
    spelled the same way: --name-with-dashes."""
    f = field_named(cls, name)
    return f.flag if f is not None else "--" + name.replace("_", "-")
