"""`kvtool lint`, `kv-budget`, `rope` and `convert` without the typer CLI: their command lines read from the
options declaration (kvtool/options) and handed to the command's own callback.

Importing typer and click and building the command tree cost more than linting a model folder (issue 30); a
small conversion waits on them too (none of the four imports typer or click on this path). This
reader takes only the command lines it reads exactly as click does: the declared flag spellings, `--flag VALUE`
and `--flag=VALUE`, `--x` / `--no-x` for negatable switches, positional arguments in their declared number,
values converted by the same kvtool.units.cli_number / Path() as the typer CLI's types. Anything else (`--help`, an unknown,
misspelt or repeated option, a missing value, a value that does not convert, `--`) returns None and the typer
CLI reads it, so help, usage errors and their wording stay click's, generated from the same declaration.
tests/options/test_argv.py checks that every command line read here gives the options typer gives.
"""

from __future__ import annotations

import os
from importlib import import_module
from pathlib import Path
from typing import Any, Callable

from kvtool.options.fields import OPERATIONS, Field, fields_of

# the commands whose start-up is the point: command -> its module in kvtool/commands
DIRECT = {"lint": "lint", "kv-budget": "kv_budget", "rope": "rope", "convert": "convert"}


class Direct:
    """What `register(app)` is given instead of a typer app: it keeps each command's callback, nothing else
    (kvtool.commands.options_cli.command builds no typer signature for it)."""

    direct = True

    def __init__(self) -> None:
        self.callbacks: dict[str, Callable[..., int]] = {}

    def command(self, name: str, **_typer_settings: Any) -> Callable:
        def keep(callback: Callable[..., int]) -> Callable[..., int]:
            self.callbacks[name] = callback
            return callback

        return keep


def direct_call(argv: list[str]) -> Callable[[], int] | None:
    """The command `argv` runs, ready to call, or None when the typer CLI must read `argv`."""
    if not argv or argv[0] not in DIRECT:
        return None
    app = Direct()
    import_module(f"kvtool.commands.{DIRECT[argv[0]]}").register(app)
    kwargs = read(OPERATIONS[argv[0]], argv[1:])
    if kwargs is None:
        return None
    callback = app.callbacks[argv[0]]
    return lambda: callback(**kwargs)


def read(options: type, args: list[str]) -> dict[str, Any] | None:
    """The keyword arguments typer would pass the callback of `options`' command for `args`, or None when
    this reader leaves `args` to click."""
    fields = [f for f in fields_of(options) if f.spec.cli]
    switches: dict[str, tuple[Field, bool]] = {}  # --isolated, --strict / --no-strict
    takes_value: dict[str, Field] = {}
    for f in fields:
        if f.spec.positional:
            continue
        spellings = [*f.flags, *([f.spec.short] if f.spec.short else [])]
        if f.base_type is bool and not f.is_list:
            if f.spec.negatable and not f.spec.short:
                switches.update({s: (f, True) for s in f.flags})
                switches.update({"--no-" + s[2:]: (f, False) for s in f.flags})
            elif not f.spec.negatable and f.default is False:
                switches.update({s: (f, True) for s in spellings})
            else:
                return None  # a switch click would read another way: left to it
        elif f.base_type in (str, int, float, Path):
            takes_value.update({s: f for s in spellings})
        else:
            return None
    given: dict[str, Any] = {}
    positional: list[str] = []
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("-") or arg == "-":
            if arg == "-":
                return None  # click's "-" (stdin): left to it
            positional.append(arg)
            continue
        name, eq, attached = arg.partition("=")
        if arg in switches:
            f, value = switches[arg]
        elif name in takes_value and not (eq and len(name) == 2):  # click reads -c=1 as -c "=1"
            f = takes_value[name]
            if eq:
                raw = attached
            elif rest:
                raw = rest.pop(0)  # click takes the next word whatever it looks like (--select --help: "--help")
            else:
                return None
            value = _convert(f, raw)
            if value is _REFUSED:
                return None
        else:
            return None  # --help, -h, --, an unknown or misspelt option, --switch=VALUE
        if f.name in given and not f.is_list:
            return None  # given twice: click keeps the last; left to it
        if f.is_list:
            given.setdefault(f.name, []).append(value)
        else:
            given[f.name] = value
    for f in fields:
        if f.spec.positional:
            continue
        if f.name not in given:
            if f.required:
                return None
            given[f.name] = f.default
    args_fields = [f for f in fields if f.spec.positional]
    for i, f in enumerate(args_fields):
        if f.is_list:  # nargs=-1: what the other arguments leave (click allows one such argument)
            after = len(args_fields) - i - 1
            values, positional = positional[:len(positional) - after], positional[len(positional) - after:]
            if not values and f.required:
                return None
            converted = [_convert(f, v) for v in values]
            if _REFUSED in converted:
                return None
            given[f.name] = converted if values else f.default
        elif positional:
            value = _convert(f, positional.pop(0))
            if value is _REFUSED:
                return None
            given[f.name] = value
        elif f.required:
            return None  # click: missing argument
        else:
            given[f.name] = f.default
    if positional:
        return None  # click: unexpected extra argument
    return given


_REFUSED = object()


def _convert(f: Field, raw: str) -> Any:
    """raw as click's type for the field converts it, or _REFUSED where click would refuse it (or might)."""
    kind = f.base_type
    if kind is str:
        return raw
    if kind is Path:  # click.Path(readable=True): an existing path this process cannot read is refused
        try:
            os.stat(raw)
        except OSError:
            return Path(raw)
        except ValueError:  # an embedded NUL
            return _REFUSED
        return Path(raw) if os.access(raw, os.R_OK) else _REFUSED
    if kind in (int, float):  # ASCII digits only, as the typer CLI reads them (kvtool.units.cli_number)
        from kvtool.units import ValueRefused, cli_number

        try:
            return cli_number(raw, kind)
        except ValueRefused:
            return _REFUSED
    try:
        return kind(raw)
    except (TypeError, ValueError):
        return _REFUSED
