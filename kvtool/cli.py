"""The `kvtool` command line. Each command lives in kvtool/commands/<name>.py, listed in COMMANDS.modules, and
registers itself (`@COMMANDS.register(name)` on its `register(app)`); a listed module that is missing is an error.

Heavy libraries (torch, transformers) are imported inside the commands that need them, and `kvtool lint`,
`kvtool kv-budget` and `kvtool rope` run without typer and click (`kvtool convert` without the typer app)
when kvtool/commands/argv.py reads their command line (the typer app, `app`, is built on first use), so
they start fast.
"""

from __future__ import annotations

import functools
import io
import os
import signal
import sys

from kvtool import console
from kvtool.errors import EXIT_INPUT, SIGNALS_RECEIVED, KvtoolError, one_line
from kvtool.units import ValueRefused


@functools.cache
def _typer_app():
    """The typer app with every command of kvtool.commands.COMMANDS (imports typer, click and every command)."""
    import typer

    from kvtool.commands import COMMANDS

    app = typer.Typer(
        name="kvtool",
        help="Make LLM checkpoints safe and cheap to serve: lint, KV budget, GQA/MQA conversion, RoPE, FP8 KV, eval.",
        add_completion=False,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120, "terminal_width": 110},
    )

    @app.callback()
    def _root(
        version: bool = typer.Option(False, "--version", help="Print the kvtool version and exit.",
                                     callback=_print_version, is_eager=True),
    ) -> None:
        """Make LLM checkpoints safe and cheap to serve."""

    for register in COMMANDS.values():
        register(app)
    return app


def __getattr__(name: str):
    if name == "app":  # `from kvtool.cli import app`: the typer app, built on first use
        return _typer_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _print_version(value: bool) -> None:
    if value:
        import typer

        from kvtool import __version__

        console.out(f"kvtool {__version__}")
        raise typer.Exit(0)


class _ClosedStdin(io.StringIO):
    """An empty stdin: input() raises EOFError; it has no file descriptor to hand on."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation("kvtool does not read stdin")


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line errors and ruff-style exit codes, never a traceback."""
    # kvtool never reads stdin: a library prompt (transformers' "run the custom code? [y/N]") gets EOF
    # at once, never an answer piped in by `yes y |`, and never stalls on an open pipe
    saved, sys.stdin = sys.stdin, _ClosedStdin()
    console.FAILED.clear()  # what this run could not write (main() may run several times in one process: tests)
    try:
        return _main(argv)
    finally:
        sys.stdin = saved


def _main(argv: list[str] | None) -> int:
    from kvtool.commands.argv import direct_call

    staging = sys.modules.get("kvtool.io.staging")  # not imported yet: nothing written (lint imports none)
    if staging is not None:
        staging.COMPLETED.clear()  # what this run writes (main() may run several times in one process: tests)
    try:
        call = direct_call(sys.argv[1:] if argv is None else argv)  # lint, kv-budget, rope, convert
        rv = call() if call is not None else _typer_main(argv)
    except KvtoolError as exc:
        return _error(f"kvtool: error: {exc.line()}", exc.exit_code)
    except (KeyboardInterrupt, _CommandInterrupted):  # Ctrl-C, or SIGTERM (kvtool.io.staging.Interrupted)
        return _interrupted()
    except (BrokenPipeError, _PipeClosed):  # the reader of stdout went away: the shell's SIGPIPE status, no line
        return console.EXIT_PIPE
    except Exception if SIGNALS_RECEIVED else ():  # an interrupt a library turned into its own error
        return _interrupted()
    except ModuleNotFoundError as exc:
        from kvtool.deps import missing

        args = sys.argv[1:] if argv is None else argv
        command = next((a for a in args if not a.startswith("-")), None)
        err = missing(exc.name or "", f"kvtool {command}" if command else None)
        if err is None or os.environ.get("KVTOOL_DEBUG"):
            return _internal(exc)
        return _error(f"kvtool: error: {err.line()}", err.exit_code)
    except console.OutputFailed as exc:  # stdout on a full device: say so, and whether DST is written
        from kvtool.io.staging import COMPLETED

        done = f"; {', '.join(str(p) for p in COMPLETED)} is written" if COMPLETED else ""
        return _error(f"kvtool: error: {exc.stream}: cannot write: {exc.strerror}{done}", EXIT_INPUT)
    except OSError as exc:  # the system refused (a name too long, a read-only or vanished place): not a kvtool bug
        where = f"{exc.filename}: " if exc.filename else ""
        return _error(f"kvtool: error: {one_line(where + (exc.strerror or str(exc)))}", EXIT_INPUT)
    except ValueRefused as exc:  # a parser of an untrusted value no caller named the field of: still one line
        return _error(f"kvtool: error: {one_line(str(exc))}", EXIT_INPUT)
    except Exception as exc:  # noqa: BLE001 - the contract is one line, not a traceback
        return _internal(exc)
    return rv if isinstance(rv, int) else 0


