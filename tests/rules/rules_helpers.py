"""Lint a config dict in memory (no files) and pick findings by code: for table-style rule tests."""

from __future__ import annotations

import json
from pathlib import Path

from kvtool.model.checkpoint import Checkpoint
from kvtool.io.jsonfile import JsonDocument
from kvtool.rules import load_all
from kvtool.rules.context import LintContext
from kvtool.rules.registry import CHECKERS, LintOptions
from kvtool.model.spec import build_spec

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "rules"

LLAMA = json.loads((FIXTURES / "KV101" / "pass" / "config.json").read_text())
DEEPSEEK = json.loads((FIXTURES / "KV401" / "pass" / "config.json").read_text())


def lint_dict(config: dict, **options):
    """All findings for an in-memory config.json (no weights), as lint_one would report them."""
    load_all()
    doc = JsonDocument(path=Path("config.json"), data=config, text=json.dumps(config, indent=2))
    ckpt = Checkpoint(source="config.json", root=None, config_doc=doc)
    ctx = LintContext(ckpt, build_spec(config), LintOptions(**options))
    for _topic, fn in CHECKERS.values():
        fn(ctx)
    return ctx.findings


def codes(config: dict, **options) -> list[str]:
    return [f.code for f in lint_dict(config, **options)]


def only(config: dict, code: str, **options):
    return [f for f in lint_dict(config, **options) if f.code == code]
