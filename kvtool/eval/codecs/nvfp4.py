"""NVFP4 KV cache (`--kv-cache-dtype nvfp4` / `nvfp4_4over6`) as vLLM 0.33 stores and reads it.

What is stored (vllm/utils/torch_utils.py `nvfp4_kv_cache_full_dim`, `nvfp4_split_data_scale`;
vllm/v1/attention/backends/flashinfer.py `_nvfp4_kv_views`): per token, KV head and side (K, V), head_dim/2 bytes
of e2m1 values and head_dim/16 float8_e4m3 block scales, one per 16 consecutive values of the head. The layer's
k_scale / v_scale is the second level, the per-tensor global scale: loaded from the checkpoint as the FP8 scales
are (vllm/model_executor/layers/quantization/kv_cache.py `BaseKVCacheMethod.process_weights_after_loading`: 1.0
when the checkpoint has none), handed to the store kernel as `layer._k_scale` / `layer._v_scale`
(`FlashInferImpl.do_kv_cache_update`: `reshape_and_cache_flash(..., "nvfp4", layer._k_scale, layer._v_scale)` on
SM100's trtllm-gen path, FlashInfer's `nvfp4_quantize_append_paged_kv_cache_with_slot_mapping` on SM80/90/120).
A calibrated global scale is amax / (448 * 6) = amax / 2688: the largest block scale is then 448, e4m3's largest.

The store computes, for each block of 16 values and global scale g (the TensorRT-LLM `cvt_warp_fp16_to_fp4`
recipe; vLLM's Python restatement of it is `ref_nvfp4_quant` in
vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py, with its global scale = 1 / g):
    sf  = e4m3(clamp((1/g) * (amax_block * (1/6)), -448, 448))
    out = 1 / (sf * (1 / (1/g)))  (0 when sf is 0)
    q   = e2m1(clamp(x * out, -6, 6))   (round to nearest, ties to even; cvt.rn.satfinite.e2m1x2.f32)
and attention reads q * sf * g back (FlashInfer applies the block scales in the kernel and g in its bmm scales).

nvfp4_4over6 (vllm/config/cache.py `CacheConfig.cache_dtype`; vLLM PR #45187): the same layout and read path,
but the store tries a second block scale from amax / 4 beside amax / 6 and keeps the one whose round trip has the
smaller squared error over the block's 16 values. The rule lives only in the CUDA store kernel; kvtool's
assumptions (the error is summed in float32 over the dequantized values, a tie keeps max / 6) are the row's.

Not emulated here: on SM100's trtllm-gen path vLLM also rounds the query to FP8 (`Attention.__init__` query_quant
with q_scale, which defaults to k_scale) and the attention output to FP8 (`_nvfp4_fp8_out`); the FA2 path
(SM80/90/120) keeps both in the model dtype. This codec is the cache's round trip only.
"""

from __future__ import annotations

import torch

BLOCK = 16  # values per e4m3 block scale (kv_dtypes.json `block`; FlashInfer's NVFP4 layout)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688: a calibrated global scale is amax / 2688
# e2m1 magnitudes and the midpoints between neighbours: a value on a midpoint goes to the even code
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1(x: torch.Tensor) -> torch.Tensor:
    """x (float32, already within +-6) rounded to the nearest e2m1 value, ties to the even code, sign kept."""
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    mags = torch.tensor(_E2M1, dtype=torch.float32, device=x.device)
    a = x.abs()
    idx = torch.bucketize(a.contiguous(), mids)  # mids[idx-1] < a <= mids[idx]: on a midpoint, the lower code
    on_mid = (idx < len(_MIDPOINTS)) & (a == mids[idx.clamp(max=len(_MIDPOINTS) - 1)])
    idx = idx + (on_mid & (idx % 2 == 1)).long()  # the lower code is odd: the even one is above
    return torch.copysign(mags[idx], x)


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1 / x, and 0 where x is 0 (the kernel's `SFValue != 0 ? ... : 0`)."""
    return torch.where(x == 0, torch.zeros_like(x), 1.0 / torch.where(x == 0, torch.ones_like(x), x))


def _blocks_roundtrip(xb: torch.Tensor, g: torch.Tensor, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """xb: float32 [..., blocks, 16]; g: the global (dequantization) scale broadcastable to [..., blocks, 1].
    Returns (dequantized values, block scales) for block scales from amax / divisor."""
    inv_g = _reciprocal(g)  # the kernel's SFScaleVal: the quantization-direction global scale
    vec_max = xb.abs().amax(dim=-1, keepdim=True)
    sf = (inv_g * (vec_max * (1.0 / divisor))).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    out_scale = _reciprocal(sf * _reciprocal(inv_g))
    q = e2m1((xb * out_scale).clamp(-E2M1_MAX, E2M1_MAX))
    return q * sf * g, sf


def quantize(x: torch.Tensor, g: torch.Tensor | float, four_over_six: bool = False):
    """x [..., head_dim] -> (dequantized float32 values, e4m3 block scales as float32 [..., head_dim/16])."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs a head size divisible by {BLOCK}, got {x.shape[-1]}")
    g = torch.as_tensor(g, dtype=torch.float32, device=x.device)
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    deq, sf = _blocks_roundtrip(xb, g, E2M1_MAX)
    if four_over_six:
        deq4, sf4 = _blocks_roundtrip(xb, g, 4.0)
        err6 = (deq - xb).pow(2).sum(dim=-1, keepdim=True)
        err4 = (deq4 - xb).pow(2).sum(dim=-1, keepdim=True)
        pick4 = err4 < err6
        deq, sf = torch.where(pick4, deq4, deq), torch.where(pick4, sf4, sf)
    return deq.reshape(x.shape), sf.squeeze(-1)


def roundtrip(x: torch.Tensor, *, role: str, params: dict, row, scale: torch.Tensor | None) -> torch.Tensor:
    """K or V [batch, kv_heads, seq, head_dim] stored as NVFP4 with the layer's global scale (1.0 without one) and
    read back, in x's dtype. params: {"four_over_six": bool}."""
    if role not in ("k", "v"):
        raise ValueError(f"NVFP4 caches K and V, not {role!r}")
    g = torch.ones((), dtype=torch.float32, device=x.device) if scale is None else \
        torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if g.numel() > 1:  # one per KV head: broadcast over [batch, heads, seq, blocks, 1]
        g = g.reshape(1, -1, 1, 1, 1)
    else:
        g = g.reshape(())
    block = getattr(row, "block", None) or BLOCK
    if block != BLOCK:
        raise ValueError(f"NVFP4 blocks hold {BLOCK} values; the dtype row says {block}")
    deq, _ = quantize(x, g, four_over_six=bool(params.get("four_over_six", False)))
    return deq.to(x.dtype)
