"""The one place kvtool writes to stdout and stderr: every value escaped, in every format.

A value kvtool prints (a model_type, a folder or tensor name, a recipe string, an exception's text) can
carry characters that rewrite a terminal (ESC, CSI U+009B, OSC), end a line (CR, LF, U+2028), reorder it
(bidi overrides) or make a CI runner execute it: GitHub Actions runs every stdout line that starts with
`::` after white space, and every line that holds `##[name]`, as a workflow command
(actions/runner src/Runner.Common/ActionCommand.cs, TryParseV2 / TryParse). So:

- `escape(value)`: one display line; controls, separators, format characters and lone surrogates become
  visible `\\n`, `\\x1b`, `\\u202e`, `\\ud800` escapes;
- `lines([...])`: rendered output whose lines are escaped one by one (a value holding a newline stays on
  its line), and none of which starts a workflow command unless it is one `command()` built;
- `json_text(obj)`: JSON that stays JSON with the same data, with nothing a terminal or runner acts on;
- `command(name, props, message_lines)`: a GitHub workflow command, with GitHub's own escaping;
- `out(text, err=)`: the only writer; tests/test_console.py fails if anything else prints.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import select
import sys
import unicodedata
from typing import Iterable, TextIO

# Unicode categories shown escaped: controls, format characters (bidi overrides, zero-width, tags), line
# and paragraph separators, surrogates (lone ones cannot even be encoded as UTF-8).
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
_ASCII_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# workflow-command starts (GitHub's two syntaxes), shown with one character escaped
_COMMAND_START = re.compile(r"^(\s*):")
_LEGACY_COMMAND = "##["


def _escape_char(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def unsafe(c: str) -> bool:
    """Whether the character `c` is shown escaped."""
    if c < " " or c == "\x7f":
        return True
    return c >= "\x80" and unicodedata.category(c) in _UNSAFE_CATEGORIES


def escape(value: str) -> str:
    """`value` as one display line: every character a terminal or a log reader would act on escaped, so a
    folder, key or tensor named with a newline or an escape sequence cannot forge or rewrite a line."""
    if value.isascii():
        return _ASCII_CONTROL.sub(lambda m: _escape_char(m.group()), value) if _ASCII_CONTROL.search(value) else value
    return "".join(_escape_char(c) if unsafe(c) else c for c in value)


def _neutral(line: str, command: bool = False) -> str:
    """An escaped line that no CI runner reads as a workflow command (but the `command` it is)."""
    if _LEGACY_COMMAND in line:
        line = line.replace(_LEGACY_COMMAND, "##\\x5b")
    if not command and line.lstrip().startswith("::"):
        line = _COMMAND_START.sub(lambda m: m.group(1) + "\\x3a", line, count=1)
    return line


class _Command(str):
    """A workflow command line `command()` built: the one kind of line allowed to start with `::`."""


class Text(str):
    """Rendered output, safe to write: built only by `lines` and `json_text`; ends with a newline unless empty."""


def lines(items: Iterable[str]) -> Text:
    """Output of these lines, each escaped on its own: a newline inside an item is shown, never written."""
    out = [item if isinstance(item, _Command) else _neutral(escape(str(item))) for item in items]
    return Text("\n".join(out) + "\n" if out else "")


def json_text(obj, **dumps_kw) -> Text:
    """`obj` as JSON (json.dumps keywords), with the same data: non-ASCII as \\u escapes (C1 controls,
    U+2028, bidi, lone surrogates), DEL and the `##[` of a legacy workflow command as \\u escapes too."""
    dumps_kw["ensure_ascii"] = True
    text = json.dumps(obj, **dumps_kw)
    # outside strings JSON has neither DEL nor '#', and neither is part of an escape sequence: both
    # replacements rewrite only string contents, to escapes that decode to the same characters
    text = text.replace("\x7f", "\\u007f").replace(_LEGACY_COMMAND, "##\\u005b")
    return Text(text + "\n")


def _github_data(text: str) -> str:
    return escape(text).replace("%", "%25")


def _github_property(text: str) -> str:
    return _github_data(text).replace(":", "%3A").replace(",", "%2C")


def command(name: str, props: dict, message_lines: Iterable[str]) -> str:
    """`::name k=v,...::message`: a GitHub Actions workflow command. Values get GitHub's escaping (% as %25;
    : and , in properties as %3A / %2C), the message's lines join with %0A (a line break GitHub shows),
    and every other character that could break the line is escaped as in text output."""
    if not re.fullmatch(r"[a-z][a-z-]*", name):
        raise ValueError(f"not a workflow command name: {name!r}")
    shown = ",".join(f"{k}={_github_property(str(v))}" for k, v in props.items() if v not in (None, ""))
    data = "%0A".join(_github_data(m) for m in message_lines)
    return _Command(_neutral(f"::{name}{' ' + shown if shown else ''}::{data}", command=True))


EXIT_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool ended by a closed pipe (`yes | head`)
FAILED: dict[str, OSError] = {}  # the first write that failed on "stdout" / "stderr" this process


class OutputFailed(OSError):
    """Writing kvtool's output failed (a full device): cli.main reports it as one line on stderr."""

    def __init__(self, stream: str, error: OSError):
        super().__init__(error.errno, error.strerror)
        self.stream = stream


