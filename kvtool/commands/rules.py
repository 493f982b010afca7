"""`kvtool rules` and `kvtool rule CODE`: the rule catalogue."""

from __future__ import annotations

import typer

from kvtool import console
from kvtool.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command("rules", help="List every lint rule: code, name, severity, summary.")
    def rules(output_format: str = typer.Option("text", "--format", help="text | json")) -> int:
        from kvtool.rules import load_all
        from kvtool.rules.registry import RULES

        load_all()
        rows = [RULES[c] for c in sorted(RULES)]
        if output_format == "json":
            console.out(console.json_text([{"code": r.code, "name": r.name, "severity": r.severity.value,
                                            "summary": r.summary} for r in rows], indent=2))
            return 0
        console.out([f"{r.code:7} {r.severity.value:8} {r.name:36} {r.summary}" for r in rows])
        return 0

    @app.command("rule", help="Print the documentation of one rule (by code or name).")
    def rule(code: str = typer.Argument(..., help="A rule code such as KV101, or its name.")) -> int:
        from kvtool.rules import load_all
        from kvtool.rules.registry import RULES, resolve_code

        load_all()
        c = resolve_code(code.upper())
        r = RULES.get(c, None) or next((x for x in RULES.values() if x.name == code), None)
        if r is None:
            raise UsageError(f"unknown rule {code!r}; `kvtool rules` lists them")
        console.out([f"{r.code} ({r.name}) [{r.severity.value}]", "", r.summary, "", *r.doc.split("\n")])
        return 0
