"""kv_hook on transformers' attention interface, and the torch_utils helpers it relies on."""

from __future__ import annotations

import pytest
import torch

from kvtool.errors import UsageError
from kvtool.runtime.kv_hooks import kv_hook
from kvtool.runtime.torch_utils import kv_cache_only_quantization, pick_device, pick_dtype


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_identity_hook_is_bit_identical_and_sees_post_rope_kv(tiny_llama_path, attn):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32, attn_implementation=attn).eval()
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = []

    def fn(layer, k, v):
        seen.append((layer, tuple(k.shape), tuple(v.shape)))
        return k, v

    with torch.no_grad():
        ref = m(ids).logits
        with kv_hook(m, fn):
            got = m(ids).logits
    assert torch.equal(ref, got)
    cfg = m.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    assert seen == [(i, (2, cfg.num_key_value_heads, 16, hd), (2, cfg.num_key_value_heads, 16, hd))
                    for i in range(cfg.num_hidden_layers)]  # per KV head, before GQA repetition
    assert m.config._attn_implementation == attn


def test_hook_changes_output_and_is_removed_on_error(tiny):
    ids = torch.arange(1, 17)[None]
    with torch.no_grad():
        ref = tiny(ids).logits
        with kv_hook(tiny, lambda layer, k, v: (k * 0, v)):
            assert not torch.equal(tiny(ids).logits, ref)
        with pytest.raises(RuntimeError, match="boom"):
            with kv_hook(tiny, lambda layer, k, v: (_ for _ in ()).throw(RuntimeError("boom"))):
                tiny(ids)
        assert torch.equal(tiny(ids).logits, ref)  # gone after the error
    with kv_hook(tiny, lambda layer, k, v: (k, v)):
        with pytest.raises(RuntimeError, match="already active"):
            with kv_hook(tiny, lambda layer, k, v: (k, v)):
                pass


def test_pick_device_and_dtype():
    assert pick_device("cpu").type == "cpu"
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert pick_dtype("fp16", torch.device("cpu")) == torch.float16
    with pytest.raises(UsageError):
        pick_device("tpu")
    with pytest.raises(UsageError):
        pick_dtype("int8", torch.device("cpu"))


@pytest.mark.parametrize("qc,kv_only", [
    (None, False),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8}, "config_groups": {}}, True),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8},
      "config_groups": {"group_0": {"targets": ["Linear"]}}}, False),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": None, "config_groups": {}}, False),
    ({"quant_method": "modelopt", "kv_cache_quant_algo": "FP8", "quant_algo": None}, True),
    ({"quant_method": "modelopt", "kv_cache_quant_algo": "FP8", "quant_algo": "FP8"}, False),
    ({"quant_method": "gptq", "bits": 4}, False),
])
def test_kv_cache_only_quantization(qc, kv_only):
    assert kv_cache_only_quantization(qc) is kv_only
