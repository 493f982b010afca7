"""Where kvtool's verdict for a transformers release knowingly differs from what that release does, and why.

The engine lane (tests/oracle/test_engine_releases.py) accepts a disagreement only when an entry here covers it:
the releases (a packaging specifier set), the case ids (globs), the kind of disagreement and, for refusals, a
regex on the release's own error. docs/lint.md ("Engine versions") shows the table.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet


@dataclass(frozen=True)
class ReleaseDifference:
    id: str
    releases: str  # specifier set
    kinds: tuple[str, ...]  # disagreement kinds (tests/oracle/test_engine_releases.py: disagreements)
    cases: tuple[str, ...]  # case-id globs
    reason: str  # the engine behaviour that justifies kvtool's answer
    error: str = ""  # regex on the release's error (refusals)

    def covers(self, version: str, case_id: str, kind: str, error: str) -> bool:
        return version in SpecifierSet(self.releases) and kind in self.kinds \
            and any(fnmatch.fnmatch(case_id, g) for g in self.cases) \
            and (not self.error or re.search(self.error, error or "") is not None)


RELEASE_DIFFERENCES: tuple[ReleaseDifference, ...] = ()


def covering(version: str, case_id: str, kind: str, error: str) -> list[ReleaseDifference]:
    return [d for d in RELEASE_DIFFERENCES if d.covers(version, case_id, kind, error)]
