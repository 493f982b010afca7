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


RELEASE_DIFFERENCES: tuple[ReleaseDifference, ...] = (
    ReleaseDifference(
        "positions-scaled-before-4.43", "<4.43", ("freqs-differ",),
        ("llama/rope_linear*", "llama/rope_legacy_type_only", "llama/rope_type_conflict", "llama/rope_unknown_key",
         "llama/rope_dynamic*", "kvtool-rope/llama/linear", "kvtool-rope/llama/dynamic"),
        "before 4.43 LlamaLinearScalingRotaryEmbedding divides the positions by factor in forward() (and the "
        "dynamic class rescales base per sequence) and keeps inv_freq unscaled (modeling_llama.py 4.42.4, "
        "LlamaLinearScalingRotaryEmbedding.forward): the angles equal kvtool's inv_freq / factor, the stored "
        "inv_freq does not"),
)


def covering(version: str, case_id: str, kind: str, error: str) -> list[ReleaseDifference]:
    return [d for d in RELEASE_DIFFERENCES if d.covers(version, case_id, kind, error)]
