"""The option tables in the docs, generated from the declared options.

A command's table sits between `<!-- options:CMD -->` and `<!-- /options:CMD -->` in docs/CMD.md; a command
whose page has no such markers gets its table in docs/options.md instead.
"""

from __future__ import annotations

import re
from dataclasses import MISSING
from pathlib import Path

from kvtool.options.fields import Field, fields_of

DOCS = Path(__file__).resolve().parents[2] / "docs"
FALLBACK = "options.md"
_TYPES = {str: "text", int: "integer", float: "number", bool: "flag", Path: "path"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type(f: Field) -> str:
    if f.choices:
        return " \\| ".join(f"`{c}`" for c in f.choices)
    t = _TYPES.get(f.base_type, f.base_type.__name__)
    return f"{t} (repeatable)" if f.spec.repeatable or f.is_list else t


def _default(f: Field) -> str:
    if f.default is MISSING:
        return "required"
    if f.default is None or f.default == [] or f.default is False:
        return ""
    return f"`{f.default}`"


def _flag(f: Field) -> str:
    if not f.spec.cli:
        return ""
    if f.spec.positional:
        return f.flag if f.required else f"[{f.flag}]"
    names = [f"{n}/--no-{n[2:]}" if f.spec.negatable else n for n in f.flags] + ([f.spec.short] if f.spec.short else [])
    return ", ".join(f"`{n}`" for n in names)


def table(cls) -> str:
    """The markdown table of an operation's options: flag, recipe key, type, default, help."""
    rows = ["| Flag | Recipe key | Type | Default | Help |", "|---|---|---|---|---|"]
    for f in fields_of(cls):
        recipe = f"`{f.recipe_key}`" if f.recipe_key else ""
        text = f"{f.applies_to}: {f.spec.help}" if f.applies_to else f.spec.help  # --help's "With --to mla:"
        rows.append(f"| {_flag(f)} | {recipe} | {_type(f)} | {_default(f)} | {_cell(text)} |")
    return "\n".join(rows) + "\n"


def _markers(cmd: str) -> tuple[str, str]:
    return f"<!-- options:{cmd} -->", f"<!-- /options:{cmd} -->"


def _block(cmd: str, cls) -> str:
    start, end = _markers(cmd)
    return f"{start}\n{table(cls)}{end}"


def has_markers(text: str, cmd: str) -> bool:
    start, end = _markers(cmd)
    return start in text and end in text


def fill(text: str, cmd: str, cls) -> str:
    """`text` with the table between `cmd`'s markers regenerated."""
    start, end = _markers(cmd)
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _m: _block(cmd, cls), text, count=1)


def obsolete(docs: Path = DOCS) -> list[Path]:
    """docs/options.md once every command's page holds its own table."""
    page = docs / FALLBACK
    return [page] if page.exists() and page not in expected(docs) else []


def _fill_kv_dtypes(docs: Path, out: dict[Path, str]) -> None:
    """docs/kv-budget.md's table of vLLM's KV-cache dtypes, generated from kvtool/model/kv_dtypes.json."""
    from kvtool.model import kv_dtypes

    page = docs / "kv-budget.md"
    text = out.get(page) or (page.read_text(encoding="utf-8") if page.exists() else "")
    start, end = "<!-- kv-dtypes -->", "<!-- /kv-dtypes -->"
    if start in text and end in text:
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
        out[page] = pattern.sub(lambda _m: f"{start}\n{kv_dtypes.markdown()}{end}", text, count=1)


def expected(docs: Path = DOCS) -> dict[Path, str]:
    """Every docs file holding option tables, as the declarations say it should read."""
    from kvtool.options import load_all

    out: dict[Path, str] = {}
    fallback = []
    for cmd, cls in load_all().items():
        page = docs / f"{cmd}.md"
        text = out.get(page) or (page.read_text(encoding="utf-8") if page.exists() else "")
        if has_markers(text, cmd):
            out[page] = fill(text, cmd, cls)
        else:
            fallback.append((cmd, cls))
    _fill_kv_dtypes(docs, out)
    if fallback:
        parts = ["# Options of every command\n",
                 "Generated from the declarations in kvtool/options/ (`python -m kvtool.options --write`); "
                 "do not edit the tables by hand.\n"]
        for cmd, cls in fallback:
            parts.append(f"## kvtool {cmd}\n\n{_block(cmd, cls)}\n")
        out[docs / FALLBACK] = "\n".join(parts)
    return out
