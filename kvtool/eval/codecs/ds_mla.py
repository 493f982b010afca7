"""`--kv-cache-dtype fp8_ds_mla`: DeepSeek V3.2's 656-byte sparse-MLA token, as vLLM 0.33 stores and reads it.

The layout (vllm/v1/attention/backends/mla/flashmla_sparse.py, the module's format note;
vllm/third_party/flashmla/flash_mla_interface.py `flash_mla_with_kvcache`): per token and layer, the 512 latent
("NoPE") values as float8_e4m3 with four float32 scales, one per 128 consecutive values, then the 64 rope-key
values unquantized in 16 bits (128 bytes). vLLM computes the tile scales itself when it writes the cache, so a
checkpoint's k_scale is not read (`MLAAttention.get_kv_cache_spec`: 656 bytes per token;
`_canonicalize_sparse_mla_kv_cache_dtype` maps fp8 / fp8_e4m3 onto this format on the sparse backends).

The writer, for the models served with this format (DeepSeek V3.2 and GLM-MoE-DSA, vllm/models/deepseek_v32/
attention.py, which passes the layer's cache to `fused_norm_rope`): the Triton kernel `_fused_norm_rope_kernel`
(vllm/models/deepseek_v32/common/kernels.py, its fp8_ds_mla branch) scales each tile of 128 by a power of two,
    scale = exp2(ceil(log2(max(amax(|tile|) * (1/448), 1e-4))))     (float32)
stores e4m3(tile / scale) (the scale is at least amax / 448: no value saturates) and the float32 scale, and the rope
values cast to bfloat16; FlashMLA reads e4m3 * scale. The kernel quantizes the RMS-normed latent in float32, before
any rounding to the model dtype, while transformers hands kvtool the latent in the model dtype: that and the GPU's
round-to-nearest cast are the row's assumption. (vLLM's CUDA `concat_and_cache_ds_mla_kernel`, used for a
hisparse cache, scales by amax / 448 without the power of two.)

Roles (kvtool.runtime.kv_hooks.latent_hook): "latent" [batch, 1, seq, kv_lora_rank] is tiled by 128; "rope"
[batch, 1, seq, qk_rope_head_dim] is stored as bfloat16 (unchanged for a bfloat16 model).
"""

from __future__ import annotations

import torch

TILE = 128  # latent values per float32 scale
E4M3_MAX = 448.0


def tile_scales(x: torch.Tensor) -> torch.Tensor:
    """x [..., n*128] -> float32 scales [..., n]: the power of two at or above each tile's amax / 448 (1e-4 at
    least), as vLLM's fp8_ds_mla writer computes it."""
    if x.shape[-1] % TILE:
        raise ValueError(f"fp8_ds_mla tiles the latent by {TILE}; got {x.shape[-1]} values")
    t = x.float().reshape(*x.shape[:-1], x.shape[-1] // TILE, TILE)
    s = torch.clamp(t.abs().amax(dim=-1) * (1.0 / E4M3_MAX), min=1e-4)
    return torch.exp2(torch.ceil(torch.log2(s)))


def roundtrip(x: torch.Tensor, *, role: str, params: dict, row, scale: torch.Tensor | None) -> torch.Tensor:
    """The latent or rope key as FlashMLA reads it back from a fp8_ds_mla cache, in x's dtype."""
    if role == "rope":  # stored as bfloat16
        return x.to(torch.bfloat16).to(x.dtype)
    if role != "latent":
        raise ValueError(f"fp8_ds_mla caches the MLA latent and rope key, not {role!r}")
    s = tile_scales(x).unsqueeze(-1)  # [..., tiles, 1]
    t = x.float().reshape(*x.shape[:-1], x.shape[-1] // TILE, TILE)
    q = (t / s).to(torch.float8_e4m3fn).float()
    return (q * s).reshape(x.shape).to(x.dtype)


# --- nvfp4_ds_mla: the 352-byte token (SM100 only) ------------------------------------------------------------
# vllm/v1/attention/backends/mla/flashmla_sparse.py (format note): 512 e2m1 latent values (256 bytes), 64 rope
# values as unscaled e4m3, 32 e4m3 scales, one per 16 latent values. The writer, the same Triton kernel's
# MLA_CACHE_NVFP4 branch (and the CUDA concat_and_cache_nvfp4_ds_mla it is kept in lockstep with):
#     sf = e4m3(max(amax(|16 values|) * (1/6), 2^-9)),  q = e2m1(x * (1 / sf))  (cvt.rn.satfinite.e2m1x2.f32)
# no global scale (the layer's k_scale is not read), and FlashMLA reads q * sf.
NVFP4_BLOCK = 16
_SF_FLOOR = 2.0 ** -9  # e4m3's smallest subnormal: no block scale is zero


def roundtrip_nvfp4(x: torch.Tensor, *, role: str, params: dict, row, scale: torch.Tensor | None) -> torch.Tensor:
    """The latent or rope key as FlashMLA reads it back from a nvfp4_ds_mla cache, in x's dtype."""
    from kvtool.eval.codecs.nvfp4 import E2M1_MAX, e2m1

    if role == "rope":  # unscaled e4m3 (saturating: the GPU's cvt.rn.satfinite)
        return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float().to(x.dtype)
    if role != "latent":
        raise ValueError(f"nvfp4_ds_mla caches the MLA latent and rope key, not {role!r}")
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_ds_mla blocks the latent by {NVFP4_BLOCK}; got {x.shape[-1]} values")
    t = x.float().reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = t.abs().amax(dim=-1, keepdim=True)
    sf = torch.clamp(amax * (1.0 / 6.0), min=_SF_FLOOR).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    q = e2m1((t * (1.0 / sf)).clamp(-E2M1_MAX, E2M1_MAX))
    return (q * sf).reshape(x.shape).to(x.dtype)
