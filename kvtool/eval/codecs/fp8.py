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


_E4M3_SHIFT = 2.0 ** -120  # fp32 exponent bias 127 -> e4m3 bias 7
_E4M3_KEEP = -(1 << 20)  # keep sign, exponent and the top 3 mantissa bits of the shifted fp32 value


def fp8_roundtrip_toward_zero(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x quantized to e4m3 the way vLLM's CPU backend stores it, and dequantized, in x's dtype.

    `float_to_fp8e4m3_scalar` (vllm 0.32.0 csrc/cpu/cpu_attn_fp8.hpp, called by
    `reshape_and_cache_fp8_vec_impl` for the VEC ISA) multiplies by 1/scale, clamps to +-448, shifts
    the exponent by 2^-120 and keeps bits 20.. of the fp32 pattern: the mantissa is truncated (rounded
    toward zero), not rounded to nearest even, subnormals included. Dequantization is exact
    (`fp8e4m3_to_float_scalar`: the byte back in place, times scale * 2^120)."""
    inv = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reciprocal()  # 1.0f / (float)k_scale
    v = (x.float() * inv).clamp_(-FP8_MAX, FP8_MAX) * _E4M3_SHIFT
    q = (v.view(torch.int32) & _E4M3_KEEP).view(torch.float32)
    return (q * (1.0 / _E4M3_SHIFT) * scale).to(x.dtype)


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
    (None: 1.0, vLLM's default), round to nearest even, saturating."""
    s = 1.0 if scale is None else broadcast_scale(scale, x, role)
    return fp8_roundtrip(x, s, params["format"])
