"""The weights / convert sections of the architecture tables, as convert reads them."""

from __future__ import annotations

import pytest

from kvtool.model.architectures import QKV_LAYOUTS, all_architectures
from kvtool.convert.fused import split_qkv

ISSUE_SUPPORTED = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                   "gemma3_text", "phi3", "starcoder2", "olmo2", "granite", "cohere", "falcon", "gpt_bigcode")
ISSUE_REFUSED = ("gpt2", "gpt_neox", "bloom", "mpt", "opt", "gptj", "deepseek_v3")
TABLES = {a.model_type: a for a in all_architectures().values() if not a.generic}


@pytest.mark.parametrize("model_type", ISSUE_SUPPORTED)
def test_supported_tables_name_the_kv_field_and_attention_roles(model_type):
    arch = TABLES[model_type]
    assert arch.convert.get("supported") is True
    assert arch.kv_head_fields, "convert rewrites these config keys; without one the output cannot load"
    w = arch.weights
    assert w.get("o") and (w.get("qkv") or all(w.get(r) for r in ("q", "k", "v")))
    assert "{layer}" in w["attention"]


@pytest.mark.parametrize("model_type", ISSUE_REFUSED)
def test_refused_tables_say_why(model_type):
    arch = TABLES[model_type]
    assert arch.convert.get("supported") is False and arch.convert.get("reason")


def test_gpt2_points_to_gpt_bigcode():
    assert "gpt_bigcode" in TABLES["gpt2"].convert.get("alternative", "")


@pytest.mark.parametrize("model_type", [m for m, a in TABLES.items() if a.convert.get("supported") and a.weights.get("qkv")])
def test_every_supported_fused_layout_can_be_split(model_type):
    torch = pytest.importorskip("torch")
    layout = TABLES[model_type].weights.get("qkv_layout", "concat")
    assert layout in QKV_LAYOUTS
    H, KV, hd = 4, 1, 2
    t = torch.arange((H + 2 * KV) * hd, dtype=torch.float32)
    q, k, v = split_qkv(layout, t, H, KV, hd)
    assert q.shape[0] == H * hd and k.shape[0] == KV * hd and v.shape[0] == KV * hd
