"""The KV1xx, KV3xx-KV8xx checkers never crash (KV000) whatever type a config value has."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from rules_helpers import DEEPSEEK, FIXTURES, LLAMA, lint_dict

# Keys these rules read, across the layouts they handle.
KEYS = (
    "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim", "partial_rotary_factor", "rotary_dim",
    "num_hidden_layers", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "max_position_embeddings", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
    "v_head_dim", "qk_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_layer_freq",
    "first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers", "n_group", "topk_group", "torch_dtype",
    "dtype", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "attn_config", "alibi", "rope_scaling",
    "model_max_length", "auto_map", "quantization_config", "tie_word_embeddings", "num_nextn_predict_layers",
)
ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(allow_nan=True), st.text(max_size=6),
    st.lists(st.one_of(st.integers(-2, 70), st.text(max_size=3), st.none()), max_size=5),
    st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.none(), st.booleans()), max_size=3),
)
BASES = [LLAMA, DEEPSEEK, json.loads((FIXTURES / "KV301" / "pass" / "config.json").read_text()),
         json.loads((FIXTURES / "KV302" / "pass_qwen25_disabled" / "config.json").read_text())]
TP = st.one_of(st.none(), st.integers(1, 16))


@settings(max_examples=200, deadline=None)
@given(base=st.sampled_from(BASES), edits=st.dictionaries(st.sampled_from(KEYS), ODD, min_size=1, max_size=4), tp=TP)
def test_no_checker_crashes(base, edits, tp) -> None:
    config = {**base, **edits}
    findings = lint_dict(config, tensor_parallel_size=tp)
    assert all(f.code != "KV000" for f in findings)
    for f in findings:
        assert f.message and f.severity in ("error", "warning", "info")
