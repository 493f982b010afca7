"""kv-budget with every kind of vLLM 0.33 KV-cache dtype: bytes per token worked out here by hand from the layout
vLLM stores (tests/model/test_kv_dtypes.py checks those layouts against vLLM's code), and the one-line refusals."""

from __future__ import annotations

import json

import pytest
from budget_helpers import config, run, run_json

from kvtest import write_config
from kvtool.model import kv_dtypes

# Llama-3.1-8B: 32 layers, 8 KV heads of 128
LAYERS, HEADS, D = 32, 8, 128


def per_token(capsys, name: str) -> int:
    return run_json(capsys, config("llama-3.1-8b"), "--kv-cache-dtype", name, "--max-model-len", "4096")[
        "kv_bytes_per_token"]


@pytest.mark.parametrize(("name", "slot"), [
    ("bfloat16", 2 * D * 2),
    ("fp8", 2 * D), ("fp8_e4m3", 2 * D), ("fp8_e5m2", 2 * D), ("fp8_inc", 2 * D),  # per-tensor scales: 0 B/token
    ("int8_per_token_head", 2 * D + 2 * 4), ("fp8_per_token_head", 2 * D + 2 * 4),  # + a float32 scale for K and V
    ("int4_per_token_head", 2 * D // 2 + 2 * 4),
    ("nvfp4", 2 * (D // 2 + D // 16)), ("nvfp4_4over6", 2 * (D // 2 + D // 16)),  # + one fp8 scale per 16 values
    ("octave_k3v4", 136),  # 4-bit rotary K (all 128 dims) 64 + 4-bit V 64 + 3 fp16 scales = 134, rounded up to 8 B
    ("octave_k3v3_compact", 128 * 3 // 8 + 128 * 3 // 8 + 2 * 2),  # 3-bit K and V, 2 scales, to 4 B -> 100
])
def test_every_layer_quantized(name, slot, capsys):
    assert per_token(capsys, name) == slot * HEADS * LAYERS


@pytest.mark.parametrize(("name", "slot"), [
    ("turboquant_k8v4", 128 + 128 // 2 + 4),  # fp8 keys; 4-bit values + fp16 scale and zero
    ("turboquant_4bit_nc", (128 // 2 + 2) + (128 // 2 + 4)),  # + fp16 key norm
    ("turboquant_3bit_nc", (128 * 3 // 8 + 2) + (128 * 3 // 8 + 4)),
    ("ultraquant_4bit", 2 * (128 // 2 + 128 // 32)),  # FP4 codes + one E8M0 byte per 32
])
def test_boundary_layers_stay_in_the_model_dtype(name, slot, capsys):
    # vLLM keeps attention layers 0, 1, 30, 31 of a dense model unquantized (TurboQuantConfig.get_boundary_skip_layers)
    assert per_token(capsys, name) == slot * HEADS * (LAYERS - 4) + 2 * D * 2 * HEADS * 4


def test_hybrid_models_quantize_every_attention_layer(capsys):
    # Qwen3.5-27B mixes linear attention: vLLM skips no boundary layer there
    d = run_json(capsys, config("qwen3.5-27b"), "--kv-cache-dtype", "turboquant_k8v4", "--max-model-len", "4096")
    attn = [r for r in d["layers"] if r["kind"] != "none"]
    slot = attn[0]["head_dim"] + attn[0]["head_dim"] // 2 + 4
    assert {r["bytes_per_token"] for r in attn} == {slot * attn[0]["kv_heads"]}
    assert not any("boundary" in n for n in d["notes"])


def test_tensor_parallel_splits_the_scales_with_the_heads(capsys):
    d = run_json(capsys, config("llama-3.1-8b"), "--kv-cache-dtype", "nvfp4", "-tp", "4", "--max-model-len", "4096")
    assert d["kv_bytes_per_token_per_gpu"] == 2 * (64 + 8) * (HEADS // 4) * LAYERS


def test_the_text_report_says_scales_are_included(capsys):
    rc, out, _ = run(capsys, config("llama-3.1-8b"), "--kv-cache-dtype", "int8_per_token_head")
    assert rc == 0 and "int8_per_token_head (1.031 B/element, scales included)" in out


def test_what_if_takes_any_vllm_dtype(capsys):
    d = run_json(capsys, config("llama-3.1-8b"), "--max-model-len", "4096", "--what-if", "nvfp4,gqa:4+fp8_per_token_head")
    nv, gqa = d["what_if"]
    assert nv["kv_bytes_per_token"] == 2 * 72 * HEADS * LAYERS and nv["kv_cache_dtype"] == "nvfp4"
    assert gqa["kv_bytes_per_token"] == (2 * D + 8) * 4 * LAYERS


def _sparse_mla(tmp_path) -> str:
    cfg = json.loads(open(config("deepseek-v3")).read())
    cfg["index_topk"] = 2048  # DeepSeek-V3.2's indexer: vLLM picks its sparse MLA backends
    write_config(tmp_path / "v32", cfg)
    return str(tmp_path / "v32")


def test_deepseek_blob_dtypes_on_sparse_mla(tmp_path, capsys):
    v32 = _sparse_mla(tmp_path)
    layers = json.loads(open(config("deepseek-v3")).read())["num_hidden_layers"]
    assert run_json(capsys, v32, "--kv-cache-dtype", "fp8_ds_mla", "--max-model-len", "4096")["kv_bytes_per_token"] \
        == (512 + 4 * 4 + 64 * 2) * layers
    assert run_json(capsys, v32, "--kv-cache-dtype", "nvfp4_ds_mla", "--max-model-len", "4096")["kv_bytes_per_token"] \
        == (512 // 2 + 64 + 512 // 16) * layers
    fp8 = run_json(capsys, v32, "--kv-cache-dtype", "fp8", "--max-model-len", "4096")
    assert fp8["kv_bytes_per_token"] == (512 + 64) * layers and any("fp8_ds_mla" in n for n in fp8["notes"])


@pytest.mark.parametrize(("model", "dtype", "says"), [
    ("llama-3.1-8b", "fp8_ds_mla", "has no attention backend that stores fp8_ds_mla for MHA / GQA / MQA attention"),
    ("deepseek-v3", "fp8_ds_mla", "fp8_ds_mla for MLA; fp8_ds_mla serves sparse MLA"),
    ("deepseek-v3", "nvfp4", "nvfp4 for MLA; nvfp4 serves MHA / GQA / MQA attention"),
    ("deepseek-v3", "int8_per_token_head", "int8_per_token_head for MLA"),
    ("llama-3.1-8b", "float16", "refuses kv_cache_dtype float16 for a model served in bfloat16"),
    ("llama-3.1-8b", "fp16", "must be one of auto, float16, bfloat16, fp8"),
    ("llama-3.1-8b", "int8", "must be one of auto, float16, bfloat16, fp8"),
])
def test_a_dtype_vllm_would_refuse_is_one_line(model, dtype, says, capsys):
    rc, out, err = run(capsys, config(model), "--kv-cache-dtype", dtype)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("kvtool: error: --kv-cache-dtype: ") and says in err, err


def test_a_refused_what_if_dtype_names_the_dtype(capsys):
    rc, _, err = run(capsys, config("deepseek-v3"), "--what-if", "turboquant_k8v4")
    assert rc == 2 and "turboquant_k8v4 for MLA" in err and err.count("\n") == 1


def test_octave_refuses_a_head_size_its_format_cannot_pack(tmp_path, capsys):
    write_config(tmp_path / "m", {"model_type": "llama", "hidden_size": 2560, "num_hidden_layers": 4,
                                  "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 1000,
                                  "max_position_embeddings": 2048, "torch_dtype": "bfloat16"})  # head_dim 80
    rc, _, err = run(capsys, str(tmp_path / "m"), "--kv-cache-dtype", "octave_k3v4")
    assert rc == 2 and "multiples of 64" in err
    assert run_json(capsys, str(tmp_path / "m"), "--kv-cache-dtype", "fp8")["kv_bytes_per_token"] == 2 * 80 * 32 * 4
    # NVFP4's one backend, FlashInfer, serves head_dim 64 / 128 / 256 / 512 only
    rc, _, err = run(capsys, str(tmp_path / "m"), "--kv-cache-dtype", "nvfp4")
    assert rc == 2 and "FlashInfer only" in err


def test_every_vllm_dtype_is_a_choice():
    from kvtool.options.fields import field_named
    from kvtool.options.kv_budget import KvBudgetOptions

    assert field_named(KvBudgetOptions, "kv_cache_dtype").choices == kv_dtypes.names()


def test_another_engine_release_says_the_dtype_sizes_are_033s(capsys):
    d = run_json(capsys, config("llama-3.1-8b"), "--engine", "vllm==0.30.0", "--kv-cache-dtype", "nvfp4")
    assert any("sized as vLLM 0.33.0 stores it" in n and "0.30.0 was not read" in n for n in d["notes"])
    same = run_json(capsys, config("llama-3.1-8b"), "--engine", "vllm==0.33.0", "--kv-cache-dtype", "nvfp4")
    assert not any("was not read" in n for n in same["notes"])
