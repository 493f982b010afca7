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
    ReleaseDifference(
        "remote-code-model-types", ">=0", ("refused-unexplained",),
        ("real/internlm2*", "real/minicpm*", "real/mimo*", "real/deepseek-v3.2", "real/baichuan*"),
        "no transformers release read (4.38.0 .. 5.24.0) lists these model types in CONFIG_MAPPING_NAMES "
        "(configuration_auto.py); their repositories ship the code (auto_map, trust_remote_code) and the corpus keeps "
        "the config only. kvtool lints them from its own tables, as vLLM serves them with its own model classes",
        error="does not recognize this architecture"),
    ReleaseDifference(
        "yarn-factor-from-context", ">=4.51,<4.56", ("freqs-differ",),
        ("*/rope_yarn*", "*/rope_v5_yarn", "kvtool-rope/*/yarn"),
        "4.51-4.55 replace yarn's factor by max_position_embeddings / original_max_position_embeddings whenever the "
        "dict has original_max_position_embeddings (modeling_rope_utils.py, _compute_yarn_parameters, 4.51.3: "
        "factor = config.max_position_embeddings / original_max_position_embeddings); 4.56 on and vLLM use the "
        "dict's factor, as kvtool does"),
    ReleaseDifference(
        "longrope-original-missing", ">=4.43,<5", ("refused-unexplained",), ("*/rope_longrope",),
        "4.x's _compute_longrope_parameters compares the sequence length with original_max_position_embeddings "
        "read from the config's top level, None here (TypeError); 5.x falls back to max_position_embeddings, and "
        "vLLM reads it from the rope dict (kvtool's KV202 covers the dict)",
        error="not supported between instances of 'NoneType'"),
    ReleaseDifference(
        "partial-rotary-shape-error", ">=4.43,<5", ("refused-unexplained",), ("*/rope_partial_top",),
        "4.43-4.57's _compute_default_rope_parameters builds frequencies for head_dim x partial_rotary_factor dims "
        "while these classes' apply_rotary_pos_emb rotates the whole head: the first forward fails; kvtool's KV219 "
        "warning (transformers 5 ignores the factor, vLLM rotates the partial dims) describes the newest releases",
        error="must match the size of tensor b"),
)


def covering(version: str, case_id: str, kind: str, error: str) -> list[ReleaseDifference]:
    return [d for d in RELEASE_DIFFERENCES if d.covers(version, case_id, kind, error)]


def render_markdown() -> str:
    """The table docs/lint.md shows ("Engine versions")."""
    rows = ["| difference | releases | disagreement | cases | the engine's reason |", "| --- | --- | --- | --- | --- |"]
    for d in RELEASE_DIFFERENCES:
        rows.append(f"| {d.id} | {d.releases} | {', '.join(d.kinds)} | {', '.join(d.cases)} | {d.reason} |")
    return "\n".join(rows) + "\n"
