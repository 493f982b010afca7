"""`--kv-cache-dtype fp8_ds_mla`: DeepSeek V3.2's 656-byte sparse-MLA token, as vLLM 0.33 stores and reads it.

The layout (vllm/v1/attention/backends/mla/flashmla_sparse.py, the module's format note;
vllm/third_party/flashmla/flash_mla_interface.py `flash_mla_with_kvcache`): per token and layer, the 512 latent
("NoPE") values as float8_e4m3 with four float32 scales, one per 128 consecutive values, then the 64 rope-key
values unquantized in 16 bits (128 bytes). vLLM computes the tile scales itself when it writes the cache, so a
checkpoint's k_scale is not read (`MLAAttention.get_kv_cache_spec`: 656 bytes per token;
`_canonicalize_sparse_mla_kv_cache_dtype` maps fp8 / fp8_e4m3 onto this format on the sparse backends).

The writer is the CUDA kernel `concat_and_cache_ds_mla_kernel` (csrc/cache_kernels.cu; no Python or Triton
version ships in vLLM 0.33): tile scale = amax(|tile|) / 448 in float32, values = e4m3(x / scale), saturating
round to nearest even, and FlashMLA reads e4m3 * scale. The row's assumption names this.

Roles (kvtool.runtime.kv_hooks.latent_hook): "latent" [batch, 1, seq, kv_lora_rank] is tiled by 128; "rope"
[batch, 1, seq, qk_rope_head_dim] is copied in the model's 16-bit dtype (the kernel copies its scalar_t values),
so it comes back unchanged.
"""

from __future__ import annotations

import torch

TILE = 128  # latent values per float32 scale
E4M3_MAX = 448.0


def tile_scales(x: torch.Tensor) -> torch.Tensor:
    """x [..., n*128] -> float32 scales [..., n]: each tile's absolute maximum / 448."""
    if x.shape[-1] % TILE:
        raise ValueError(f"fp8_ds_mla tiles the latent by {TILE}; got {x.shape[-1]} values")
    t = x.float().reshape(*x.shape[:-1], x.shape[-1] // TILE, TILE)
    return t.abs().amax(dim=-1) / E4M3_MAX


def roundtrip(x: torch.Tensor, *, role: str, params: dict, row, scale: torch.Tensor | None) -> torch.Tensor:
    """The latent or rope key as FlashMLA reads it back from a fp8_ds_mla cache, in x's dtype."""
    if role == "rope":
        return x.clone()
    if role != "latent":
        raise ValueError(f"fp8_ds_mla caches the MLA latent and rope key, not {role!r}")
    s = tile_scales(x).unsqueeze(-1)  # [..., tiles, 1]
    t = x.float().reshape(*x.shape[:-1], x.shape[-1] // TILE, TILE)
    safe = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero tile stores zeros
    q = (t / safe).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).reshape(x.shape).to(x.dtype)
