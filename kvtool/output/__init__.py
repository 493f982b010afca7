"""Lint output formats: one renderer per format, looked up in FORMATS."""

from __future__ import annotations

from typing import Callable

from kvtool.output.github import render_github
from kvtool.output.json_format import render_json
from kvtool.output.sarif import render_sarif
from kvtool.output.text import render_text

FORMATS: dict[str, Callable] = {
    "text": render_text,
    "json": render_json,
    "sarif": render_sarif,
    "github": render_github,
}


def render(reports, fmt: str) -> str:
    return FORMATS[fmt](reports)
