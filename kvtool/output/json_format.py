"""`--format json`: one stable object, sorted keys."""

from __future__ import annotations

from kvtool import console


def render_json(reports) -> console.Text:
    return console.json_text({"models": [r.as_dict() for r in reports]}, indent=2, sort_keys=True)
