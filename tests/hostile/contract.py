"""The output contract every kvtool run keeps, whatever its input (issue 31, classes 4 and 6).

`check_output(r, fmt, what)` on a harness.Result: exit 0 / 1 / 2 (docs/exit-codes.md); an exit 2 is
exactly one `kvtool: error:` line on stderr (or, in lint's json / sarif / github output, the error in the
document and nothing on stderr); no traceback and
no internal error; every line of stdout and stderr UTF-8 with no raw control character (kvtool.console
escapes them) and no GitHub workflow command (kvtest.runner_command) except, in `--format github`, the
error / warning / notice annotations kvtool means, with only file, line and title properties; JSON
output parses.
"""

from __future__ import annotations

import json
import re

from harness import Result

from kvtest import raw_controls, runner_command

TITLE = re.compile(r"KV\d{3}|kvtool")


def check_output(r: Result, fmt: str, what: str) -> None:
    """The output contract for any run, whatever the input: see the module docstring."""
    assert r.rc in (0, 1, 2), what
    assert "Traceback" not in r.stderr + r.stdout and "internal error" not in r.stderr, what
    assert "\ufffd" not in r.stderr + r.stdout, what  # all output is UTF-8 (lone surrogates escaped)
    if r.rc == 2:  # one line; lint's machine formats carry an unusable input in the document instead
        assert (len(r.lines) == 1 and r.lines[0].startswith("kvtool: error: ")
                or not r.lines and fmt != "text" and r.stdout.strip()), what
    for stream, text in (("stdout", r.stdout), ("stderr", r.stderr)):
        for line in text.split("\n"):
            assert raw_controls(line) == [], f"raw control character on {stream}: {line!r}\n{what}"
            cmd = runner_command(line)
            if fmt == "github" and stream == "stdout":
                assert cmd is not None and cmd[0] in ("error", "warning", "notice") or line == "", what
                assert cmd is None or (set(cmd[1]) <= {"file", "line", "title"}
                                       and TITLE.fullmatch(cmd[1].get("title", "kvtool"))), f"{line!r}\n{what}"
            else:
                assert cmd is None, f"{stream} line starts a workflow command: {line!r}\n{what}"
    if fmt == "json" and r.rc != 2:
        json.loads(r.stdout)


