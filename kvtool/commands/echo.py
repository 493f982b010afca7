"""`echo`: click.echo for the text kvtool prints, without importing click (~40 ms of a cold start).

On a text stream (stdout / stderr, pytest's capture) it does what click.echo does: the message plus a newline,
ANSI escape sequences stripped when the stream is no terminal, then a flush. Any other stream (one click
would re-wrap: an ASCII encoding, no encoding, Windows' console, a Jupyter kernel) goes to click.echo itself.
"""

from __future__ import annotations

import codecs
import io
import re
import sys

_ANSI = re.compile(r"\033\[[0-?]*[ -/]*[@-~]")  # click._compat._ansi_re (click 8.1-8.5)


def echo(message: str = "", nl: bool = True, err: bool = False) -> None:
    """Write `message` (and a newline) to stdout, or to stderr with err=True, as click.echo does."""
    stream = sys.stderr if err else sys.stdout
    if not _plain(stream):
        import click

        click.echo(message, nl=nl, err=err)
        return
    out = message + "\n" if nl else message
    if out:
        if not _isatty(stream):
            out = _ANSI.sub("", out)
        stream.write(out)
    stream.flush()


def _plain(stream) -> bool:
    """A text stream click.echo writes to as it is: encoding and errors set, the encoding not ASCII."""
    if sys.platform == "win32" or not isinstance(stream, io.TextIOWrapper) or not stream.errors:
        return False
    if type(stream).__module__.startswith("ipykernel."):
        return False
    try:
        return codecs.lookup(stream.encoding).name != "ascii"
    except (LookupError, TypeError):
        return False


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except Exception:  # noqa: BLE001 - click.isatty's rule: a stream that cannot say is no terminal
        return False
