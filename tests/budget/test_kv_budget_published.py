"""kv-budget against published configs: every expected number is worked out here by hand from the
architecture numbers the model cards publish (layers, KV heads, head_dim, window), never by calling
the code under test."""

from __future__ import annotations

import pytest
from budget_helpers import GIB, config, run_json

from kvtest import write_config


def cdiv(a, b):
    return -(-a // b)


# vLLM 0.33 (the newest release kvtool knows): windowed layers reserve max_in_flight_tokens beyond the window,
# max_concurrent_batches (2: async scheduling, on by default with one pipeline stage) x max_num_batched_tokens
# (vllm/config/vllm.py, VllmConfig.max_in_flight_tokens; tests/oracle/test_vllm_paging.py runs it per release)
IN_FLIGHT = 2


# --- GQA / MHA ------------------------------------------------------------------------------
def test_llama31_8b_bf16_per_token_and_mha_what_if(capsys):
    # Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 4096/32 = 128; K and V at 2 bytes.
    per_token = 2 * 8 * 128 * 2 * 32
    assert per_token == 131_072
    d = run_json(capsys, config("llama-3.1-8b"), "--kv-cache-dtype", "bfloat16", "--what-if", "mha,mqa,gqa:4")
    assert d["kv_bytes_per_token"] == per_token
    assert d["max_model_len"] == 131_072  # the config's max_position_embeddings
    assert d["kv_bytes_per_sequence"] == per_token * 131_072 == 16 * GIB
    assert d["max_concurrent_sequences"] is None  # no GPU budget given
    variants = {v["name"]: v for v in d["what_if"]}
    assert variants["mha"]["kv_bytes_per_token"] == 2 * 32 * 128 * 2 * 32 == 524_288
    assert variants["mqa"]["kv_bytes_per_token"] == 2 * 1 * 128 * 2 * 32
    assert variants["gqa:4"]["saving_vs_current"] == pytest.approx(0.5)
    assert variants["mha"]["saving_vs_current"] == pytest.approx(-3.0)
    kinds = {(layer["kind"], layer["group_size"], layer["kv_heads"]) for layer in d["layers"]}
    assert kinds == {("GQA", 4, 8)} and len(d["layers"]) == 32


def test_7b_example_4096_tokens_8_sequences_is_4_gib(tmp_path, capsys):
    # The textbook example: 32 layers, 8 KV heads, head_dim 128, bf16, 4096 tokens, 8 sequences.
    write_config(tmp_path / "m", {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 11008, "vocab_size": 32000,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
    })
    d = run_json(capsys, str(tmp_path / "m"), "--max-model-len", "4096", "--batch", "8", "--what-if", "gqa:32")
    assert d["kv_bytes_total"] == 2 * 8 * 128 * 2 * 32 * 4096 * 8 == 4 * GIB
    assert d["what_if"][0]["kv_bytes_total"] == 2 * 32 * 128 * 2 * 32 * 4096 * 8 == 16 * GIB


def test_qwen25_7b_28_heads_4_kv(capsys):
    # Qwen2.5-7B (the Qwen2-7B layout): 28 layers, 28 query heads, 4 KV heads, head_dim 3584/28 = 128.
    # sliding_window is set but use_sliding_window is false, so every layer is full attention.
    d = run_json(capsys, config("qwen2.5-7b-instruct"))
    assert d["kv_bytes_per_token"] == 2 * 4 * 128 * 2 * 28 == 57_344
    assert {layer["layer_type"] for layer in d["layers"]} == {"full_attention"}
    assert {layer["group_size"] for layer in d["layers"]} == {7}
    assert d["kv_bytes_per_sequence"] == 57_344 * 32_768


def test_mixtral_moe_does_not_change_kv(capsys):
    # Mixtral-8x7B: 32 layers, 8 KV heads, head_dim 128, like a dense 7B; the experts hold no cache.
    mixtral = run_json(capsys, config("mixtral-8x7b-v0.1"), "--max-model-len", "32768")
    llama = run_json(capsys, config("llama-3.1-8b"), "--max-model-len", "32768")
    assert mixtral["kv_bytes_per_token"] == llama["kv_bytes_per_token"] == 2 * 8 * 128 * 2 * 32
    assert mixtral["kv_bytes_per_sequence"] == 131_072 * 32_768


def test_mistral_7b_v01_every_layer_slides_over_4096(capsys):
    # Mistral-7B v0.1: 32 layers, 8 KV heads, head_dim 128, sliding_window 4096 on every layer
    # (vLLM applies a model-level window to all layers).
    per_layer = 2 * 8 * 128 * 2
    d = run_json(capsys, config("mistral-7b-instruct-v0.1"))
    assert d["kv_bytes_per_token"] == 32 * per_layer == 131_072
    assert {(layer["layer_type"], layer["window"]) for layer in d["layers"]} == {("sliding_attention", 4096)}
    tokens = (cdiv(min(4096 - 1 + IN_FLIGHT * 2048, 32_768), 16) + 1) * 16
    assert tokens == 8208
    assert d["kv_bytes_per_sequence"] == 32 * tokens * per_layer
    # Shorter than the window: the whole sequence plus vLLM's extra block.
    short = run_json(capsys, config("mistral-7b-instruct-v0.1"), "--max-model-len", "1000")
    assert short["kv_bytes_per_sequence"] == 32 * (cdiv(1000, 16) + 1) * 16 * per_layer


# --- MLA ------------------------------------------------------------------------------------
def test_deepseek_v3_mla_latent_once_per_layer(capsys):
    # DeepSeek-V3: 61 layers, kv_lora_rank 512 + qk_rope_head_dim 64 cached once per token, bf16.
    per_token = (512 + 64) * 2 * 61
    d = run_json(capsys, config("deepseek-v3"), "--max-model-len", "4096")
    assert d["kv_bytes_per_token"] == per_token == 70_272
    assert {layer["kind"] for layer in d["layers"]} == {"MLA"}
    assert d["kv_bytes_per_sequence"] == per_token * 4096
    # The plain formula 2 x layers x heads x head_dim would say 2 x 61 x 128 x (128 + 64) x 2 bytes: 85x more.
    assert 2 * 61 * 128 * (128 + 64) * 2 / per_token > 80


def test_deepseek_v3_under_tp_keeps_the_whole_latent_on_every_gpu(capsys):
    d = run_json(capsys, config("deepseek-v3"), "--max-model-len", "4096", "--tensor-parallel-size", "8")
    assert d["kv_bytes_per_token_per_gpu"] == d["kv_bytes_per_token"] == (512 + 64) * 2 * 61
    assert d["tensor_parallel_refusal"] is None  # 128 query heads split over 8


def test_deepseek_v2_lite_mla(capsys):
    # DeepSeek-V2-Lite: 27 layers, kv_lora_rank 512 + qk_rope_head_dim 64; its 16 heads do not matter.
    d = run_json(capsys, config("deepseek-v2-lite"), "--max-model-len", "8192")
    assert d["kv_bytes_per_token"] == (512 + 64) * 2 * 27 == 31_104
    assert d["kv_bytes_per_sequence"] == 31_104 * 8192
    # 15.7 B parameters published (64 routed + 2 shared experts of 1408, first layer dense).
    assert d["weight_params_estimate"] == pytest.approx(15.7e9, rel=0.01)


# --- hybrids: layers without a KV cache -----------------------------------------------------
def test_qwen35_27b_linear_attention_layers_cost_nothing(capsys):
    # Qwen3.5-27B: 64 layers, every 4th full attention (16), the others Gated DeltaNet (no KV cache);
    # full layers: 4 KV heads of head_dim 256.
    d = run_json(capsys, config("qwen3.5-27b"), "--max-model-len", "65536")
    kinds = [layer["kind"] for layer in d["layers"]]
    assert len(kinds) == 64 and kinds.count("none") == 48
    assert d["kv_bytes_per_token"] == 16 * 2 * 4 * 256 * 2 == 65_536
    assert any("Mamba / linear-attention" in n for n in d["notes"])


def test_nemotron_h_56b_only_attention_layers_cache(capsys):
    # Nemotron-H-56B: hybrid_override_pattern with 10 attention layers ("*"), 8 KV heads, head_dim 128.
    import json

    pattern = json.load(open(config("nemotron-h-56b-base-8k")))["hybrid_override_pattern"]
    n_attn = pattern.count("*")
    assert n_attn == 10
    d = run_json(capsys, config("nemotron-h-56b-base-8k"))
    assert d["kv_bytes_per_token"] == n_attn * 2 * 8 * 128 * 2
    # vLLM raises the attention block to 4,128 tokens so a page holds one Mamba2 state page (16,900,096 B, padded
    # to 4,128 x 4,096 = 16,908,288 B); the 54 state layers take 60 slots in groups of 10
    # (tests/budget/test_kv_budget_hybrid_state.py works these out)
    assert d["kv_bytes_per_sequence"] == n_attn * 2 * 8 * 128 * 2 * 8256 + 60 * 16_908_288
    assert [layer["index"] for layer in d["layers"] if layer["kind"] != "none"] == [
        i for i, c in enumerate(pattern) if c == "*"]


def test_llama4_scout_chunked_local_attention(capsys):
    # Llama-4-Scout: 48 layers; every 4th is global (NoPE), the rest attend within 8192-token chunks;
    # 8 KV heads, head_dim 128.
    per_layer = 2 * 8 * 128 * 2
    d = run_json(capsys, config("llama-4-scout-17b-16e-instruct"), "--max-model-len", "65536")
    chunked = [layer for layer in d["layers"] if layer["layer_type"] == "chunked_attention"]
    assert len(chunked) == 36 and {layer["window"] for layer in chunked} == {8192}
    # vLLM reserves the chunk plus the in-flight scheduler steps (no extra block) on chunked layers.
    tokens = cdiv(min(8192 + IN_FLIGHT * 2048, 65_536), 16) * 16
    assert d["kv_bytes_per_sequence"] == 12 * 65_536 * per_layer + 36 * tokens * per_layer


# --- sliding window -------------------------------------------------------------------------
def test_gemma3_1b_five_sliding_one_global(capsys):
    # Gemma-3-1B: 26 layers, every 6th global (5, 11, 17, 23), the rest slide over 512 tokens;
    # 1 KV head of head_dim 256 at 2 bytes = 1024 B per layer per token.
    per_layer = 2 * 1 * 256 * 2
    d = run_json(capsys, config("gemma-3-1b-it"))
    full = [layer["index"] for layer in d["layers"] if layer["layer_type"] == "full_attention"]
    assert full == [5, 11, 17, 23]
    assert d["kv_bytes_per_token"] == 26 * per_layer
    # vLLM reserves window-1 tokens + the in-flight steps (2 x 2048 by default) + one block on sliding layers.
    sliding_tokens = (cdiv(min(512 - 1 + IN_FLIGHT * 2048, 32_768), 16) + 1) * 16
    assert sliding_tokens == 4624
    # vLLM's hybrid allocator groups layers in 4s (the 4 global layers): the 22 sliding layers fill
    # 6 groups = 24 slots, 2 of them padding that reserves memory like a sliding layer.
    expected = 4 * 32_768 * per_layer + 24 * sliding_tokens * per_layer
    assert d["kv_bytes_per_sequence"] == expected
    assert d["padding_layers"] == [{"layer_type": "sliding_attention", "count": 2,
                                    "bytes_per_sequence": 2 * sliding_tokens * per_layer,
                                    "bytes_per_sequence_per_gpu": 2 * sliding_tokens * per_layer}]
    # Decode-only steps: the window, two in-flight tokens and one block.
    d1 = run_json(capsys, config("gemma-3-1b-it"), "--max-num-batched-tokens", "1")
    assert d1["kv_bytes_per_sequence"] == 4 * 32_768 * per_layer + 24 * (cdiv(512 - 1 + 2, 16) + 1) * 16 * per_layer
    # The plain formula charges every layer the whole context: over 3x more here.
    assert 26 * 32_768 * per_layer / expected > 3
    # ... which is what vLLM does with its hybrid KV-cache manager disabled.
    off = run_json(capsys, config("gemma-3-1b-it"), "--disable-hybrid-kv-cache-manager")
    assert off["kv_bytes_per_sequence"] == 26 * 32_768 * per_layer and off["padding_layers"] == []


def test_gpt_oss_20b_alternating_sliding_128(capsys):
    # gpt-oss-20b: 24 layers alternating sliding (window 128) / full, 8 KV heads, head_dim 64.
    per_layer = 2 * 8 * 64 * 2
    d = run_json(capsys, config("gpt-oss-20b"))
    types = [layer["layer_type"] for layer in d["layers"]]
    assert types == ["sliding_attention", "full_attention"] * 12
    assert {layer["window"] for layer in d["layers"] if layer["layer_type"] == "sliding_attention"} == {128}
    assert d["kv_bytes_per_token"] == 24 * per_layer == 49_152
    sliding_tokens = (cdiv(128 - 1 + IN_FLIGHT * 2048, 16) + 1) * 16
    assert d["kv_bytes_per_sequence"] == 12 * 131_072 * per_layer + 12 * sliding_tokens * per_layer


def test_gpt_oss_120b_on_h100_uses_vllms_larger_scheduler_step(capsys):
    # On a >= 70 GiB GPU that is not an A100, `vllm serve` defaults to 8192 batched tokens per step.
    per_layer = 2 * 8 * 64 * 2
    d = run_json(capsys, config("gpt-oss-120b"), "--gpu", "H100-80GB")
    assert d["max_num_batched_tokens"] == 8192
    sliding_tokens = (cdiv(128 - 1 + IN_FLIGHT * 8192, 16) + 1) * 16
    assert d["kv_bytes_per_sequence"] == 18 * 131_072 * per_layer + 18 * sliding_tokens * per_layer
    a100 = run_json(capsys, config("gpt-oss-120b"), "--gpu", "A100-80GB")
    assert a100["max_num_batched_tokens"] == 2048


# --- KV dtype -------------------------------------------------------------------------------
def test_fp8_halves_bf16_and_per_token_head_int8_adds_its_scales(capsys):
    fp8 = run_json(capsys, config("llama-3.1-8b"), "--kv-cache-dtype", "fp8")
    e5m2 = run_json(capsys, config("llama-3.1-8b"), "--kv-cache-dtype", "fp8_e5m2")
    int8 = run_json(capsys, config("llama-3.1-8b"), "--kv-cache-dtype", "int8_per_token_head")
    assert fp8["kv_bytes_per_token"] == e5m2["kv_bytes_per_token"] == 2 * 8 * 128 * 1 * 32 == 65_536
    # one float32 scale for K and one for V per token and KV head, beside the int8 values
    assert int8["kv_bytes_per_token"] == (2 * 128 * 1 + 2 * 4) * 8 * 32 == 67_584
    mla = run_json(capsys, config("deepseek-v3"), "--kv-cache-dtype", "fp8_e4m3", "--max-model-len", "1024")
    assert mla["kv_bytes_per_token"] == (512 + 64) * 1 * 61


# --- tensor parallel ------------------------------------------------------------------------
def test_tp_splits_kv_heads_and_replicates_beyond_their_count(capsys):
    tp2 = run_json(capsys, config("llama-3.1-8b"), "--tensor-parallel-size", "2", "--max-model-len", "8192")
    assert tp2["kv_bytes_per_token_per_gpu"] == 2 * (8 // 2) * 128 * 2 * 32
    assert {layer["kv_heads_per_gpu"] for layer in tp2["layers"]} == {4}
    # 16 GPUs, 8 KV heads: each GPU keeps one head; every head lives on 2 GPUs.
    tp16 = run_json(capsys, config("llama-3.1-8b"), "--tensor-parallel-size", "16", "--max-model-len", "8192")
    assert tp16["tensor_parallel_refusal"] is None
    assert tp16["kv_bytes_per_token_per_gpu"] == 2 * 1 * 128 * 2 * 32
    assert tp16["kv_bytes_per_token_per_gpu"] * 16 == 2 * tp16["kv_bytes_per_token"]


def test_what_if_saving_is_per_gpu_under_tp(capsys):
    # Llama-3.1-8B on 2 GPUs: 4 KV heads each today; MQA leaves one head, replicated on both GPUs,
    # so each GPU saves 3/4, not the 7/8 the head count suggests.
    d = run_json(capsys, config("llama-3.1-8b"), "-tp", "2", "--max-model-len", "8192", "--what-if", "mqa,gqa:2")
    mqa, gqa2 = d["what_if"]
    assert mqa["kv_bytes_per_token_per_gpu"] == 2 * 1 * 128 * 2 * 32
    assert mqa["saving_vs_current"] == pytest.approx(1 - 1 / 4)
    assert gqa2["saving_vs_current"] == pytest.approx(1 - 1 / 4) and gqa2["kv_heads"] == 2


def test_tp_that_vllm_refuses_exits_1(capsys):
    # 32 query heads are not divisible by 3.
    d = run_json(capsys, config("llama-3.1-8b"), "-tp", "3", "--max-model-len", "8192", rc_expected=1)
    assert "num_attention_heads (32)" in d["tensor_parallel_refusal"]
    # Qwen2.5-7B: 28 query heads split over 7, but 7 GPUs cannot share 4 KV heads evenly.
    d = run_json(capsys, config("qwen2.5-7b-instruct"), "-tp", "7", rc_expected=1)
    assert "num_key_value_heads (4)" in d["tensor_parallel_refusal"]
    assert any("refuses" in p for p in d["problems"])
    ok = run_json(capsys, config("qwen2.5-7b-instruct"), "-tp", "4")
    assert ok["kv_bytes_per_token_per_gpu"] == 2 * 1 * 128 * 2 * 28


# --- GPU fit --------------------------------------------------------------------------------
def test_fit_on_h100_by_hand(capsys):
    # 81559 MiB (nvidia-smi) x 0.9, minus the estimated weights; bf16 Llama-3.1-8B at 8192 tokens.
    d = run_json(capsys, config("llama-3.1-8b"), "--gpu", "H100-80GB", "--max-model-len", "8192")
    params = 128_256 * 4096 * 2 + 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14_336)
    assert d["weight_params_estimate"] == params  # 8.03 B, the published size
    assert d["weight_bytes"] == params * 2 and d["weight_source"] == "estimate"
    pool = 81_559 * 2**20 * 0.9 - params * 2
    assert d["kv_pool_bytes_per_gpu"] == pytest.approx(pool)
    assert d["max_concurrent_sequences"] == int(pool // (131_072 * 8192))
    assert d["kv_pool_tokens"] == int(pool // (131_072 * 16)) * 16
    assert d["fits"] is True


def test_deepseek_v3_does_not_fit_one_h100(capsys):
    rc_d = run_json(capsys, config("deepseek-v3"), "--gpu", "H100", "--max-model-len", "4096", rc_expected=1)
    assert rc_d["weights_fit"] is False and rc_d["fits"] is False
    assert rc_d["max_concurrent_sequences"] == 0
    # 671 B parameters (the published total), decoder layers in fp8.
    assert rc_d["weight_params_estimate"] == pytest.approx(671e9, rel=0.005)
