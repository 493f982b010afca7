"""KV6xx: weights vs config from safetensors headers, for separate, fused, Conv1D and MLA layouts."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import write_config, write_safetensors

from kvtool.rules.runner import lint_one
from kvtool.rules.registry import LintOptions


def _lint(folder, config: dict, tensors: dict) -> list:
    write_config(folder, config)
    write_safetensors(folder / "model.safetensors", tensors)
    return lint_one(str(folder), LintOptions()).findings


def _z(*shape):
    return np.zeros(shape, np.float16)


PHI3 = {"model_type": "phi3", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "vocab_size": 32, "max_position_embeddings": 256, "torch_dtype": "float16",
        "tie_word_embeddings": True}


def test_fused_qkv_rows_are_heads_plus_two_kv_heads(tmp_path) -> None:
    base = {"model.embed_tokens.weight": _z(32, 16), "model.layers.0.self_attn.o_proj.weight": _z(16, 16)}
    ok = _lint(tmp_path / "ok", PHI3, {**base, "model.layers.0.self_attn.qkv_proj.weight": _z((4 + 2 * 2) * 4, 16)})
    assert not [f for f in ok if f.code == "KV601"]
    bad = _lint(tmp_path / "bad", PHI3, {**base, "model.layers.0.self_attn.qkv_proj.weight": _z(3 * 16, 16)})
    (f,) = [f for f in bad if f.code == "KV601"]
    assert "model.layers.0.self_attn.qkv_proj.weight has shape [48, 16]" in f.message and "[32, 16]" in f.message
    assert f.path == "model.layers.0.self_attn.qkv_proj.weight" and f.file.endswith("model.safetensors")


def test_falcon_multi_query_fused_layout(tmp_path) -> None:
    cfg = {"model_type": "falcon", "hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 1,
           "vocab_size": 32, "multi_query": True, "new_decoder_architecture": False, "alibi": False}
    t = {"transformer.word_embeddings.weight": _z(32, 16),
         "transformer.h.0.self_attention.query_key_value.weight": _z((4 + 2) * 4, 16),
         "transformer.h.0.self_attention.dense.weight": _z(16, 16)}
    assert not [f for f in _lint(tmp_path / "mq", cfg, t) if f.code == "KV601"]
    # the same weights under an MHA config: the fused matrix is too small for 4 KV heads
    mha = {**cfg, "multi_query": False}
    assert [f for f in _lint(tmp_path / "mha", mha, t) if f.code == "KV601"]


def test_gpt2_conv1d_weights_are_stored_in_out(tmp_path) -> None:
    cfg = {"model_type": "gpt2", "n_embd": 16, "n_head": 4, "n_layer": 1, "vocab_size": 32, "n_positions": 64}
    t = {"transformer.wte.weight": _z(32, 16), "transformer.h.0.attn.c_attn.weight": _z(16, 48),
         "transformer.h.0.attn.c_proj.weight": _z(16, 16)}
    assert not [f for f in _lint(tmp_path / "ok", cfg, t) if f.code == "KV601"]
    t["transformer.h.0.attn.c_attn.weight"] = _z(48, 16)  # nn.Linear orientation: wrong for Conv1D
    assert [f for f in _lint(tmp_path / "bad", cfg, t) if f.code == "KV601"]


def test_mla_projection_shapes(tmp_path) -> None:
    cfg = {"model_type": "deepseek_v3", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
           "vocab_size": 64, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
           "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1}
    p = "model.layers.0.self_attn"
    t = {"model.embed_tokens.weight": _z(64, 32), f"{p}.q_a_proj.weight": _z(24, 32),
         f"{p}.q_b_proj.weight": _z(4 * 16, 24), f"{p}.kv_a_proj_with_mqa.weight": _z(16 + 8, 32),
         f"{p}.kv_b_proj.weight": _z(4 * (8 + 8), 16), f"{p}.o_proj.weight": _z(32, 4 * 8)}
    assert not [f for f in _lint(tmp_path / "ok", cfg, t) if f.code == "KV601"]
    t[f"{p}.kv_a_proj_with_mqa.weight"] = _z(16, 32)  # rope part missing
    (f,) = [f for f in _lint(tmp_path / "bad", cfg, t) if f.code == "KV601"]
    assert "kv_lora_rank 16 + rope 8" in f.message


def test_packed_quantized_weights_are_not_shape_checked(tmp_path) -> None:
    base = {"model.embed_tokens.weight": _z(32, 16), "model.layers.0.self_attn.o_proj.weight": _z(16, 16),
            "model.layers.0.self_attn.qkv_proj.weight": np.zeros((8, 16), np.uint8)}
    assert not [f for f in _lint(tmp_path, PHI3, base) if f.code == "KV601"]


def test_layer_count_reports_missing_indices(tmp_path) -> None:
    cfg = {**PHI3, "num_hidden_layers": 4}
    t = {"model.embed_tokens.weight": _z(32, 16)}
    for i in (0, 2):
        t[f"model.layers.{i}.self_attn.o_proj.weight"] = _z(16, 16)
    (f,) = [f for f in _lint(tmp_path, cfg, t) if f.code == "KV602"]
    assert "layer(s) 1, 3" in f.message and "2 of 4 present" in f.message


@pytest.mark.parametrize("config,prefix,embed", [
    ({"model_type": "bloom", "n_embed": 16, "n_head": 4, "n_layer": 1, "vocab_size": 32},
     "transformer.h.0.self_attention", "transformer.word_embeddings.weight"),
    ({"model_type": "gpt_neox", "hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 1,
      "vocab_size": 32, "rotary_pct": 0.25}, "gpt_neox.layers.0.attention", "gpt_neox.embed_in.weight"),
    ({"model_type": "gpt_bigcode", "n_embd": 16, "n_head": 4, "n_layer": 1, "vocab_size": 32, "multi_query": True},
     "transformer.h.0.attn", "transformer.wte.weight"),
])
def test_fused_layouts_of_other_tables(tmp_path, config, prefix, embed) -> None:
    from kvtool.model.spec import build_spec

    spec = build_spec(config)
    rows = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    fused = spec.arch.weights["qkv"]
    t = {embed: _z(32, 16), f"{prefix}.{fused}.weight": _z(rows, 16), f"{prefix}.{spec.arch.weights['o']}.weight": _z(16, 16)}
    assert not [f for f in _lint(tmp_path / "ok", config, t) if f.code == "KV601"]
    t[f"{prefix}.{fused}.weight"] = _z(rows + 4, 16)
    assert [f for f in _lint(tmp_path / "bad", config, t) if f.code == "KV601"]


def test_unknown_model_types_are_not_shape_checked(tmp_path) -> None:
    # nemotron-nas varies KV heads per layer (block_configs): the generic table cannot know the shapes
    cfg = {"model_type": "nemotron-nas", "hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 1,
           "vocab_size": 32, "block_configs": [{"attention": {"n_heads_in_group": 4}}]}
    t = {"model.embed_tokens.weight": _z(32, 16), "model.layers.0.self_attn.k_proj.weight": _z(4, 16)}
    assert not [f for f in _lint(tmp_path, cfg, t) if f.code == "KV601"]