def _typer_main(argv: list[str] | None) -> int:
    """Every command line kvtool/commands/argv.py leaves: typer and click read it (help, usage errors)."""
    import click
    import typer

    cmd = typer.main.get_command(_typer_app())
    for sub in getattr(cmd, "commands", {}).values():
        sub.callback = _carry_interrupts(sub.callback)
    _plain_help(cmd)
    streams = console.standard_streams()
    try:
        rv = cmd.main(args=argv, prog_name="kvtool", standalone_mode=False)
        if rv == 130:  # typer's silent exit for a Ctrl-C outside a command's body (while parsing arguments)
            return _interrupted()
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except SystemExit:
        if console.standard_streams() == streams:
            raise
        # click ends a broken pipe (its help, a usage line) with exit 1 over its own stream wrappers: kvtool's
        console.restore_streams(streams)
        return console.EXIT_PIPE
    except click.exceptions.Abort:
        console.out("kvtool: aborted", err=True)
        return 130
    except click.exceptions.NoArgsIsHelpError as exc:  # bare `kvtool`: the help, as a usage error
        exc.show()
        return EXIT_INPUT
    except click.ClickException as exc:
        console.out(f"kvtool: error: {one_line(_click_line(exc))}", err=True)
        return EXIT_INPUT
    return rv


class _CommandInterrupted(BaseException):
    """Ctrl-C / SIGTERM in a command, carried past typer (which turns KeyboardInterrupt into a silent 130)."""


class _PipeClosed(BaseException):
    """stdout's reader went away in a command, carried past click (which turns EPIPE into exit 1)."""


