"""The nvfp4 codec (kvtool/eval/codecs/nvfp4.py) against vLLM 0.33's own NVFP4 quantizer, run as vLLM wrote it.

vLLM 0.33 stores the NVFP4 KV cache in CUDA only (its reshape_and_cache_flash on SM100, FlashInfer's
nvfp4_quantize_append_paged_kv_cache_with_slot_mapping elsewhere); its Python restatement of that recipe is
`ref_nvfp4_quant` (vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py), copied verbatim to
tests/data/vllm/0.33.0/ and executed here. The codes and block scales match it bit for bit (exact); that the CUDA
kernels compute the same is the row's assumption (match: assumed), as is the 4over6 choice rule.
"""

from __future__ import annotations

import types

import pytest
import torch

from kvtool.eval import codecs
from kvtool.eval.codecs import nvfp4
from kvtool.model import kv_dtypes, kv_emulations
from tests.oracle.test_vllm_facts import _function, _segments

NVFP4_UTILS = "vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py"


def _vllm():
    """vLLM's get_reciprocal, cast_to_fp4, ref_nvfp4_quant and ref_nvfp4_quant_dequant (its CPU branch), verbatim."""
    env: dict = {"torch": torch, "FLOAT4_E2M1_MAX_RECIPROCAL": 1 / 6.0,  # 1 / scalar_types.float4_e2m1f.max()
                 "current_platform": types.SimpleNamespace(is_cuda_alike=lambda: False)}
    for name in ("get_reciprocal", "cast_to_fp4", "ref_nvfp4_quant", "ref_nvfp4_quant_dequant"):
        env[name] = _function(NVFP4_UTILS, name, **env)
    return types.SimpleNamespace(**env)


def _rt(x, name, scale=None, role="k"):
    r = kv_emulations.get(name)
    return codecs.get(r.codec)(x, role=role, params=dict(r.params), row=kv_dtypes.get(name), scale=scale)


