"""FP8 e4m3 round trip as vLLM's cache does it, and reading KV scales in every spelling vLLM accepts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kvtool.errors import InputError
from kvtool.eval.fp8 import FP8_MAX, KVScales, declares_fp8_kv, fp8_roundtrip, layer_index, read_checkpoint_scales


def test_roundtrip_matches_the_definition():
    x = torch.randn(2, 3, 5, 8, dtype=torch.bfloat16) * 4
    scale = 0.03
    expect = ((x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)
    got = fp8_roundtrip(x, scale)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expect)
    assert not torch.equal(got, x)  # it really quantizes


def test_saturates_instead_of_nan():
    # torch's cast alone turns 1000 into NaN for e4m3fn; vLLM's kernel saturates to +-448
    x = torch.tensor([1000.0, -1000.0, 448.0, 3.0])
    assert fp8_roundtrip(x, 1.0).tolist() == [FP8_MAX, -FP8_MAX, 448.0, 3.0]
    # with scale 4: 250 rounds to the nearest e4m3 value 256 (3 mantissa bits), 112 and 0.75 are exact
    assert fp8_roundtrip(x, 4.0).tolist() == [1024.0, -1024.0, 448.0, 3.0]


def test_scale_one_keeps_exact_fp8_values():
    x = torch.tensor([0.5, 1.125, -2.25, 240.0])  # representable in e4m3
    assert torch.equal(fp8_roundtrip(x, 1.0), x)


def test_per_head_scales_broadcast_over_kv_heads():
    k = torch.randn(1, 3, 4, 8) * 10
    v = torch.randn(1, 3, 4, 8)
    scales = KVScales.from_mapping({0: ([0.01, 0.1, 1.0], 0.5)})
    fk, fv = scales.hook()(0, k, v)
    for h, s in enumerate([0.01, 0.1, 1.0]):
        assert torch.equal(fk[:, h], fp8_roundtrip(k[:, h], s))
    assert torch.equal(fv, fp8_roundtrip(v, 0.5))
    # a layer without a scale uses 1.0 (vLLM's default)
    fk1, _ = scales.hook()(5, k, v)
    assert torch.equal(fk1, fp8_roundtrip(k, 1.0))


def test_wrong_number_of_head_scales_is_an_input_error():
    fn = KVScales.from_mapping({0: ([0.1, 0.2], 0.5)}).hook()
    with pytest.raises(InputError, match="one per KV head"):
        fn(0, torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4))


@pytest.mark.parametrize("prefix,layer", [("model.layers.3.self_attn", 3), ("model.language_model.layers.12.self_attn", 12),
                                          ("transformer.h.7.attn", 7), ("lm_head", None)])
def test_layer_index(prefix, layer):
    assert layer_index(prefix) == layer


@pytest.mark.parametrize("suffixes", [("k_scale", "v_scale"), ("attn.k_scale", "attn.v_scale"),
                                      ("k_proj.k_scale", "v_proj.v_scale")])
def test_reads_every_spelling(tmp_path, suffixes):
    ks, vs = suffixes
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2),
               f"model.layers.0.self_attn.{ks}": torch.tensor(0.25),
               f"model.layers.0.self_attn.{vs}": torch.tensor([0.5]),
               f"model.layers.1.self_attn.{ks}": torch.tensor([0.1, 0.2, 0.3])}, str(tmp_path / "model.safetensors"))
    s = read_checkpoint_scales(tmp_path)
    assert s.source == "checkpoint" and len(s) == 2
    assert s.k[0].tolist() == [0.25] and s.v[0].tolist() == [0.5]
    assert s.k[1].tolist() == pytest.approx([0.1, 0.2, 0.3]) and 1 not in s.v


def test_legacy_kv_scale_counts_for_both_and_post_rope_names_win(tmp_path):
    save_file({"model.layers.0.self_attn.kv_scale": torch.tensor(2.0),
               "model.layers.1.self_attn.kv_scale": torch.tensor(2.0),
               "model.layers.1.self_attn.k_scale": torch.tensor(0.125)}, str(tmp_path / "model.safetensors"))
    s = read_checkpoint_scales(tmp_path)
    assert s.k[0].item() == 2.0 and s.v[0].item() == 2.0
    assert s.k[1].item() == 0.125 and s.v[1].item() == 2.0


def test_index_limits_reading_to_scale_shards(tmp_path):
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, str(tmp_path / "b.safetensors"))
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2)}, str(tmp_path / "a.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.layers.0.self_attn.q_proj.weight": "a.safetensors",
                        "model.layers.0.self_attn.k_scale": "b.safetensors"}}))
    assert read_checkpoint_scales(tmp_path).k[0].item() == 0.5


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scale_values_are_input_errors(tmp_path, value):
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(value)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(InputError, match="k_scale"):
        read_checkpoint_scales(tmp_path)


def test_unreadable_shard_is_an_input_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(InputError, match="model.safetensors"):
        read_checkpoint_scales(tmp_path)


@pytest.mark.parametrize("config,declared", [
    ({}, False),
    ({"quantization_config": {"quant_method": "compressed-tensors",
                              "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}, True),
    ({"quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": None}}, False),
    ({"quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}}, True),
    ({"quantization_config": {"quant_method": "compressed-tensors",
                              "kv_cache_scheme": {"num_bits": 4, "type": "int"}}}, False),
])
def test_declares_fp8_kv(config, declared):
    assert declares_fp8_kv(config) is declared


@pytest.mark.parametrize("bits", ["x", None, 8.5, True, [8]])
def test_a_kv_cache_scheme_num_bits_that_is_no_integer_is_one_line(bits):
    """int(num_bits) used to end eval in 'internal error: ValueError' for num_bits 'x' (TypeError for null)."""
    config = {"quantization_config": {"kv_cache_scheme": {"type": "float", "num_bits": bits}}}
    with pytest.raises(InputError) as e:
        declares_fp8_kv(config, "m/config.json")
    assert str(e.value).startswith("m/config.json: quantization_config.kv_cache_scheme.num_bits: got "), str(e.value)
    assert declares_fp8_kv({"quantization_config": {"kv_cache_scheme": {"type": "float", "num_bits": 8.0}}})
    assert not declares_fp8_kv({"quantization_config": {"kv_cache_scheme": {"type": "float", "num_bits": 4}}})
