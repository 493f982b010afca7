"""Lint output formats: one renderer per format, registered in FORMATS (a kvtool.registry.Registry)."""

from __future__ import annotations

from typing import Callable

from kvtool.output.github import render_github
from kvtool.output.json_format import render_json
from kvtool.output.sarif import render_sarif
from kvtool.output.text import render_text
from kvtool.registry import Registry

FORMATS: Registry[Callable] = Registry("format", option="format")
for _name, _render in (("text", render_text), ("json", render_json), ("sarif", render_sarif),
                       ("github", render_github)):
    FORMATS.add(_name, _render)
del _name, _render


def render(reports, fmt: str) -> str:
    return FORMATS[fmt](reports)
