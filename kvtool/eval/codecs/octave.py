"""Octave KV cache (octave_k3v4, octave_k3v3, octave_k3v3_compact), as vLLM 0.33's PyTorch reference stores and
reads it (vllm/v1/attention/ops/rocm_octave.py `reference_quantize` / `reference_dequantize`; the ROCm kernels
are HIP, csrc/attention/octave_attn.cu, and not in Python).

K: a fixed ±1 sign pattern (torch.Generator seeded 0x5E17), then an orthonormal Walsh-Hadamard transform over
each 64-wide block (compact: one transform over the whole head). Block K codes the rotary blocks (the first
rope_dim dims) at 4 bits and the rest at 3; compact K codes all at 3. V: the same signs and one transform over
the head (64-wide blocks when head_dim is no power of two), value_bits codes (kv_dtypes.json). Each block's
code c is the nearest Lloyd-Max level of N(0, 1) (int8 LUT, on x / rms * LUT_MULT), and the block's scale
|x|^2 / (x . LUT[c]) * 64 is stored as float16, so x . x_hat = |x|^2. It reads back as LUT[c] * scale16 / 64,
rotated back (fp32). The kernels score in the rotated space with a query rotated like K, which gives the same
dot products (the transform is orthonormal).

rope_dim: params `rope_dim`, the model's rotary dims (vLLM: head_dim * partial_rotary_factor,
`rope_dim_from_hf_config`); the table's rows hold null there, which eval's hook fills from the model
(kvtool.eval.kv_emulation.MODEL_PARAMS); null is head_dim (full rotary). vLLM 0.33's kernels serve head_dim 256 with 64 rotary
dims only (rocm_octave_attn.py `_KERNEL_HEAD_SIZE`, `_KERNEL_ROPE_DIM`); the reference, and this codec, take
any multiple of 64. vLLM keeps no boundary layers for Octave.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from kvtool.errors import InputError

HADAMARD_BLOCK = 64
SIGN_SEED = 0x5E17
ROPE_BITS, NOPE_BITS = 4, 3
LUT = {3: (-127, -79, -45, -14, 14, 45, 79, 127),
       4: (-126, -95, -74, -58, -43, -30, -18, -6, 6, 18, 30, 43, 58, 74, 95, 126)}
LUT_MULT = {3: 59.0, 4: 46.0}
LUT_ONE = 64.0


@lru_cache(maxsize=8)
def _signs_cpu(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SIGN_SEED)
    return torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) * -2 + 1


def signs(n: int, device) -> torch.Tensor:
    return _signs_cpu(n).to(device=device, dtype=torch.float32)


def fwht_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over consecutive blocks of the last dim (`fwht_blocks`)."""
    shape = x.shape
    y = x.reshape(-1, shape[-1] // block, block).float()
    h = 1
    while h < block:
        y = y.view(*y.shape[:-1], block // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).view(*y.shape[:-3], block)
        h *= 2
    return (y * (1.0 / math.sqrt(block))).view(shape)


def v_block(head_dim: int) -> int:
    return head_dim if head_dim & (head_dim - 1) == 0 else HADAMARD_BLOCK


def _lut(bits: int, device) -> torch.Tensor:
    return torch.tensor(LUT[bits], dtype=torch.float32, device=device)


def quantize_block(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int64, scale float32 [..., 1]) of rotated blocks x [..., n]: `_quantize_lut`."""
    lut = _lut(bits, x.device)
    ss = x.pow(2).sum(-1, keepdim=True)
    rms = (ss / x.shape[-1]).sqrt().clamp_min(1e-12)
    codes = torch.bucketize(x / rms * LUT_MULT[bits], (lut[1:] + lut[:-1]) / 2)
    dot = (x * lut[codes]).sum(-1, keepdim=True)
    return codes, torch.where(dot > 0, ss / dot.clamp_min(1e-30), 0.0) * LUT_ONE


def dequantize_block(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """LUT[codes] * (scale as float16) / 64, float32 (`reference_dequantize`)."""
    return _lut(bits, codes.device)[codes] * (scale.to(torch.float16).float() / LUT_ONE)


def _shape_problem(row, d: int, r: int) -> str | None:
    if d % HADAMARD_BLOCK or r % HADAMARD_BLOCK or r > d:
        return (f"{row.name} needs head_dim and the rotary dims in multiples of {HADAMARD_BLOCK} "
                f"(head_dim {d}, rotary dims {r})")
    if row.compact and d & (d - 1):
        return f"{row.name} needs a power-of-two head_dim (this model's is {d})"
    return None


def roundtrip(x: torch.Tensor, *, role: str, params: dict, row, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The codec (kvtool.eval.codecs): K or V of one layer through the Octave cache of `row` (value_bits,
    compact from kv_dtypes.json; params rope_dim, optional). Checkpoint scales play no part."""
    d = x.shape[-1]
    r = int(params.get("rope_dim") or d)
    problem = _shape_problem(row, d, r)
    if problem:
        raise InputError(problem, option="kv_cache_dtype")
    sgn = signs(d, x.device)
    if role == "v":
        blk = v_block(d)
        codes, s = quantize_block(fwht_blocks(x.float() * sgn, blk), row.value_bits)
        return (fwht_blocks(dequantize_block(codes, s, row.value_bits), blk) * sgn).to(x.dtype)
    if role != "k":
        raise ValueError(f"{row.name}: no {role!r} role (Octave stores K and V of standard attention)")
    if row.compact:
        codes, s = quantize_block(fwht_blocks(x.float() * sgn, d), NOPE_BITS)
        return (fwht_blocks(dequantize_block(codes, s, NOPE_BITS), d) * sgn).to(x.dtype)
    k = fwht_blocks(x.float() * sgn, HADAMARD_BLOCK).view(*x.shape[:-1], d // HADAMARD_BLOCK, HADAMARD_BLOCK)
    nr = r // HADAMARD_BLOCK
    parts = []
    for blocks, bits in ((k[..., :nr, :], ROPE_BITS), (k[..., nr:, :], NOPE_BITS)):
        if blocks.shape[-2]:
            codes, s = quantize_block(blocks, bits)
            parts.append(dequantize_block(codes, s, bits))
    rot = torch.cat(parts, -2).reshape(*x.shape[:-1], d)
    return (fwht_blocks(rot, HADAMARD_BLOCK) * sgn).to(x.dtype)
