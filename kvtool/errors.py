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
        return one_line(f"{where}{self.message}")


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