def out(text: str | Iterable[str], *, err: bool = False, stream: TextIO | None = None) -> None:
    """Write output: a `Text` as rendered, a plain string as ONE line (escaped), any other iterable as lines.
    `stream` overrides stdout / stderr (progress writes to the stream it was given)."""
    if isinstance(text, Text):
        data = str(text)
    elif isinstance(text, str):
        data = lines([text])
    else:
        data = lines(text)
    _write(data, err=err, stream=stream)


def redraw(line: str, stream: TextIO) -> None:
    """A progress bar's line drawn over the previous one (a carriage return, no newline): kvtool's one \\r."""
    _write("\r" + _neutral(escape(line)), err=True, stream=stream)


def settle(code: int = 0) -> int:
    """At exit: a guarded stream's last partial line and every buffer written; the exit code to use. Output that
    could not be delivered to stdout never leaves a success (docs/exit-codes.md): a reader that closed the pipe
    makes it `EXIT_PIPE` (141, what a shell reports for a tool SIGPIPE ended), any other failure 2 with one line
    (unless an error line was printed already). A stream that failed is pointed at /dev/null, so the interpreter's
    last flush adds no second report (and no exit 120); stderr is best effort (diagnostics, never the verdict)."""
    for name, stream in (("stderr", sys.stderr), ("stdout", sys.stdout)):
        try:
            if isinstance(stream, _Guard):
                stream.close_line()
            if stream is not None:
                stream.flush()
        except (OSError, ValueError) as exc:
            _note_failure(name, exc if isinstance(exc, OSError) else OSError(errno.EBADF, os.strerror(errno.EBADF)))
    lost = FAILED.get("stdout")
    if lost is not None:
        _silence(1)
        if isinstance(lost, BrokenPipeError):
            code = EXIT_PIPE if code != 130 else code
        elif code not in (2, 130):
            try:
                _deliver(lines([f"kvtool: error: stdout: cannot write: {lost.strerror or lost}"]), sys.stderr)
            except (OSError, ValueError, AttributeError):
                pass
            code = 2
    if "stderr" in FAILED:
        _silence(2)
    return code


