"""kvtool.engines.ranges: the plain-release fast path answers as packaging.specifiers does."""

from __future__ import annotations

import itertools

import pytest
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from kvtool.engines import facts as F
from kvtool.engines import ranges
from kvtool.engines.releases import known

EDGES = ("0", "0.0", "4", "4.43", "4.43.0", "4.43.0.0", "4.43.1", "4.42.99", "4.044", "5", "5.0.0", "10.1",
         "0.5.3.post1", "4.43.post1", "4.43.0.post0", "4.43.0.post2", "4.42.9.post3", "4.44.post1", "4.45.0rc1",
         "4.43.0.dev0", "4.43.post1.dev0", "4.43-1", "1!2.0", "4.43+local")
RANGES = ("<4.43", "<=4.43", ">4.43", ">=4.43", "==4.43", "!=4.43", "==4.43.0", ">=4.43,<4.51", " <5 , >=4.44.0 ",
          ">4.42", ">4.43.0", "<4.44", "<=4.43.0", ">=4.44", "!=4.43.0",
          "<0.30", "<=4.46.3", "==4.43.*", "~=4.43", "===4.43", ">=4.43,!=4.44.*", "<4.43.0rc1", "")


def test_every_fact_row_at_every_known_release_agrees_with_packaging() -> None:
    releases = {v for vs in known().values() for v in vs}
    for fact in F.facts():
        spec = SpecifierSet(fact.releases)
        for v in releases:
            assert fact.applies_to(v) == (v in spec), (fact.id, fact.releases, v)


@pytest.mark.parametrize("text", RANGES)
def test_edge_ranges_and_releases_agree_with_packaging(text: str) -> None:
    spec = SpecifierSet(text)
    for v in EDGES:
        assert ranges.contains(text, v) == (v in spec), (text, v)


def test_the_fast_path_takes_plain_ranges_and_leaves_the_rest() -> None:
    assert ranges._plain_clauses(">=4.43,<4.51") == ((">=", (4, 43)), ("<", (4, 51)))
    assert ranges._plain_clauses("<5.0.0") == (("<", (5,)),)
    for text in ("==4.43.*", "~=4.43", "===4.43", "< 4.43", "", "<4.43,,>4"):
        assert ranges._plain_clauses(text) is None


@pytest.mark.parametrize("text", ["<4.43,,>4", ">=>4", "4.43", "<4.43a"])
def test_check_refuses_what_packaging_refuses(text: str) -> None:
    try:
        SpecifierSet(text)
    except InvalidSpecifier:
        with pytest.raises(InvalidSpecifier):
            ranges.check(text)
    else:
        ranges.check(text)


def test_deciding_the_facts_of_a_plain_or_post_release_imports_no_packaging() -> None:
    import subprocess
    import sys

    code = ("import sys\n"
            "from kvtool.engines import facts\n"
            "hits = [f.id for f in facts.facts() if f.applies_to('4.42.4') or f.applies_to('0.5.3.post1')]\n"
            "assert hits, 'no fact holds at 4.42.4'\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'packaging'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
