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
        ("real/internlm2*", "real/minicpm*", "real/mimo*", "real/baichuan*"),
        "no transformers release read (4.38.0 .. 5.25.0) lists these model types in CONFIG_MAPPING_NAMES "
        "(configuration_auto.py); their repositories ship the code (auto_map, trust_remote_code) and the corpus keeps "
        "the config only. kvtool lints them from its own tables, as vLLM serves them with its own model classes",
        error="does not recognize this architecture"),
    ReleaseDifference(
        "sliding-window-not-positive", "<4.43", ("refused-unexplained",), ("qwen2/sliding_negative", "qwen2/sliding_zero"),
        "before 4.43 the causal-mask helper refuses a sliding_window <= 0 even when use_sliding_window is false "
        "(modeling_attn_mask_utils.py, AttentionMaskConverter.__init__, 4.40.2: \"Make sure that when passing "
        "`sliding_window` that its value is a strictly positive integer\"); later releases and vLLM do not read the "
        "window when use_sliding_window is false, and kvtool's KV301 follows them",
        error="strictly positive integer"),
    ReleaseDifference(
        "longrope-original-missing", ">=4.43,<5", ("refused-unexplained",), ("*/rope_longrope",),
        "4.x's _compute_longrope_parameters compares the sequence length with original_max_position_embeddings "
        "read from the config's top level, None here (TypeError); 5.x falls back to max_position_embeddings, and "
        "vLLM reads it from the rope dict (kvtool's KV202 covers the dict)",
        error="NoneType"),
    ReleaseDifference(
        "scaled-rope-none-mixtral", ">=4.57,<=5.25", ("refused-unexplained",),
        ("mixtral/rope_dynamic_2", "mixtral/rope_longrope", "mixtral/rope_yarn*", "mistral/rope_dynamic_2",
         "mistral/rope_longrope", "mistral/rope_yarn*", "kvtool-rope/mistral/*", "kvtool-rope/mixtral/*"),
        "measured: these releases' Mistral / Mixtral rotary init multiplies a None length by the factor for dynamic, "
        "longrope and yarn (TypeError; 5.24 / 5.25 validate_rope refuse longrope; 5.25.0 measured on Mixtral) on the tiny bases, which carry "
        "sliding_window and no original_max_position_embeddings; 4.51.3 runs the same configs and vLLM serves them "
        "(get_rope reads the dict), so kvtool keeps no error", error="NoneType|validate_rope"),
    ReleaseDifference(
        "deepseek-v3-q-lora-null", ">=4.51,<=4.51.3", ("refused-unexplained",),
        ("deepseek_v3/*", "kvtool-rope/deepseek_v3/*"),
        "4.51.3's first DeepseekV3 sizes q_a_proj from q_lora_rank without the null branch (torch.empty with "
        "size None); the tiny base has q_lora_rank null like DeepSeek-V2-Lite, which 4.57 and vLLM build",
        error="must be tuple of ints"),
    ReleaseDifference(
        "gemma3-legacy-type-only", ">=4.51,<=4.57.6", ("refused-unexplained",), ("gemma3_text/rope_legacy_type_only",),
        "4.51-4.57's rope validation for Gemma-3 requires rope_type and refuses the legacy {\"type\": \"linear\"} "
        "(KeyError \"Missing required keys ... {'rope_type'}\"); 4.50's other classes and 5.x copy type to rope_type, "
        "as vLLM's patch_rope_parameters does", error="Missing required keys"),
    ReleaseDifference(
        "gemma3-v5-layout-5.0", "==5.0.0", ("refused-unexplained",),
        ("gemma3_text/rope_v5_default", "gemma3_text/rope_yarn*"),
        "5.0.0's Gemma3TextConfig requires rope_parameters nested per layer type and yarn's "
        "original_max_position_embeddings in the dict (KeyError); 5.24 fills both in, and kvtool's KV202 / KV214 "
        "name them for vLLM", error="KeyError"),
    ReleaseDifference(
        "sliding-negative-llama", ">=4.57,<=5.0.0", ("refused-unexplained",), ("llama/sliding_negative",),
        "4.57.6 and 5.0.0 build a sliding-window mask from any sliding_window key, also on llama (no sliding "
        "layers): torch.arange with a negative step fails; 5.24 and vLLM ignore the key on llama, as kvtool does",
        error="step sign"),
    ReleaseDifference(
        "deepseek-longrope-factor", ">=4.57,<=5.0.0", ("refused-unexplained",), ("deepseek_v3/rope_longrope",),
        "4.57.6 / 5.0.0's DeepseekV3 attention reads rope_scaling['factor'] for its mscale whatever the type; "
        "longrope has none (KeyError); kvtool's KV216 / KV217 describe the type for 5.24 and vLLM",
        error="factor"),
    ReleaseDifference(
        "gpt-neox-theta-key", ">=4.38", ("theta-differs",), ("gpt_neox/rope_theta_big",),
        "GPTNeoXConfig reads its base from rotary_emb_base (4.x) / rope_parameters (5.x), not a top-level rope_theta; "
        "kvtool's gpt_neox table reads rope_theta as vLLM does (it takes the base through transformers' config "
        "attribute rope_theta) - the mutation writes only rope_theta", ),
    ReleaseDifference(
        "gemma3-v5-default-theta", ">=5.24", ("theta-differs",), ("gemma3_text/rope_v5_default",),
        "a flat rope_parameters on Gemma-3 (which keeps RoPE per layer type) is read by 5.24 with the class default "
        "1e6 for full attention; kvtool reports KV214 for the flat layout beside rope_scaling and reads the flat "
        "theta, as vLLM's iter_rope_parameters does"),
    ReleaseDifference(
        "head-dim-with-derived-rope-4.46", "==4.46.3", ("refused-unexplained",),
        ("qwen2/head_dim_explicit_other", "gpt_neox/head_dim_explicit_other"),
        "4.46.3's Qwen2 / GPTNeoX attention size their projections from head_dim while the rotary embedding still "
        "uses hidden_size / num_attention_heads: shape error at the first forward; 4.44.2 ignores head_dim "
        "(kvtool's head_dim rows) and 4.51 on use it throughout", error="must match the size"),
)


def covering(version: str, case_id: str, kind: str, error: str) -> list[ReleaseDifference]:
    return [d for d in RELEASE_DIFFERENCES if d.covers(version, case_id, kind, error)]


def render_markdown() -> str:
    """The table docs/lint.md shows ("Engine versions")."""
    rows = ["| difference | releases | disagreement | cases | the engine's reason |", "| --- | --- | --- | --- | --- |"]
    for d in RELEASE_DIFFERENCES:
        rows.append(f"| {d.id} | {d.releases} | {', '.join(d.kinds)} | {', '.join(d.cases)} | {d.reason} |")
    return "\n".join(rows) + "\n"