def _silence(fd: int) -> None:
    """Point `fd` at /dev/null (what failed there stays unwritten; nothing can land there either)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except OSError:
        pass


def stderr() -> TextIO:
    """The stream progress draws on (whether it is a terminal decides how)."""
    return sys.stderr


class _Guard:
    """sys.stdout / sys.stderr for code other than this module (a library's log record or load report, a
    Python warning): what it writes is escaped line by line, as kvtool's own output; kvtool.console writes
    to the stream underneath. A partial line waits for its newline (or the end of the run)."""

    def __init__(self, target: TextIO):
        self.guarded = target
        self._pending = ""

    def write(self, text: str) -> int:
        *done, self._pending = (self._pending + text).split("\n")
        if done:
            self._put("".join(_neutral(escape(line)) + "\n" for line in done))
        return len(text)

    def close_line(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, ""
            self._put(_neutral(escape(pending)) + "\n")

    def _put(self, data: str) -> None:
        """A library's line, delivered as kvtool's own (a failure is remembered: settle() reports lost stdout)."""
        try:
            _deliver(data, self.guarded)
        except OSError as exc:
            name = "stderr" if self is sys.stderr else "stdout"
            _note_failure(name, exc)
            if name == "stdout":
                raise exc if isinstance(exc, BrokenPipeError) else OutputFailed(name, exc) from None

    def __getattr__(self, name):  # flush, isatty, fileno, encoding...: the stream's own
        return getattr(self.guarded, name)


def guard_streams() -> None:
    """Route every other writer of sys.stdout / sys.stderr through the escaping (the CLI's entry point calls it
    before any command, so transformers' and Python's handlers, made later, write through it)."""
    if sys.stdout is not None and not isinstance(sys.stdout, _Guard):
        sys.stdout = _Guard(sys.stdout)
    if sys.stderr is not None and not isinstance(sys.stderr, _Guard):
        sys.stderr = _Guard(sys.stderr)


def _write(data: str, *, err: bool, stream: TextIO | None) -> None:
    target = stream if stream is not None else (sys.stderr if err else sys.stdout)
    standard = stream is None or target is sys.stdout or target is sys.stderr
    name = "stderr" if err or (target is not None and target is sys.stderr) else "stdout"
    target = getattr(target, "guarded", target)  # kvtool's own output is escaped already
    try:
        _deliver(data, target)
    except OSError as exc:
        if standard:
            _note_failure(name, exc)
        if name == "stderr":
            return  # diagnostics: dropped (the exit code still carries the verdict, docs/exit-codes.md)
        if isinstance(exc, BrokenPipeError):
            raise
        raise OutputFailed(name, exc) from None


def _note_failure(name: str, exc: OSError) -> None:
    FAILED.setdefault(name, exc)


def _deliver(data: str, target: TextIO | None) -> None:
    """All of `data` written, or an OSError: a stream on a file descriptor is written with os.write until every
    byte is out, so a short write (a file-size limit, a full device) is an error, never output silently cut
    (Python's buffered writer can drop the error of the write after a short one). A non-blocking descriptor is
    waited on; characters the stream's encoding lacks are written as backslash escapes (PYTHONIOENCODING=ascii)."""
    if target is None:  # the stream was closed before Python started
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    fd = _fileno(target)
    if fd is None:
        target.write(data)
        target.flush()
        return
    target.flush()  # what a library left in the stream's buffer goes first
    view = memoryview(data.encode(getattr(target, "encoding", None) or "utf-8", "backslashreplace"))
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:  # a descriptor someone set O_NONBLOCK on: wait until it takes more
            select.select([], [fd], [])
            continue
        if n <= 0:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        view = view[n:]


def _fileno(target) -> int | None:
    """The descriptor under a file stream (stdout, stderr, an opened file), None for an in-memory one."""
    if not isinstance(target, io.TextIOWrapper):
        return None
    try:
        return target.fileno()
    except (OSError, ValueError):  # io.UnsupportedOperation: a StringIO-like stream (pytest's capsys)
        return None


def standard_streams() -> tuple:
    """sys.stdout and sys.stderr as they are now (kvtool.cli puts them back after click replaced them)."""
    return sys.stdout, sys.stderr


def restore_streams(saved: tuple) -> None:
    sys.stdout, sys.stderr = saved


def claim_standard_streams() -> None:
    """Before anything opens a file: a standard descriptor the caller closed (`>&-`, `2>&-`) gets a read-only
    /dev/null in its place, so no file kvtool opens later takes its number (and no library's or child's print
    lands in it), and a Python stream on it whose writes fail (EBADF): kvtool reports stdout it cannot deliver,
    and drops stderr."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:  # a stream on the descriptor just held (no file is created or opened)
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8"))
