"""Helpers the rotating KV codecs share (TurboQuant, UltraQuant, Octave): Sylvester Hadamard matrices and the
refusal of a head size a rotation cannot cover.

vLLM builds the same ±1 matrix in two precisions before normalising it, and the codecs must round as vLLM does:
TurboQuant's `_build_hadamard_cached` (vllm/v1/attention/backends/turboquant_attn.py) concatenates in float32 and
divides by math.sqrt(d); UltraQuant's `hadamard_matrix` (vllm/v1/attention/ops/ultraquant/reference.py) in
float64, divides by d ** 0.5, then casts to float32. Both are symmetric and orthonormal (H @ H = I), so a
vector rotated by H is rotated back by H.
"""

from __future__ import annotations

import math

import torch

from kvtool.errors import InputError


def sylvester(d: int, dtype: torch.dtype) -> torch.Tensor:
    """The unnormalised d x d Sylvester Hadamard matrix (entries ±1) in dtype; d a power of two."""
    h = torch.tensor([[1.0]], dtype=dtype)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_f32(d: int) -> torch.Tensor:
    """TurboQuant's rotation: float32 ±1 / math.sqrt(d)."""
    return sylvester(d, torch.float32) / math.sqrt(d)


def hadamard_f64(d: int) -> torch.Tensor:
    """UltraQuant's rotation: float64 ±1 / d ** 0.5, cast to float32."""
    return (sylvester(d, torch.float64) / (d ** 0.5)).to(torch.float32).contiguous()


def need_power_of_two(name: str, head_dim: int, role: str) -> None:
    """An InputError naming the dtype when head_dim is no power of two (a Hadamard rotation needs one)."""
    if head_dim <= 0 or head_dim & (head_dim - 1):
        raise InputError(f"{name} rotates {role.upper()} by a Hadamard matrix, which needs a power-of-two head_dim "
                         f"(this model's is {head_dim})", option="kv_cache_dtype")
