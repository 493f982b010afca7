"""Which known releases each engine fact's range holds, computed by packaging ahead of time.

`python -m kvtool.engines.inside --write` rewrites schemas/engines/fact_releases.json from facts.json,
transformers_releases.json and releases.json (tests/engines/test_inside.py fails while it is stale). lint reads from
that table whether a fact's range holds a known release, or a release newer than all of them where the range
gives those one answer: importing packaging.specifiers (its `tags` module pulls in logging, platform, subprocess
and sysconfig) was ~13 ms of a ~140 ms cold lint. Any other release, and a range that changed since the table was
written, is read by packaging (kvtool.engines.ranges): a stale table is slower, never wrong.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache

from kvtool.engines.installed import PLAIN_RELEASE

FILE = "fact_releases.json"


def table(facts, known: dict[str, tuple[str, ...]]) -> dict:
    """{"known": engine -> releases, "facts": id -> {"releases": range, "inside": [known releases in it],
    "after": whether it holds for every release newer than the newest known, or None where that varies}}."""
    from kvtool.engines.ranges import contains

    return {"known": {e: list(vs) for e, vs in known.items()},
            "facts": {f.id: {"releases": f.releases, "inside": [v for v in known[f.engine] if contains(f.releases, v)],
                             "after": _after(f.releases, known[f.engine][-1])} for f in facts}}


def _after(releases: str, newest: str) -> bool | None:
    """packaging's answer for every release after `newest`, when the range has one: each of its clauses is an
    ordered comparison (<, <=, >, >=) with a release no newer than `newest`, so none of them changes after it."""
    from packaging.version import Version

    from kvtool.engines.ranges import contains, specifier

    if not all(s.operator in ("<", "<=", ">", ">=") and Version(s.version) <= Version(newest)
               for s in specifier(releases)):
        return None
    release = Version(newest).release
    return contains(releases, ".".join(map(str, (*release[:-1], release[-1] + 1))))


@lru_cache(maxsize=None)
def _stored() -> dict:
    from kvtool.model.engine_tables import path

    try:
        return json.loads(path(f"schemas/engines/{FILE}").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"known": {}, "facts": {}}


def lookup(fact_id: str, releases: str, engine: str, version: str) -> bool | None:
    """Whether `version` is inside the fact's range, from the stored table; None when the table cannot say."""
    stored = _stored()
    row, known = stored["facts"].get(fact_id), stored["known"].get(engine)
    if row is None or row["releases"] != releases or not known:
        return None
    if version in known:
        return version in row["inside"]
    if row["after"] is None or not PLAIN_RELEASE.fullmatch(version):
        return None
    # a release newer than the table (the installed transformers often is): packaging.version is cheap to import,
    # its specifiers module (tags, platform, subprocess, logging) is not
    from packaging.version import Version

    return row["after"] if Version(version) > Version(known[-1]) else None


def main(argv: list[str]) -> int:
    from kvtool import console
    from kvtool.engines.facts import facts
    from kvtool.engines.releases import known
    from kvtool.model.engine_tables import path as table_path

    path = table_path(f"schemas/engines/{FILE}")
    text = json.dumps(table(facts(), known()), indent=1) + "\n"
    if argv == ["--write"]:
        path.write_text(text, encoding="utf-8")
        return 0
    if argv == ["--check"]:
        current = path.read_text(encoding="utf-8") if path.is_file() else ""
        if current != text:
            console.out(f"stale: {path} (run python -m kvtool.engines.inside --write)", err=True)
            return 1
        return 0
    console.out("usage: python -m kvtool.engines.inside --write | --check", err=True)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