def _kv(seed: int, dtype=torch.bfloat16, shape=(2, 3, 7, 64)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    # blocks of very different magnitudes (scales from e4m3's subnormals to its top), and exact zeros
    x = x * torch.logspace(-3, 2, shape[-1] // 16).repeat_interleave(16)
    x[0, 0, 0, :16] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("g", [1.0, 0.37, 2.0 ** -5, "amax"])
def test_nvfp4_matches_vllm_reference_quantizer(g):
    """Exact against vLLM's Python reference: e2m1 codes and e4m3 block scales equal ref_nvfp4_quant's with global
    scale 1 / k_scale, and the codec returns codes * block scale * k_scale. That the CUDA stores compute the same is
    assumed (the row's match: assumed, and its assumption)."""
    v = _vllm()
    x = _kv(0)
    k = float(x.float().abs().max()) / nvfp4.GLOBAL_DIVISOR if g == "amax" else g
    k_scale = torch.tensor(k, dtype=torch.float32)
    fp4, sf = v.ref_nvfp4_quant(x.float().reshape(-1, 64), 1.0 / k_scale, 16)
    deq, mine_sf = nvfp4.quantize(x, k_scale)
    assert torch.equal(mine_sf.reshape(-1), sf.reshape(-1))
    want = (fp4.reshape(-1, 4, 16) * sf.reshape(-1, 4, 1)) * k_scale
    assert torch.equal(deq.reshape(-1, 4, 16), want)
    got = _rt(x, "nvfp4", k_scale)
    assert got.dtype == x.dtype and got.shape == x.shape and torch.equal(got, want.reshape(x.shape).to(x.dtype))


def test_e2m1_rounding_is_vllms_cast_to_fp4_ties_included():
    """Exact: every e2m1 midpoint and its neighbours round as vLLM's cast_to_fp4 (ties to the even code)."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    eps = torch.tensor(2.0 ** -20)
    x = torch.cat([mids, mids - eps, mids + eps, -mids, torch.linspace(-6, 6, 1001)])
    assert torch.equal(nvfp4.e2m1(x), _vllm().cast_to_fp4(x.clone()))


def test_power_of_two_global_scale_equals_vllms_quant_dequant():
    """Exact: with a power-of-two k_scale (1 / (1 / k) is k), the round trip is vLLM's ref_nvfp4_quant_dequant."""
    x = _kv(1, dtype=torch.float32)
    k = torch.tensor(2.0 ** -3)
    want = _vllm().ref_nvfp4_quant_dequant(x.reshape(-1, 64), 1.0 / k, 16).reshape(x.shape)
    assert torch.equal(_rt(x, "nvfp4", k), want)


def test_calibrated_global_scale_puts_the_largest_block_scale_at_448():
    """A global scale of amax / 2688 maps the tensor's largest block onto e4m3's largest scale, 448."""
    x = _kv(2)
    k = torch.tensor(float(x.float().abs().max()) / 2688.0)
    _, sf = nvfp4.quantize(x, k)
    assert float(sf.max()) == 448.0
    _, sf1 = nvfp4.quantize(x, torch.tensor(1.0))  # vLLM's default without a checkpoint scale
    assert float(sf1.max()) < 448.0


def test_4over6_keeps_the_better_of_the_two_block_scales():
    """Assumed rule (CUDA only; vllm/config/cache.py CacheConfig.cache_dtype states it): per block of 16, the round
    trip from max/6 or from max/4, whichever has the smaller squared error; never worse than nvfp4 block by block."""
    x = _kv(3, dtype=torch.float32)
    k = torch.tensor(float(x.abs().max()) / 2688.0)
    xb = x.float().reshape(2, 3, 7, 4, 16)
    six, sf6 = nvfp4.quantize(x, k)
    four, sf4 = nvfp4._blocks_roundtrip(xb, k, 4.0)
    both = _rt(x, "nvfp4_4over6", k).float().reshape(xb.shape)
    e6 = (six.reshape(xb.shape) - xb).pow(2).sum(-1)
    e4 = (four - xb).pow(2).sum(-1)
    eb = (both - xb).pow(2).sum(-1)
    assert torch.equal(eb, torch.minimum(e4, e6))
    picked4 = e4 < e6
    assert picked4.any() and (~picked4).any()  # both candidates win somewhere on this data
    assert torch.equal(both[picked4], four[picked4])
    assert torch.equal(both[~picked4], six.reshape(xb.shape)[~picked4])
    _, sf_both = nvfp4.quantize(x, k, four_over_six=True)
    assert torch.equal(sf_both, torch.where(picked4, sf4.squeeze(-1), sf6))
    assert float(eb.sum()) < float(e6.sum())


def test_rows_layout_and_scales_are_vllms():
    """The rows say what vLLM's code does: 16 values per e4m3 scale beside head_dim/2 bytes of e2m1 (the layout the
    codec quantizes), K and V stored with layer._k_scale / _v_scale (checkpoint scales, 1.0 without them), and
    4over6 reusing the NVFP4 layout."""
    for name in ("nvfp4", "nvfp4_4over6"):
        assert kv_dtypes.get(name).block == nvfp4.BLOCK
        assert kv_emulations.get(name).scales == "checkpoint"
    assert "data_dim = full_dim * 8 // 9" in _segments("vllm/utils/torch_utils.py")["nvfp4_split_data_scale"]
    upd = " ".join(_segments("vllm/v1/attention/backends/flashinfer.py")["FlashInferImpl.do_kv_cache_update"].split())
    assert "data, scales, layer._k_scale, layer._v_scale," in upd  # FlashInfer's FA2 store
    assert "self.cache_dtype, layer._k_scale, layer._v_scale, )" in upd  # vLLM's CUDA store (trtllm-gen path)
    load = _segments("vllm/model_executor/layers/quantization/kv_cache.py")[
        "BaseKVCacheMethod.process_weights_after_loading"]
    assert "k_scale = 1.0" in load and "is_quantized_kv_cache(layer.kv_cache_dtype)" in load
    assert kv_dtypes.get("nvfp4_4over6").layout == kv_dtypes.get("nvfp4").layout == "nvfp4"


def test_batch_rows_are_independent_and_per_head_scales_broadcast():
    x = _kv(4)
    k = torch.tensor([0.01, 0.02, 0.05])  # one per KV head
    whole = _rt(x, "nvfp4_4over6", k)
    assert torch.equal(whole[1:], _rt(x[1:], "nvfp4_4over6", k))
    assert torch.equal(whole[:, 2], _rt(x[:, 2:3], "nvfp4_4over6", k[2:3]).squeeze(1))
    with pytest.raises(ValueError, match="divisible by 16"):
        _rt(torch.zeros(1, 1, 1, 24), "nvfp4")


def test_the_eval_hook_applies_the_layers_global_scales():
    """kvtool.eval.kv_emulation's hook hands each layer's checkpoint k / v scale to the codec (scales: checkpoint)."""
    from kvtool.eval.fp8 import KVScales
    from kvtool.eval.kv_emulation import build

    k, v = _kv(5), _kv(6)
    scales = KVScales.from_mapping({0: (torch.tensor(0.02), torch.tensor(0.5))}, source="given")
    hk, hv = build("nvfp4_4over6", scales, num_layers=1)(0, k, v)
    assert torch.equal(hk, _rt(k, "nvfp4_4over6", torch.tensor(0.02)))
    assert torch.equal(hv, _rt(v, "nvfp4_4over6", torch.tensor(0.5), role="v"))
    assert not torch.equal(hv, _rt(v, "nvfp4_4over6", torch.tensor(1.0), role="v"))
