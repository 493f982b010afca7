"""kvtool.engines.inside: the stored answers are packaging's, and the table is current."""

from __future__ import annotations

import pytest

from kvtool.engines import facts as F
from kvtool.engines import inside
from kvtool.engines.ranges import contains
from kvtool.engines.releases import known

NEWER = {"transformers": ("5.25.0", "5.99", "6.0.0", "10.1.2"), "vllm": ("0.33.1", "0.34.0", "1.0")}


def test_the_stored_table_is_current() -> None:
    assert inside.main(["--check"]) == 0, "run python -m kvtool.engines.inside --write"


def test_every_stored_answer_is_packagings() -> None:
    checked = 0
    for fact in F.facts():
        for version in (*known()[fact.engine], *NEWER[fact.engine]):
            stored = inside.lookup(fact.id, fact.releases, fact.engine, version)
            if stored is not None:
                assert stored == contains(fact.releases, version), (fact.id, version)
                checked += 1
            assert fact.applies_to(version) == contains(fact.releases, version), (fact.id, version)
    assert checked >= len(F.facts()) * 10  # the table answered, not only packaging


@pytest.mark.parametrize("version", ["5.25.0rc1", "5.25.0.post1", "4.37.0", "5.24.0.dev0"])
def test_a_release_the_table_cannot_place_is_left_to_packaging(version) -> None:
    fact = next(f for f in F.facts() if f.engine == "transformers")
    assert inside.lookup(fact.id, fact.releases, "transformers", version) is None


def test_a_changed_range_is_not_read_from_the_table() -> None:
    fact = F.facts()[0]
    assert inside.lookup(fact.id, fact.releases + ",!=0.0.1", fact.engine, known()[fact.engine][-1]) is None


@pytest.mark.parametrize("releases,after", [("<5", False), (">=4.40", True), (">=4.40,<=5.24.0", False),
                                            ("<5.30", None), ("==5.*", None), ("!=4.50.0", None),
                                            ("~=5.2", None), (">4.40,<6", None)])
def test_after_is_one_answer_only_when_no_clause_can_change(releases, after) -> None:
    assert inside._after(releases, "5.24.0") is after
    if after is not None:
        assert all(contains(releases, v) is after for v in NEWER["transformers"])
