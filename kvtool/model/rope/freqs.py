"""Inverse frequencies and attention scaling per RoPE type (numpy; no torch).

One function per entry of kvtool/model/rope/types.py, each `(params, geometry, seq_len) -> (inv_freq,
attention_scaling)`, written from the formulas of transformers' modeling_rope_utils.py and vLLM's
rotary embeddings; tests/rope/test_rope_types.py compares them with transformers' own functions.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvtool.model.rope.types import Geometry


def base_inv_freq(theta: float, dim: int) -> np.ndarray:
    return 1.0 / (float(theta) ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _factor(params: dict, g: Geometry) -> float:
    f = params.get("factor")
    if f is None and g.max_position_embeddings and params.get("original_max_position_embeddings"):
        # yarn / longrope without an explicit factor: the ratio of the two lengths (transformers)
        return g.max_position_embeddings / params["original_max_position_embeddings"]
    return float(f if f is not None else 1.0)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def default(params: dict, g: Geometry, seq_len: int | None = None):
    return base_inv_freq(g.theta, g.dim), 1.0


def linear(params: dict, g: Geometry, seq_len: int | None = None):
    return base_inv_freq(g.theta, g.dim) / _factor(params, g), 1.0


def dynamic(params: dict, g: Geometry, seq_len: int | None = None):
    alpha = params.get("alpha")
    if alpha is not None and params.get("factor") is None:
        # vLLM's NTK-alpha variant (Hunyuan): a fixed base stretch
        return base_inv_freq(g.theta * float(alpha) ** (g.dim / (g.dim - 2)), g.dim), 1.0
    factor = _factor(params, g)
    mpe = g.max_position_embeddings or 1
    seq = max(seq_len or mpe, mpe)
    base = g.theta * ((factor * seq / mpe) - (factor - 1)) ** (g.dim / (g.dim - 2))
    return base_inv_freq(base, g.dim), 1.0


def ntk(params: dict, g: Geometry, seq_len: int | None = None):
    factor = _factor(params, g)
    mixed_b = params.get("mixed_b")
    if mixed_b is None:
        return base_inv_freq(g.theta * factor, g.dim) / factor ** (2 / g.dim), 1.0
    a = math.log(factor) / (g.dim / 2) ** mixed_b
    lam = np.exp(a * np.arange(1, g.dim // 2 + 1, dtype=np.float64) ** mixed_b)
    return base_inv_freq(g.theta, g.dim) / lam, 1.0


def yarn_attention_factor(params: dict, factor: float) -> float:
    af = params.get("attention_factor")
    if af is not None:
        return float(af)
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
    return yarn_get_mscale(factor)


def yarn_correction_range(params: dict, g: Geometry) -> tuple[float, float]:
    """Dimensions below `low` keep their frequency; above `high` are interpolated by the factor."""
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    orig = params["original_max_position_embeddings"]

    def corr(rot):
        return (g.dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(g.theta))

    low, high = corr(beta_fast), corr(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, g.dim - 1)


def yarn(params: dict, g: Geometry, seq_len: int | None = None):
    factor = _factor(params, g)
    pos = float(g.theta) ** (np.arange(0, g.dim, 2, dtype=np.float64) / g.dim)
    extra, inter = 1.0 / pos, 1.0 / (factor * pos)
    low, high = yarn_correction_range(params, g)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(g.dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inter * (1 - keep) + extra * keep, yarn_attention_factor(params, factor)


def deepseek_yarn(params: dict, g: Geometry, seq_len: int | None = None):
    # vLLM's DeepseekScalingRotaryEmbedding: yarn with truncated ramp bounds and the mscale ratio
    p = dict(params, truncate=True)
    inv, _ = yarn(p, g)
    factor = _factor(params, g)
    m = yarn_get_mscale(factor, float(params.get("mscale", 1) or 0)) / yarn_get_mscale(
        factor, float(params.get("mscale_all_dim", 0) or 0))
    return inv, m * float(params.get("attn_factor", 1.0))


def longrope(params: dict, g: Geometry, seq_len: int | None = None):
    orig = params["original_max_position_embeddings"]
    factor = _factor(params, g)
    af = params.get("attention_factor")
    if af is None:
        af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = params["long_factor"] if seq_len and seq_len > orig else params["short_factor"]
    shape = np.arange(0, g.dim, 2, dtype=np.float64) / g.dim
    return 1.0 / (np.asarray(ext, dtype=np.float64) * float(g.theta) ** shape), float(af)


def llama3(params: dict, g: Geometry, seq_len: int | None = None):
    inv = base_inv_freq(g.theta, g.dim)
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    orig = params["original_max_position_embeddings"]
    low_wl, high_wl = orig / low, orig / high
    wl = 2 * math.pi / inv
    scaled = np.where(wl > low_wl, inv / factor, inv)
    with np.errstate(divide="ignore", invalid="ignore"):  # equal factors: empty band, values unused
        smooth = (orig / wl - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wl < high_wl) & ~(wl > low_wl)
    return np.where(medium, smoothed, scaled), 1.0


def proportional(params: dict, g: Geometry, seq_len: int | None = None):
    hd = g.head_dim or g.dim
    prop = float(params.get("partial_rotary_factor", 1.0) or 1.0)
    angles = int(prop * hd // 2)
    rot = 1.0 / (float(g.theta) ** (np.arange(0, 2 * angles, 2, dtype=np.float64) / hd))
    inv = np.concatenate([rot, np.zeros(hd // 2 - angles)]) if hd // 2 > angles else rot
    return inv / float(params.get("factor", 1.0) or 1.0), 1.0


def wavelengths(inv_freq: np.ndarray) -> np.ndarray:
    """Tokens per full rotation of each frequency pair (inf for a non-rotating pair)."""
    with np.errstate(divide="ignore"):
        return np.where(inv_freq > 0, 2 * math.pi / np.where(inv_freq > 0, inv_freq, 1), np.inf)
