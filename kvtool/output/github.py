"""`--format github`: GitHub Actions workflow commands, one annotation per finding.

`::error file=F,line=N,title=CODE::message` (warning / notice for the other severities); values are
escaped as the runner expects (% CR LF in messages, plus : and , in properties).
"""

from __future__ import annotations

from kvtool.io.locations import display_path

COMMANDS = {"error": "error", "warning": "warning", "info": "notice"}


def _data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _prop(text: str) -> str:
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def render_github(reports) -> str:
    lines: list[str] = []
    for rep in reports:
        if rep.error:
            lines.append(f"::error title=kvtool::{_data(f'{rep.model}: {rep.error}')}")
            continue
        for f in rep.findings:
            props = []
            file = display_path(f.file)
            if file:
                props.append(f"file={_prop(file)}")
                if f.line:
                    props.append(f"line={int(f.line)}")
            props.append(f"title={_prop(f.code)}")
            msg = f"{f.code} [{f.name}] {f.message}"
            if f.path:
                msg += f" ({f.path})"
            if f.hint:
                msg += f"\nhint: {f.hint}"
            lines.append(f"::{COMMANDS.get(f.severity, 'notice')} {','.join(props)}::{_data(msg)}")
    return "\n".join(lines) + ("\n" if lines else "")
