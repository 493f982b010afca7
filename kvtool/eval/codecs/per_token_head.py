"""Per-token-head KV caches (int8_per_token_head, fp8_per_token_head, int4_per_token_head), as vLLM 0.33 stores and
reads them. Checkpoint k/v scales are ignored: every token of every KV head gets its own scale, computed when it is
written.

int8 / fp8 (vllm/v1/attention/ops/triton_reshape_and_cache_flash.py `_reshape_cache_per_token_head`, float32):
scale = max(absmax / QUANT_MAX, 1e-6) over the head's values (QUANT_MAX 127 for int8, the fp8 dtype's max, 448,
for fp8); q = x * (1 / scale); int8 rounds half away from zero (q + 0.5 or q - 0.5, then the store truncates)
after a clamp to [-128, 127]; fp8 clamps to +-448 and the store casts to float8_e4m3fn. The attention
(vllm/v1/attention/ops/triton_unified_attention.py `kernel_unified_attention`, KV_QUANT_MODE 2 / 3) reads
q.to(Q.dtype) and multiplies the dot by the token's scale: K and V as q * scale.

int4 (vllm/v1/attention/ops/int4_per_token_head.py `reshape_and_cache_int4`): K and V are first rotated by a
randomized Hadamard transform (`single_rht`: deterministic signs, the Hadamard of the largest power-of-two divisor
of head_dim, unnormalized) and cast back to the model dtype; then asymmetric 4 bits per (token, head):
scale = max((max - min) / 15, 1e-6), zero point zp = clamp(round(-min / scale), 0, 15), q = clamp(round(x / scale
+ zp), 0, 15), rounding half away from zero; the zero point is hidden in the low 4 mantissa bits of the float32
scale, so the read scale is the written one with those bits replaced (`_attn_packed`: (bits & -16)). The attention
rotates Q the same way, scores Q.(q - zp) * scale / b and rotates the output back (/ b, b the transform's block):
what it reads back is the inverse transform of (q - zp) * scale, / b.
"""

from __future__ import annotations

import torch

from kvtool.eval.codecs.fp8 import FORMATS

QUANT = {"int8": (127.0, -128.0), "float8_e4m3fn": (448.0, -448.0)}  # _PER_TOKEN_HEAD_QUANT_PARAMS (CUDA)
MIN_SCALE = 1e-6


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as the cache stores them: int8 or float8_e4m3fn, float32 scales [..., 1]) of x along its last dim."""
    top, bottom = QUANT[fmt]
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(-1, keepdim=True) / top, min=MIN_SCALE)
    q = xf * (1.0 / scale)
    if fmt == "int8":
        q = torch.where(q >= 0, q + 0.5, q - 0.5)  # round half away from zero; the int8 store truncates
        return q.clamp_(bottom, top).to(torch.int8), scale
    return q.clamp_(bottom, top).to(FORMATS[fmt]), scale


def roundtrip(x: torch.Tensor, *, role: str, params: dict, row=None, scale=None) -> torch.Tensor:
    """int8 / fp8 per token-head (params["format"]): what the attention reads back, q * scale, in x's dtype."""
    q, s = quantize(x, params["format"])
    return (q.float() * s).to(x.dtype)


# --- int4 -------------------------------------------------------------------------------------------

_SIGNS: dict[tuple[int, str], torch.Tensor] = {}


def _block(d: int) -> int:
    return d & (-d)  # vllm/utils/math_utils.py largest_power_of_2_divisor


def _signs(d: int, device) -> torch.Tensor:
    """int4_per_token_head.py `_get_rht_signs(d, 0)`: the deterministic +-1 vector, seeded as vLLM seeds it."""
    key = (d, str(device))
    if key not in _SIGNS:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0x9E3779B9)
        _SIGNS[key] = (2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0).to(device)
    return _SIGNS[key]


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform of the last dim (vLLM's butterfly, `fast_hadamard_transform`)."""
    d = x.shape[-1]
    h = 1
    while h < d:
        xv = x.view(*x.shape[:-1], d // (2 * h), 2, h)
        x = torch.stack([xv[..., 0, :] + xv[..., 1, :], xv[..., 0, :] - xv[..., 1, :]], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`single_rht`: H D x (inverse: D H x), block-diagonal over the largest power-of-two divisor of the last dim."""
    d = x.shape[-1]
    b = _block(d)
    if b < d:
        lead = x.shape[:-1]
        return rht(x.reshape(*lead, d // b, b), inverse).reshape(*lead, d)
    s = _signs(d, x.device)
    return _hadamard(x.contiguous()) * s if inverse else _hadamard((x * s).contiguous())


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 0, v + 0.5, v - 0.5).to(torch.int32).float()


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15 as uint8 [..., d], the stored float32 scale with the zero point in its low 4 bits [..., 1],
    zero points as float [..., 1]) of an already rotated x, as `_reshape_cache_int4_kernel` computes them."""
    xf = x.float()
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    scale = torch.clamp((hi - lo) / 15.0, min=MIN_SCALE)
    zp = _round_half_away(-lo / scale).clamp_(0.0, 15.0)
    q = _round_half_away(xf * (1.0 / scale) + zp).clamp_(0.0, 15.0)
    packed = ((scale.view(torch.int32) & -16) | (zp.to(torch.int32) & 0xF)).view(torch.float32)
    return q.to(torch.uint8), packed, zp


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte, the even element in the low nibble (`pack_int4_nibbles`)."""
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def roundtrip_int4(x: torch.Tensor, *, role: str, params: dict, row=None, scale=None) -> torch.Tensor:
    """int4 per token-head: rotate, quantize, dequantize with the stored scale ((bits & -16)) and zero point, rotate
    back and divide by the block, in x's dtype."""
    rotated = rht(x.float()).to(x.dtype)  # reshape_and_cache_int4: single_rht(key.float()).to(key.dtype)
    q, packed, zp = quantize_int4(rotated)
    read_scale = (packed.view(torch.int32) & -16).view(torch.float32)
    deq = (q.float() - zp) * read_scale
    return (rht(deq, inverse=True) / _block(x.shape[-1])).to(x.dtype)
