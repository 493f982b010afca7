"""TurboQuant KV cache (turboquant_k8v4, turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc), as vLLM
0.33 stores it and its attention reads it back.

Store (vllm/v1/attention/ops/triton_turboquant_store.py `triton_turboquant_store`, one (token, head) at a time):
- K, key_bits 8 (k8v4): cast to float8 e4m3 with no scale (`_tq_fused_store_fp8`: `k_vals.to(tl.float8e4nv)`,
  cvt.rn.satfinite on Hopper and later); read back as that float8 value.
- K, key_bits 3 or 4 (MSE): norm = |k| (float32); y = (k / (norm + 1e-8)) @ H, H the orthonormal Sylvester
  Hadamard (`_build_hadamard`: no random signs, the same for every layer); each y_i gets the index of its
  Lloyd-Max centroid for N(0, 1/D) (`get_centroids(D, key_bits)`, binary search over the midpoints, y >= mid
  goes up); the norm is stored as float16.
- V (3 or 4 bits): min / max of the vector, scale = (max - min) / (2^bits - 1) (at least 1e-8), code =
  int((v - min) / scale + 0.5) clamped to the range; scale and min stored as float16.
Read (vllm/v1/attention/ops/triton_turboquant_decode.py `_tq_decode_stage1`): the score of a key is
norm16 * (q @ H) . c, with c the centroid vector, scaled to unit length first when `norm_correction` (the "nc"
presets); V is code * scale16 + min16. Because H is orthonormal and symmetric, (q @ H) . (norm16 * c) equals
q . (norm16 * c @ H): this codec returns K un-rotated, norm16 * c @ H, so transformers' attention with the raw
query computes the scores vLLM computes from the rotated query (tests/eval/codecs/test_turboquant.py checks it,
and that vLLM's decode attention kernel, run by Triton's interpreter, is attention over this codec's K and V).
The FP8 path scores q . k8 with the raw query. Everything is float32 and returned in x's dtype.

Boundary layers (TurboQuantConfig.get_boundary_skip_layers: first and last 2 layers of a dense model, at most
half of them) are the hook's: kv_dtypes.json `boundary_layers`, kvtool.model.kvcache.cache_format's `skip`.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from kvtool.eval.codecs.rotation import hadamard_f32, need_power_of_two

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: cvt.rn.satfinite saturates there


def _gaussian_pdf(x: float, sigma2: float) -> float:
    return (1.0 / math.sqrt(2 * math.pi * sigma2)) * math.exp(-x * x / (2 * sigma2))


def _trapz(f, a: float, b: float, n: int = 200) -> float:
    h = (b - a) / n
    result = 0.5 * (f(a) + f(b))
    for i in range(1, n):
        result += f(a + i * h)
    return result * h


@lru_cache(maxsize=16)
def lloyd_max(d: int, bits: int, max_iter: int = 200, tol: float = 1e-10) -> tuple[float, ...]:
    """The 2^bits Lloyd-Max centroids for N(0, 1/d), as vLLM 0.33 solves them
    (model_executor/layers/quantization/turboquant/centroids.py `solve_lloyd_max`: the same float64 steps,
    trapezoid integrals of 200 steps over +-3.5 sigma, edges at 3x that), before the float32 cast."""
    n_levels = 2 ** bits
    sigma2 = 1.0 / d
    sigma = math.sqrt(sigma2)

    def pdf(x):
        return _gaussian_pdf(x, sigma2)

    lo, hi = -3.5 * sigma, 3.5 * sigma
    centroids = [lo + (hi - lo) * (i + 0.5) / n_levels for i in range(n_levels)]
    for _ in range(max_iter):
        boundaries = [(centroids[i] + centroids[i + 1]) / 2.0 for i in range(n_levels - 1)]
        edges = [lo * 3] + boundaries + [hi * 3]
        new = []
        for i in range(n_levels):
            a, b = edges[i], edges[i + 1]
            num = _trapz(lambda x: x * pdf(x), a, b)
            den = _trapz(pdf, a, b)
            new.append(num / den if den > 1e-15 else centroids[i])
        if max(abs(new[i] - centroids[i]) for i in range(n_levels)) < tol:
            break
        centroids = new
    return tuple(centroids)


def centroids(d: int, bits: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids, midpoints) as float32, as the backend keeps them (`_ensure_on_device`)."""
    c = torch.tensor(lloyd_max(d, bits), dtype=torch.float32, device=device)
    c_sorted, _ = c.sort()
    return c, (c_sorted[:-1] + c_sorted[1:]) / 2


def encode_key(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices int64 [..., D], norm as stored (float16) [..., 1], H): the MSE key store of
    `triton_turboquant_store` (norm, normalise, rotate by H, bucketize on the midpoints)."""
    d = x.shape[-1]
    h = hadamard_f32(d).to(x.device)
    k = x.float()
    norms = k.norm(dim=-1, keepdim=True)
    y = (k / (norms + 1e-8)) @ h
    _, mid = centroids(d, bits, x.device)
    # the kernel's binary search: lo moves past every midpoint with y >= mid, i.e. searchsorted(right=True)
    idx = torch.searchsorted(mid, y.contiguous(), right=True)
    return idx, norms.to(torch.float16), h


def decode_key_rotated(idx: torch.Tensor, norm16: torch.Tensor, bits: int, norm_correction: bool) -> torch.Tensor:
    """K in the rotated domain as the decode kernel reads it: norm16 * c (c scaled to unit length when
    norm_correction), float32."""
    c_all, _ = centroids(idx.shape[-1], bits, idx.device)
    c = c_all[idx]
    if norm_correction:
        c = c * (1.0 / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16))
    return norm16.float() * c


def encode_value(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int32, scale float16, zero float16): `_store_quantized_value`."""
    top = 2 ** bits - 1
    v = x.float()
    vmin = v.amin(-1, keepdim=True)
    vmax = v.amax(-1, keepdim=True)
    s = (vmax - vmin) / float(top)
    s = torch.where(s > 1e-8, s, torch.full_like(s, 1e-8))
    q = ((v - vmin) / s + 0.5).to(torch.int32).clamp(0, top)  # .to(int32) truncates, as tl's cast does
    return q, s.to(torch.float16), vmin.to(torch.float16)


def decode_value(q: torch.Tensor, scale16: torch.Tensor, zero16: torch.Tensor) -> torch.Tensor:
    return q.float() * scale16.float() + zero16.float()


def fp8_key(x: torch.Tensor) -> torch.Tensor:
    """K through the k8v4 FP8 store (no scale, round to nearest even, saturating), float32."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def roundtrip(x: torch.Tensor, *, role: str, params: dict, row, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The codec (kvtool.eval.codecs): K or V of one layer through the TurboQuant cache of `row`
    (key_bits / value_bits from kv_dtypes.json; params: norm_correction). Checkpoint scales play no part."""
    if role == "v":
        return decode_value(*encode_value(x, row.value_bits)).to(x.dtype)
    if role != "k":
        raise ValueError(f"{row.name}: no {role!r} role (TurboQuant stores K and V of standard attention)")
    if row.key_bits == 8:
        return fp8_key(x).to(x.dtype)
    need_power_of_two(row.name, x.shape[-1], role)
    idx, norm16, h = encode_key(x, row.key_bits)
    return (decode_key_rotated(idx, norm16, row.key_bits, bool(params["norm_correction"])) @ h).to(x.dtype)
