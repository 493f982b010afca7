"""kv-budget on real pretrained checkpoints (the cached SmolLM2-135M and Gemma-3-270M fixtures):
weights come from the safetensors headers, checked against the safetensors library's own view."""

from __future__ import annotations

import json

import pytest
from budget_helpers import run_json
from kvtest import fixture_or_skip

fixtures = pytest.importorskip("kvtool.testing.fixtures")

pytestmark = pytest.mark.slow


def _fixture(name):
    return fixture_or_skip(lambda: fixtures.fixture_dir(name))


def _served_bytes(folder) -> int:
    """float32 tensors are served in 16 bits by vLLM (--dtype auto): numel x 2, from safetensors' own reader."""
    from safetensors import safe_open

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            for name in st.keys():
                n = 1
                for dim in st.get_slice(name).get_shape():
                    n *= dim
                total += n * 2
    return total


def test_gemma3_270m_real_checkpoint(capsys):
    folder = _fixture("gemma3-270m")
    cfg = json.loads((folder / "config.json").read_text())
    d = run_json(capsys, str(folder), "--gpu", "RTX-4090", "--what-if", "fp8")
    assert d["weight_source"] == "safetensors"
    assert d["weight_bytes"] == _served_bytes(folder)
    # 18 layers, 1 KV head of head_dim 256, 16-bit KV (the fp32 checkpoint is served in bf16).
    assert [layer["layer_type"] for layer in d["layers"]] == cfg["layer_types"]
    assert d["kv_bytes_per_token"] == len(cfg["layer_types"]) * 2 * 1 * 256 * 2
    assert d["what_if"][0]["kv_bytes_per_token"] == d["kv_bytes_per_token"] / 2
    assert d["fits"] is True and d["max_concurrent_sequences"] > 100


def test_smollm2_135m_real_checkpoint_tp3_replicates(capsys):
    # SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads of head_dim 64. TP 3 splits one KV head per GPU;
    # TP 9 replicates each of the 3 heads on 3 GPUs.
    folder = _fixture("smollm2-135m")
    d = run_json(capsys, str(folder), "-tp", "3", "--max-model-len", "2048")
    assert d["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    assert d["kv_bytes_per_token_per_gpu"] == 30 * 2 * 1 * 64 * 2
    d9 = run_json(capsys, str(folder), "-tp", "9", "--max-model-len", "2048")
    assert d9["tensor_parallel_refusal"] is None and d9["kv_bytes_per_token_per_gpu"] == 30 * 2 * 1 * 64 * 2
    run_json(capsys, str(folder), "-tp", "2", "--max-model-len", "2048", rc_expected=1)  # 9 heads / 2
