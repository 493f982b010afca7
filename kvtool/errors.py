"""Errors that end a command with a documented exit code (ruff's contract).

Exit codes: 0 success / nothing at failing severity, 1 findings or a failed quality gate,
2 usage error, unreadable or invalid input, internal error, or stdout that could not be written;
141 (kvtool.console.EXIT_PIPE) stdout's reader went away (docs/exit-codes.md).
"""

from __future__ import annotations

from kvtool.console import escape

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_INPUT = 2


def one_line(text: str) -> str:
    """`text` with every character that could break the one-line error contract escaped: a folder or
    shard named with a newline must not let a checkpoint forge a second `kvtool: error:` line."""
    return escape(text)


MAX_LINE = 4000  # characters of one error line (escaped); longer is cut, saying how much was left out
LIST_LIMIT = 8  # names one message lists before "and N more" (a line stays a line: tests/hostile)


def listed(items, limit: int = LIST_LIMIT, sep: str = ", ") -> str:
    """`items` joined for a message, at most `limit` of them, then "and N more": a model folder or a
    registry of 40,000 names never makes a 640 KB error line."""
    items = [str(i) for i in items]
    if len(items) <= limit:
        return sep.join(items)
    return f"{sep.join(items[:limit])}{sep}and {len(items) - limit:,} more"


class KvtoolError(Exception):
    """An error reported as one line, never a traceback."""

    exit_code = EXIT_INPUT

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None,
                 option: str | None = None):
        self.message = message
        self.file = file
        self.field = field  # what the line names: a config key, a recipe path, or an option as its caller spells it
        self.option = option  # the options field (kvtool/options) the error is about, e.g. "groups"
        super().__init__(self.line())

    def name_option(self, spelling: str) -> KvtoolError:
        """Name the option field as the caller spells it (the CLI: --groups; a recipe: steps[0].convert.groups)."""
        self.field = spelling
        self.args = (self.line(),)
        return self

    def relocate(self, temporary: str, user: str) -> KvtoolError:
        """Name the user's path where the error names kvtool's temporary one (a staging or work folder)."""
        if self.file:
            self.file = self.file.replace(temporary, user)
        self.message = self.message.replace(temporary, user)
        self.args = (self.line(),)
        return self

    def line(self) -> str:
        where = ""
        if self.file:
            where = f"{self.file}: "
        if self.field or self.option:
            where += f"{self.field or self.option}: "
        text = one_line(f"{where}{self.message}")
        if len(text) > MAX_LINE:  # the backstop behind `listed`: no value a file supplies makes a line of megabytes
            text = f"{text[:MAX_LINE]}... ({len(text) - MAX_LINE:,} characters more)"
        return text


class InputError(KvtoolError):
    """Bad or unreadable input: exit 2."""


class UsageError(KvtoolError):
    """Options that contradict each other or the model: exit 2."""


class GateFailed(KvtoolError):
    """A quality gate or lint at failing severity: exit 1."""

    exit_code = EXIT_FINDINGS


# The signals (SIGINT, SIGTERM) this process received, appended by kvtool's handlers: an error raised after one
# is the interrupt's, even where a library turned it into its own (numpy interrupted mid-import: ImportError).
SIGNALS_RECEIVED: list[int] = []
