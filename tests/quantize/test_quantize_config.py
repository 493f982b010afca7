"""config.json quantization_config: exact keys, merge into compressed-tensors configs, refusals."""

from __future__ import annotations

import copy

import pytest

from kvtool.errors import InputError
from kvtool.quantize.config import kv_cache_scheme, new_quantization_config, with_kv_cache_scheme

BASE = {"model_type": "llama", "num_hidden_layers": 2}


def test_new_config_has_exactly_the_keys_llm_compressor_writes():
    out = with_kv_cache_scheme(BASE, strategy="tensor", observer_name="absmax")
    qc = out["quantization_config"]
    assert sorted(qc) == ["config_groups", "format", "global_compression_ratio", "ignore", "kv_cache_scheme",
                          "quant_method", "quantization_status", "sparsity_config", "transform_config", "version"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"] == {} and qc["ignore"] == [] and qc["format"] == "dense"
    assert qc["quantization_status"] == "frozen"
    assert qc["kv_cache_scheme"] == {
        "actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
        "observer": "static_minmax", "observer_kwargs": {}, "strategy": "tensor", "symmetric": True, "type": "float"}
    assert {k: v for k, v in out.items() if k != "quantization_config"} == BASE


def test_attn_head_strategy_and_observers_without_an_llm_compressor_twin():
    assert kv_cache_scheme("attn_head", "mse")["strategy"] == "attn_head"
    assert kv_cache_scheme("attn_head", "mse")["observer"] == "mse"
    assert kv_cache_scheme("tensor", "percentile")["observer"] is None


def test_compressed_tensors_parses_what_we_write():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    for strategy in ("tensor", "attn_head"):
        qc = new_quantization_config(strategy, "absmax")
        parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items()
                                                    if k not in ("sparsity_config", "transform_config", "version")})
        assert parsed.kv_cache_scheme.strategy == strategy
        assert parsed.kv_cache_scheme.type == "float" and parsed.kv_cache_scheme.num_bits == 8
        assert parsed.kv_cache_scheme.dynamic is False and parsed.kv_cache_scheme.symmetric is True
        QuantizationArgs.model_validate(qc["kv_cache_scheme"])  # extra="forbid": no stray keys


def test_existing_compressed_tensors_weight_config_gains_a_kv_cache_scheme_and_keeps_the_rest():
    weights = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
               "targets": ["Linear"]}
    cfg = dict(BASE, quantization_config={
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": weights}, "ignore": ["lm_head"], "kv_cache_scheme": None, "version": "0.12.2"})
    before = copy.deepcopy(cfg)
    out = with_kv_cache_scheme(cfg, strategy="attn_head", observer_name="absmax")
    assert cfg == before  # the input dict is not modified
    qc = out["quantization_config"]
    assert qc["config_groups"] == {"group_0": weights}
    assert qc["format"] == "float-quantized" and qc["quantization_status"] == "compressed"
    assert qc["ignore"] == ["lm_head"] and qc["version"] == "0.12.2"
    assert qc["kv_cache_scheme"]["strategy"] == "attn_head"


@pytest.mark.parametrize("method, words", [
    ("gptq", "only add a kv_cache_scheme to a compressed-tensors"),
    ("bitsandbytes", "bitsandbytes"),
    ("gguf", "GGUF"),
    ("fp8", "--kv-cache-dtype"),
    ("modelopt", "kv_cache_quant_algo"),
])
def test_other_quantization_methods_are_refused_with_the_reason(method, words):
    cfg = dict(BASE, quantization_config={"quant_method": method, "bits": 4})
    with pytest.raises(InputError) as e:
        with_kv_cache_scheme(cfg, strategy="tensor", observer_name="absmax", config_file="m/config.json")
    assert e.value.field == "quantization_config.quant_method"
    assert e.value.file == "m/config.json"
    assert words in e.value.message and repr(method) in e.value.message


def test_a_config_that_already_declares_a_kv_cache_scheme_is_refused():
    cfg = dict(BASE, quantization_config=new_quantization_config("tensor", "absmax"))
    with pytest.raises(InputError) as e:
        with_kv_cache_scheme(cfg, strategy="tensor", observer_name="absmax")
    assert e.value.field == "quantization_config.kv_cache_scheme"


def test_a_quantization_config_that_is_not_an_object_is_refused():
    with pytest.raises(InputError) as e:
        with_kv_cache_scheme(dict(BASE, quantization_config=[1]), strategy="tensor", observer_name="absmax")
    assert e.value.field == "quantization_config"
