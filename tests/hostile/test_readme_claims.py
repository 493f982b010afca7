"""docs/safety.md, "What kvtool never does": every test it names exists, so a claim cannot outlive its test."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SAFETY = TESTS.parent / "docs" / "safety.md"


def test_every_test_named_in_what_kvtool_never_does_exists():
    text = SAFETY.read_text(encoding="utf-8")
    section = text[text.index("<!-- section:never -->"):text.index("<!-- /section:never -->")]
    named = set(re.findall(r"::(test_\w+)", section))
    files = set(re.findall(r"`([\w/]+\.py)(?:::|`)", section))
    assert len(named) >= 20, named
    defined = {m for p in TESTS.rglob("test_*.py") for m in re.findall(r"^def (test_\w+)", p.read_text(), re.M)}
    assert not named - defined, f"docs/safety.md names tests that do not exist: {sorted(named - defined)}"
    missing = [f for f in files if not (TESTS / f).is_file()]
    assert not missing, f"docs/safety.md names test files that do not exist: {missing}"