def _carry_interrupts(callback):
    if callback is None or getattr(callback, "_kvtool_carries", False):
        return callback

    @functools.wraps(callback)
    def run(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except KeyboardInterrupt as exc:
            raise _CommandInterrupted() from exc
        except BrokenPipeError as exc:
            raise _PipeClosed() from exc

    run._kvtool_carries = True
    return run


def _interrupted() -> int:
    """Exit 130 with one line saying what was, and was not, written."""
    from kvtool.io.staging import interrupted_line

    return _error(interrupted_line(), 130)


def _internal(exc: BaseException) -> int:
    if os.environ.get("KVTOOL_DEBUG"):
        raise exc
    return _error(f"kvtool: internal error: {type(exc).__name__}: {one_line(str(exc))} (set KVTOOL_DEBUG=1 for a "
                  "traceback)", EXIT_INPUT)


def _error(line: str, code: int) -> int:
    """Print the one error line on stderr and return the exit code (stderr gone too: the code alone)."""
    try:
        console.out(line, err=True)
    except OSError:
        pass
    return code


def _click_line(exc) -> str:
    """A click usage error in kvtool's one format, `FIELD: message`, plus where to read more."""
    import click

    param = getattr(exc, "param", None)
    field = None
    if param is not None:
        field = param.opts[0] if isinstance(param, click.Option) and param.opts else param.human_readable_name
    if isinstance(exc, click.MissingParameter):
        kind = "option" if isinstance(param, click.Option) else "argument"
        msg = f"missing required {kind}"
    elif isinstance(exc, click.NoSuchOption):
        field = exc.option_name
        msg = "no such option"
        if exc.possibilities:
            msg += f" (did you mean {', '.join(sorted(exc.possibilities))}?)"
    elif isinstance(exc, click.BadParameter):
        msg = exc.message
    else:
        msg = exc.format_message()
        if msg[:2].istitle():  # click's "No such command 'x'." in kvtool's lower-case style
            msg = msg[0].lower() + msg[1:]
    msg = msg.rstrip(".")
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and isinstance(exc, click.UsageError):
        usage = ctx.get_usage().replace("Usage: ", "", 1).strip()
        msg += f"; usage: {usage} (see {ctx.command_path} --help)"
    return f"{field}: {msg}" if field else msg


def _plain_help(cmd) -> None:
    """Two typer 0.20 / click 8.5 help defects, mended here for every command:
    - typer escapes the `[default: ...]` / `[required]` brackets for rich whenever rich is installed, even
      with rich_markup_mode=None, so plain help would show a backslash before each bracket;
    - click's Parameter.__init__ resets the help typer set on arguments, so SRC / DST had none; with the
      help put back, click 8.5's own "Positional arguments" section would repeat typer's "Arguments"."""
    import inspect

    import click
    import typer

    class Formatter(click.HelpFormatter):
        def write_dl(self, rows, *args, **kwargs):
            rows = [(a, b.replace("\\[", "[")) for a, b in rows]
            super().write_dl(rows, *args, **kwargs)

    class Context(click.Context):
        formatter_class = Formatter

    arg_help = {}
    for info in _typer_app().registered_commands:
        name = info.name or info.callback.__name__.replace("_", "-")
        arg_help[name] = {p: d.default.help for p, d in inspect.signature(info.callback).parameters.items()
                          if isinstance(d.default, typer.models.ArgumentInfo) and d.default.help}
    for name, c in [(None, cmd), *getattr(cmd, "commands", {}).items()]:
        c.context_class = Context
        c.format_arguments = lambda ctx, formatter: None  # typer writes the arguments (with their help) itself
        if not isinstance(c, click.Group):  # a group's options section also lists its commands
            c.format_options = functools.partial(_sections, c)
        for param in c.params:
            if isinstance(param, click.Argument) and not getattr(param, "help", None):
                param.help = arg_help.get(name, {}).get(param.name)


def _sections(cmd, ctx, formatter) -> None:
    """Arguments, Options, then one section per group of options that work with one target or method
    ("With --to mla": kvtool.options.fields.Spec.applies): the plain-help twin of typer's rich_help_panel, which
    typer's plain formatter drops."""
    args: list = []
    sections: dict[str, list] = {"Options": []}
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        if param.param_type_name == "argument":
            args.append(record)
        else:
            sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
    for title, rows in [("Arguments", args), *sections.items()]:
        if rows:
            with formatter.section(title):
                formatter.write_dl(rows)


def _entry() -> None:
    console.claim_standard_streams()  # first: a closed stdout / stderr never lends its number to a file
    # fd 0 too, so no library (or child process) can read the caller's stdin
    fd = os.open(os.devnull, os.O_RDONLY)
    if fd != 0:  # with stdin closed (`<&-`) /dev/null is opened as fd 0 itself: keep it there
        os.dup2(fd, 0)
        os.close(fd)
    signal.signal(signal.SIGTERM, _sigterm)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # a closed terminal: SIGTERM's cleanup; nohup's stands
        signal.signal(signal.SIGHUP, _sigterm)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the caller ignores Ctrl-C
        signal.signal(signal.SIGINT, _sigint)
    console.guard_streams()  # a library's own log lines are escaped too
    try:
        rc = main()
    except KeyboardInterrupt:  # between main's own handler and the exit
        rc = _interrupted()
    rc = console.settle(rc)  # output that could not be delivered never ends in success
    if sys.argv[1:2] and sys.argv[1] in _NO_TEARDOWN and "torch" not in sys.modules:
        os._exit(rc)  # console.settle() has flushed stdout and stderr
    sys.exit(rc)


# Commands that end holding no open file, running thread, staging folder or atexit work of their own (lint writes
# only stdout and stderr; kv-budget's --plot file and a convert's staging folder are renamed or removed, and the
# copy thread joined, before main() returns): their exit skips the interpreter's teardown of every loaded module and object,
# ~10 ms of a ~140 ms cold lint, ~15 ms of a convert with numpy (bench/lint_bench.py, bench/convert_bench.py).
# Not after torch loaded: the calibrated paths leave spill folders to weakref finalizers that run at exit.
_NO_TEARDOWN = ("lint", "kv-budget", "convert")


def _sigterm(signum, frame) -> None:
    from kvtool.io.staging import Interrupted

    SIGNALS_RECEIVED.append(signum)
    raise Interrupted()


def _sigint(signum, frame) -> None:
    SIGNALS_RECEIVED.append(signum)
    raise KeyboardInterrupt


if __name__ == "__main__":
    _entry()
