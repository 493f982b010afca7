"""Where kvtool knowingly answers differently from transformers, and the engine behaviour that justifies it.

One table, KNOWN_DIFFERENCES. The oracle lane (tests/oracle/test_oracle.py) accepts a disagreement
only when an entry here covers it; the lint docs show the table (docs/lint.md, "Checked against the engines",
rendered by `render_markdown` and checked by test_known_differences_in_docs).

Kinds:
- "stricter": lint reports an error where transformers loads the config (and, for tiny models,
  runs a forward). `codes` are the error codes covered.
- "engine-only": transformers refuses the config but vLLM serves it; lint warns (`codes`) rather
  than errs. `transformers_error` is a regex on transformers' error.
- "transformers-bug": transformers refuses a config vLLM serves, through a defect of its own;
  lint says nothing (`cases` narrows the entry to the inputs it is about).
- "frequencies": `kvtool rope` prints other frequencies than transformers computes; `codes` are
  the warnings lint gives for such configs.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownDifference:
    id: str
    kind: str  # stricter | engine-only | transformers-bug | frequencies
    example: str  # what the input looks like
    transformers: str  # what transformers does with it
    kvtool: str  # what kvtool says, and why that is right
    codes: tuple[str, ...] = ()
    transformers_error: str = ""  # regex (engine-only, transformers-bug)
    cases: tuple[str, ...] = ()  # case-id globs; empty: any case
    witness: str = ""  # an input of the lane that needs this entry (checked: no dead entries)

    def covers_case(self, case_id: str) -> bool:
        return not self.cases or any(fnmatch.fnmatch(case_id, g) for g in self.cases)

    def covers_error(self, error: str) -> bool:
        return bool(self.transformers_error) and re.search(self.transformers_error, error) is not None


KNOWN_DIFFERENCES: tuple[KnownDifference, ...] = (
    KnownDifference(
        "unknown-rope-type", "stricter", 'rope_type "gptj" or "ntk-by-parts"',
        "the config loads with a warning (RotaryEmbeddingConfigMixin.validate_rope: \"Missing validation "
        "function\"); building the model fails on ROPE_INIT_FUNCTIONS[type]",
        "error KV201: vLLM 0.33 refuses it at load (vllm/model_executor/layers/rotary_embedding/__init__.py, "
        "get_rope: ValueError \"Unknown RoPE scaling type\")", codes=("KV201",),
        witness="real/gpt-j-6b"),
    KnownDifference(
        "yarn-original-missing", "stricter", "yarn without original_max_position_embeddings (Gemma-3)",
        "Gemma3TextConfig fills original_max_position_embeddings from max_position_embeddings and runs",
        "error KV202: vLLM's yarn reads original_max_position_embeddings from the rope dict and fails without it "
        "(vllm 0.33, rotary_embedding/__init__.py, get_rope: rope_parameters[\"original_max_position_embeddings\"])",
        codes=("KV202",),
        witness="gemma3_text/rope_yarn_noorig"),
    KnownDifference(
        "rope-type-conflict", "stricter", '{"type": "dynamic", "rope_type": "linear"}',
        "uses rope_type and ignores type",
        "error KV205: vLLM 0.33 refuses the config (vllm/transformers_utils/config.py, patch_legacy_rope_type: "
        "ValueError \"Found conflicts between 'rope_type=...' and 'type=...'\")", codes=("KV205",),
        witness="llama/rope_type_conflict"),
    KnownDifference(
        "rope-theta-invalid", "stricter", "rope_theta 0, negative, or a string",
        "loads and runs: the frequencies theta^(-2i/d) are inf or NaN and so are the logits",
        "error KV206: silently corrupt outputs in both engines (vLLM's get_rope does not check the base either)",
        codes=("KV206", "KV906"),
        witness="llama/rope_theta_zero"),
    KnownDifference(
        "llama3-factors-swapped", "stricter", "llama3 with high_freq_factor < low_freq_factor",
        "loads with a warning and runs",
        "error KV208: the smoothing band is inverted in both engines (vllm 0.33 llama3_rope.py, "
        "Llama3RotaryEmbedding._compute_inv_freq uses the same formula): silently wrong positions",
        codes=("KV208",),
        witness="llama/rope_llama3_swapped"),
    KnownDifference(
        "rope-layouts-disagree", "stricter", "rope_theta 1e4 beside rope_parameters.rope_theta 5e5",
        "transformers 5 keeps rope_parameters' value and runs",
        "error KV214: transformers 4.x and tools reading the legacy keys run another RoPE than transformers 5 "
        "and vLLM 0.33 (which reads the config through transformers 5): the same checkpoint differs by stack",
        codes=("KV214",),
        witness="llama/rope_layouts_disagree"),
    KnownDifference(
        "rope-param-invalid", "stricter", "yarn with beta_fast < beta_slow, a string factor",
        "loads with a warning and runs",
        "error KV215: the yarn ramp runs backwards in both engines (vllm 0.33 rotary_embedding/common.py, "
        "yarn_find_correction_range has no check); a string factor fails vLLM's max_model_len derivation "
        "(vllm/config/model.py, _get_and_verify_max_len multiplies by it)", codes=("KV215",),
        witness="llama/rope_yarn_beta_swapped"),
    KnownDifference(
        "eos-outside-vocab", "stricter", "eos_token_id 500 with vocab_size 128",
        "loads and runs a forward (generation never produces the id)",
        "error KV504: the model can never emit its stop token, so generation runs to the length limit in every "
        "engine", codes=("KV504",),
        witness="llama/vocab_eos_outside"),
    KnownDifference(
        "schema-range", "stricter", "num_hidden_layers 0, max_position_embeddings 0, partial_rotary_factor 1.5, "
        "num_experts_per_tok 0, kv_lora_rank 0",
        "the config classes do not check these ranges; the tiny model runs",
        "error KV90x (and the specific rule): vLLM 0.33 refuses partial_rotary_factor outside (0, 1] (get_rope: "
        "ValueError), a zero max_model_len or layer count serves nothing, zero experts or latent rank compute "
        "nothing; KV906 where the value is outside kvtool's bounds table (docs/input-limits.md)",
        codes=("KV901", "KV902", "KV401", "KV411", "KV906"),
        witness="llama/mpe_zero"),
    KnownDifference(
        "hidden-not-divisible", "stricter", "hidden_size 66, 4 heads, no head_dim (qwen2, mistral, phi3)",
        "these classes floor 66 / 4 to a head_dim of 16 and run 64-wide attention on a 66-wide model",
        "error KV106: vLLM floors the same way (head_dim = hidden_size // num_attention_heads); a real checkpoint "
        "of that shape has no such projections, and LlamaConfig / Gemma3TextConfig already refuse it",
        codes=("KV106",),
        witness="qwen2/hidden_not_divisible"),
    KnownDifference(
        "rotary-dim-invalid", "stricter", "rotary_pct 0 (gpt_neox), partial_rotary_factor 1.5",
        "runs without rotating anything (NoPE) or rotates the whole head",
        "error KV107: vLLM 0.33 refuses it (get_rope: ValueError \"partial_rotary_factor=... must be between 0.0 "
        "and 1.0\")", codes=("KV107", "KV906"),
        witness="gpt_neox/rotary_pct_zero"),
    KnownDifference(
        "kv-heads-mla", "stricter", "MLA with num_key_value_heads 3 or 8 against 4 heads",
        "DeepseekV3Attention repeats the decompressed heads by H // KV: 1 (or 0) happens to run, 2 fails",
        "error KV101 / KV102: an MLA model has one K/V head per query head; any other count is a config edit "
        "that breaks transformers as soon as H // KV is 2 or more (and the GQA models' repeat_kv always)",
        codes=("KV101", "KV102"),
        witness="deepseek_v3/mla_kv3"),
    KnownDifference(
        "mla-row-not-served", "stricter", "MLA with kv_lora_rank + qk_rope_head_dim other than the rows vLLM serves "
        "(320 / 512 / 576 from 0.30)",
        "DeepseekV3Attention takes any latent and rope width: the config loads and a forward runs",
        "error KV404: every MLA backend of the vLLM release refuses the row at the first forward pass "
        "(MLACommonMetadata.__post_init__; the vLLM lane observed it, docs/vllm-lane.md); lint checks what will be "
        "served, and `--engine transformers` alone leaves vLLM out", codes=("KV404",),
        cases=("deepseek_v3/*", "rope/tiny-deepseek_v3*"), witness="deepseek_v3/base"),
    KnownDifference(
        "glm5-head-dim", "stricter", "GLM-5.2: head_dim 192 with qk_rope_head_dim 64",
        "the config loads",
        "error KV403: transformers builds the rotary embedding from head_dim (transformers#46739); vLLM uses "
        "qk_rope_head_dim: the engines rotate different widths", codes=("KV403",),
        witness="real/glm-5.2"),
    KnownDifference(
        "wrapper-dtype", "stricter", 'a multimodal wrapper\'s own "torch_dtype": "int8" or "dtype": "float17"',
        "the wrapper config loads; from_pretrained then loads the whole model in that dtype or fails",
        "error KV501: vLLM 0.33 takes the model dtype from the top-level config (vllm/config/model.py, "
        "_get_and_verify_dtype: ValueError \"Unknown dtype\")", codes=("KV501",),
        witness="wrapper/llava/top_torch_dtype_int"),
    KnownDifference(
        "vllm-only-rope", "engine-only", "rope_type ntk, deepseek_yarn, su (outside Phi-3), dynamic with alpha only",
        "refuses: KeyError on ROPE_INIT_FUNCTIONS, or \"Missing required keys ... {'factor'}\"",
        "warning KV216: vLLM 0.33 serves them (get_rope's ntk / deepseek_yarn / dynamic-alpha branches; "
        "transformers_utils/config.py, patch_legacy_rope_type renames su to longrope)",
        codes=("KV216",), transformers_error=r"KeyError",
        witness="llama/rope_ntk"),
    KnownDifference(
        "mixtral-scaled-rope", "transformers-bug", "mixtral without head_dim, with yarn / dynamic / longrope",
        "5.24 fails: modeling_rope_utils reads config.head_dim, which MixtralConfig leaves None "
        "(TypeError: NoneType * float, or validate_rope)",
        "nothing: vLLM derives head_dim = hidden_size // num_attention_heads and serves it; writing head_dim "
        "explicitly works around the transformers defect",
        transformers_error=r"NoneType|validate_rope", cases=("mixtral/rope_*", "rope/tiny-mixtral/*"),
        witness="mixtral/rope_yarn"),
    KnownDifference(
        "partial-rotary-plain", "frequencies", "llama-type config with partial_rotary_factor 0.5 and plain RoPE",
        "LlamaRotaryEmbedding ignores the factor for default RoPE: head_dim / 2 frequencies",
        "warning KV219, and `kvtool rope` shows vLLM's head_dim x factor / 2 frequencies (vllm 0.33 get_rope: "
        "rotary_dim = head_size x partial_rotary_factor): the engines differ, kvtool describes the server",
        codes=("KV219",),
        witness="llama/rope_partial_top"),
)


KNOWN_DIFFERENCES += (
    KnownDifference(
        "gptj-own-sinusoids", "frequencies", "`kvtool rope --type linear` on GPT-J (rotary_dim 64 of head_dim 256)",
        "GPTJAttention builds its own sinusoids over rotary_dim (create_sinusoidal_positions) and ignores "
        "rope_parameters: no scaling at all",
        "`kvtool rope` shows what vLLM 0.33 runs (vllm/model_executor/models/gpt_j.py, GPTJAttention.__init__ "
        "passes rope_parameters with partial_rotary_factor = rotary_dim / head_size to get_rope)",
        cases=("rope/gpt-j-6b/*",), witness="rope/gpt-j-6b/linear"),
)


def render_markdown() -> str:
    """The table as the lint docs show it."""
    lines = ["| difference | example | transformers | kvtool, and the engine behaviour behind it |",
             "| --- | --- | --- | --- |"]
    for d in KNOWN_DIFFERENCES:
        cells = [f"{d.id} ({d.kind})", d.example, d.transformers, d.kvtool]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)
