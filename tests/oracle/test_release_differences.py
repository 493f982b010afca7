"""The engine lane's known-differences table is well-formed and shown in docs/lint.md (torch-free, default run)."""

from __future__ import annotations

from pathlib import Path

from packaging.specifiers import SpecifierSet

from release_differences import RELEASE_DIFFERENCES, render_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "lint.md"
KINDS = {"fact-not-refused", "fact-freqs-equal", "refused-unexplained", "freqs-differ", "scaling-differs", "theta-differs",
         "dtype", "head-dim"}


def test_entries_are_well_formed() -> None:
    ids = [d.id for d in RELEASE_DIFFERENCES]
    assert len(ids) == len(set(ids))
    for d in RELEASE_DIFFERENCES:
        SpecifierSet(d.releases)
        assert set(d.kinds) <= KINDS and d.cases and len(d.reason) > 40, d.id


def test_docs_show_the_table() -> None:
    assert render_markdown() in DOC.read_text(encoding="utf-8")
