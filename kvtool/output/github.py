"""`--format github`: GitHub Actions workflow commands, one annotation per finding.

`::error file=F,line=N,title=CODE::message` (warning / notice for the other severities), built by
`kvtool.console.command`, which escapes values as the runner expects (% in messages, plus : and , in
properties) and shows every other line-breaking character as in text output; a hint is the message's
second line (%0A).
"""

from __future__ import annotations

from kvtool import console
from kvtool.io.locations import display_path

COMMANDS = {"error": "error", "warning": "warning", "info": "notice"}


def render_github(reports) -> console.Text:
    lines: list[str] = []
    for rep in reports:
        if rep.error:
            lines.append(console.command("error", {"title": "kvtool"}, [f"{rep.model}: {rep.error}"]))
            continue
        for f in rep.findings:
            file = display_path(f.file)
            props = {"file": file, "line": int(f.line) if file and f.line else None, "title": f.code}
            msg = f"{f.code} [{f.name}] {f.message}" + (f" ({f.path})" if f.path else "")
            hint = [f"hint: {f.hint}"] if f.hint else []
            lines.append(console.command(COMMANDS.get(f.severity, "notice"), props, [msg, *hint]))
    return console.lines(lines)
