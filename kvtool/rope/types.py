"""The RoPE type table: one entry per rope_type that transformers or vLLM know.

Each entry says which keys the type requires and accepts (shared by `kvtool lint`'s KV2xx rules
and by `kvtool rope`), how to compute its inverse frequencies and attention scaling (pure numpy,
checked against transformers' ROPE_INIT_FUNCTIONS by the tests), how vLLM derives the served
context from it, and which type-specific values are invalid. Aliases (`su`, `mrope`) map to the
entry the engines use for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

# Keys any rope dict may carry whatever its type (transformers v5 moves these into rope_parameters).
COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
# Multimodal RoPE sections: vLLM reads them on default and yarn (Qwen2/2.5/3-VL, Qwen3.5).
MROPE_KEYS = frozenset({"mrope_section", "mrope_interleaved"})


@dataclass(frozen=True)
class Geometry:
    """What the math needs besides the rope dict."""

    dim: int  # rotary dimension (head_dim x partial_rotary_factor)
    theta: float
    max_position_embeddings: int | None = None
    head_dim: int | None = None  # full head size (proportional RoPE spreads over it)


@dataclass(frozen=True)
class Problem:
    """A type-specific defect: the rule code it maps to, the key, and a message."""

    code: str
    key: str
    message: str


@dataclass(frozen=True)
class RopeKind:
    name: str
    summary: str
    required: tuple = ()  # each item a key, or a tuple of keys of which one must be present
    optional: frozenset = frozenset()
    compute: Callable[[dict, Geometry, int | None], tuple[np.ndarray, float]] | None = None
    validate: Callable[[dict, Geometry], list[Problem]] | None = None
    # How vLLM derives max_model_len: "as_is" (max_position_embeddings), "multiply" (max x factor),
    # "original" (original_max_position_embeddings x factor).
    context: str = "multiply"
    engines: tuple[str, ...] = ("transformers", "vllm")
    scaling: bool = True  # takes a `factor` and extends the context
    applicable: bool = False  # `kvtool rope --type` may write it

    def allowed_keys(self) -> frozenset:
        req: set[str] = set()
        for r in self.required:
            req.update(r if isinstance(r, tuple) else (r,))
        return COMMON_KEYS | req | self.optional

    def missing(self, params: dict) -> list[str]:
        """Required keys absent (None counts as absent); a one-of group is named `a|b`."""
        out = []
        for r in self.required:
            names = r if isinstance(r, tuple) else (r,)
            if not any(params.get(n) is not None for n in names):
                out.append("|".join(names))
        return out

    def unknown(self, params: dict) -> list[str]:
        allowed = self.allowed_keys()
        return sorted(k for k in params if k not in allowed)


# --- shared math --------------------------------------------------------------------------------
def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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


def _default(params: dict, g: Geometry, seq_len: int | None = None):
    return base_inv_freq(g.theta, g.dim), 1.0


def _linear(params: dict, g: Geometry, seq_len: int | None = None):
    return base_inv_freq(g.theta, g.dim) / _factor(params, g), 1.0


def _dynamic(params: dict, g: Geometry, seq_len: int | None = None):
    alpha = params.get("alpha")
    if alpha is not None and params.get("factor") is None:
        # vLLM's NTK-alpha variant (Hunyuan): a fixed base stretch
        return base_inv_freq(g.theta * float(alpha) ** (g.dim / (g.dim - 2)), g.dim), 1.0
    factor = _factor(params, g)
    mpe = g.max_position_embeddings or 1
    seq = max(seq_len or mpe, mpe)
    base = g.theta * ((factor * seq / mpe) - (factor - 1)) ** (g.dim / (g.dim - 2))
    return base_inv_freq(base, g.dim), 1.0


def _ntk(params: dict, g: Geometry, seq_len: int | None = None):
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


def _yarn(params: dict, g: Geometry, seq_len: int | None = None):
    factor = _factor(params, g)
    pos = float(g.theta) ** (np.arange(0, g.dim, 2, dtype=np.float64) / g.dim)
    extra, inter = 1.0 / pos, 1.0 / (factor * pos)
    low, high = yarn_correction_range(params, g)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(g.dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inter * (1 - keep) + extra * keep, yarn_attention_factor(params, factor)


def _deepseek_yarn(params: dict, g: Geometry, seq_len: int | None = None):
    # vLLM's DeepseekScalingRotaryEmbedding: yarn with truncated ramp bounds and the mscale ratio
    p = dict(params, truncate=True)
    inv, _ = _yarn(p, g)
    factor = _factor(params, g)
    m = yarn_get_mscale(factor, float(params.get("mscale", 1) or 0)) / yarn_get_mscale(
        factor, float(params.get("mscale_all_dim", 0) or 0))
    return inv, m * float(params.get("attn_factor", 1.0))


def _longrope(params: dict, g: Geometry, seq_len: int | None = None):
    orig = params["original_max_position_embeddings"]
    factor = _factor(params, g)
    af = params.get("attention_factor")
    if af is None:
        af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = params["long_factor"] if seq_len and seq_len > orig else params["short_factor"]
    shape = np.arange(0, g.dim, 2, dtype=np.float64) / g.dim
    return 1.0 / (np.asarray(ext, dtype=np.float64) * float(g.theta) ** shape), float(af)


def _llama3(params: dict, g: Geometry, seq_len: int | None = None):
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


def _proportional(params: dict, g: Geometry, seq_len: int | None = None):
    hd = g.head_dim or g.dim
    prop = float(params.get("partial_rotary_factor", 1.0) or 1.0)
    angles = int(prop * hd // 2)
    rot = 1.0 / (float(g.theta) ** (np.arange(0, 2 * angles, 2, dtype=np.float64) / hd))
    inv = np.concatenate([rot, np.zeros(hd // 2 - angles)]) if hd // 2 > angles else rot
    return inv / float(params.get("factor", 1.0) or 1.0), 1.0


# --- type-specific validation ---------------------------------------------------------------------
def _check_factor(params: dict, g: Geometry) -> list[Problem]:
    f = params.get("factor")
    if f is None:
        return []
    if not _num(f) or f < 1:
        return [Problem("KV204", "factor", f"factor is {f!r}; it must be a number >= 1 (below 1 shrinks the context)")]
    return []


def _check_original(params: dict, g: Geometry) -> list[Problem]:
    o = params.get("original_max_position_embeddings")
    if o is None:
        return []
    if isinstance(o, bool) or not isinstance(o, int) or o <= 0:
        return [Problem("KV215", "original_max_position_embeddings",
                        f"original_max_position_embeddings is {o!r}; it must be a positive integer")]
    return []


def _check_attention_factor(params: dict, g: Geometry) -> list[Problem]:
    out = []
    for key in ("attention_factor", "attn_factor", "mscale", "mscale_all_dim", "short_mscale", "long_mscale"):
        v = params.get(key)
        if v is not None and (not _num(v) or v < 0):
            out.append(Problem("KV215", key, f"{key} is {v!r}; it must be a number >= 0"))
    return out


def _check_scaled(params: dict, g: Geometry) -> list[Problem]:
    return _check_factor(params, g) + _check_original(params, g) + _check_attention_factor(params, g)


def _check_yarn(params: dict, g: Geometry) -> list[Problem]:
    out = _check_scaled(params, g)
    bf, bs = params.get("beta_fast"), params.get("beta_slow")
    for key, v in (("beta_fast", bf), ("beta_slow", bs)):
        if v is not None and not _num(v):
            out.append(Problem("KV215", key, f"{key} is {v!r}; it must be a number"))
    if (bf is None or _num(bf)) and (bs is None or _num(bs)) and (bf or 32) < (bs or 1):
        out.append(Problem("KV215", "beta_fast",
                           f"beta_fast ({bf or 32}) is below beta_slow ({bs or 1}): the interpolation ramp runs backwards"))
    t = params.get("truncate")
    if t is not None and not isinstance(t, bool):
        out.append(Problem("KV215", "truncate", f"truncate is {t!r}; it must be true or false"))
    return out


def _check_longrope(params: dict, g: Geometry) -> list[Problem]:
    out = _check_scaled(params, g)
    want = g.dim // 2 if g.dim else None
    for key in ("short_factor", "long_factor"):
        v = params.get(key)
        if v is None:
            continue
        if not (isinstance(v, list) and all(_num(x) and x > 0 for x in v)):
            out.append(Problem("KV207", key, f"{key} must be a list of positive numbers"))
        elif want is not None and len(v) != want:
            out.append(Problem("KV207", key, f"{key} has {len(v)} entries; rotary_dim {g.dim} needs {want} (rotary_dim / 2)"))
    return out


def _check_llama3(params: dict, g: Geometry) -> list[Problem]:
    out = _check_scaled(params, g)
    lo, hi = params.get("low_freq_factor"), params.get("high_freq_factor")
    for key, v in (("low_freq_factor", lo), ("high_freq_factor", hi)):
        if v is not None and (not _num(v) or v <= 0):
            out.append(Problem("KV215", key, f"{key} is {v!r}; it must be a positive number"))
    # Equal factors are a hard cut-off with no smoothing band (Llama 4 ships 1.0 / 1.0); reversed ones
    # are swapped values: the band the model was tuned with disappears.
    if _num(lo) and _num(hi) and hi < lo:
        out.append(Problem("KV208", "high_freq_factor",
                           f"high_freq_factor ({hi}) is below low_freq_factor ({lo}): the values look swapped"))
    return out


def _check_dynamic(params: dict, g: Geometry) -> list[Problem]:
    out = _check_factor(params, g)
    a = params.get("alpha")
    if a is not None and (not _num(a) or a < 1):
        out.append(Problem("KV215", "alpha", f"alpha is {a!r}; it must be a number >= 1"))
    return out


_YARN_OPTIONAL = frozenset({
    "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
    # read by vLLM's YaRN implementation
    "extrapolation_factor", "attn_factor", "apply_yarn_scaling",
}) | MROPE_KEYS

KINDS: dict[str, RopeKind] = {k.name: k for k in (
    RopeKind("default", "plain RoPE: theta^(-2i/d)", optional=MROPE_KEYS, compute=_default,
             context="as_is", scaling=False),
    RopeKind("linear", "position interpolation: every frequency divided by factor", ("factor",),
             compute=_linear, validate=_check_factor, applicable=True),
    RopeKind("dynamic", "dynamic NTK: the base grows with the sequence length past max_position_embeddings",
             (("factor", "alpha"),), compute=_dynamic, validate=_check_dynamic, applicable=True),
    RopeKind("yarn", "YaRN: high frequencies kept, low frequencies interpolated, attention rescaled",
             ("factor", "original_max_position_embeddings"), _YARN_OPTIONAL, compute=_yarn, validate=_check_yarn,
             context="original", applicable=True),
    RopeKind("deepseek_yarn", "DeepSeek's YaRN (vLLM): truncated ramp, mscale / mscale_all_dim ratio",
             ("factor", "original_max_position_embeddings"),
             frozenset({"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attn_factor", "extrapolation_factor"}),
             compute=_deepseek_yarn, validate=_check_yarn, engines=("vllm",)),
    RopeKind("deepseek_llama_scaling", "DeepSeek scaling class under another name (vLLM)",
             ("factor", "original_max_position_embeddings"),
             frozenset({"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attn_factor", "extrapolation_factor"}),
             compute=_deepseek_yarn, validate=_check_yarn, engines=("vllm",)),
    RopeKind("longrope", "LongRoPE (Phi-3): per-dimension short / long rescale lists",
             ("short_factor", "long_factor", "original_max_position_embeddings"),
             frozenset({"factor", "attention_factor", "short_mscale", "long_mscale"}),
             compute=_longrope, validate=_check_longrope, context="as_is", applicable=True),
    RopeKind("llama3", "Llama 3.1: low frequencies / factor, high kept, a smooth band between",
             ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
             compute=_llama3, validate=_check_llama3, context="as_is", applicable=True),
    RopeKind("proportional", "proportional RoPE (transformers): rotary part spread over the full head_dim",
             (), frozenset({"factor"}), compute=_proportional, validate=_check_factor, engines=("transformers",)),
    RopeKind("ntk", "fixed NTK base stretch (vLLM), optionally mixed", ("factor",), frozenset({"mixed_b"}),
             compute=_ntk, validate=_check_factor, engines=("vllm",)),
    RopeKind("axial", "axial 2-D RoPE for vision towers (transformers)", engines=("transformers",),
             context="as_is", scaling=False),
    RopeKind("xdrope", "XD-RoPE sections with an NTK alpha (vLLM, Hunyuan-VL)", ("alpha", "xdrope_section"),
             engines=("vllm",), context="as_is", scaling=False),
    RopeKind("mllama4", "Llama 4 vision-tower RoPE (vLLM)", engines=("vllm",), context="as_is", scaling=False),
)}

# Legacy names: what transformers / vLLM turn them into.
ALIASES = {"su": "longrope", "mrope": "default"}
# `type` / `rope_type` pairs that differ in spelling but mean the same (vLLM accepts them together).
COMPATIBLE_PAIRS = {("su", "longrope"), ("longrope", "su"), ("mrope", "default"), ("default", "mrope")}


def canonical(name: str) -> str:
    return ALIASES.get(name, name)


def kind_of(name: str) -> RopeKind | None:
    return KINDS.get(canonical(name))


def applicable_types() -> list[str]:
    return [k.name for k in KINDS.values() if k.applicable]


def validate(params: dict, g: Geometry) -> list[Problem]:
    """Every defect of one rope dict: missing keys, then the type's own checks. Unknown types: one problem."""
    name = params.get("rope_type", params.get("type", "default"))
    kind = kind_of(name) if isinstance(name, str) else None
    if kind is None:
        known = ", ".join(sorted(set(KINDS) | set(ALIASES)))
        return [Problem("KV201", "rope_type", f"unknown RoPE type {name!r}; transformers and vLLM know: {known}")]
    out = [Problem("KV202", m, f"rope type {kind.name!r} requires {m!r}") for m in kind.missing(params)]
    if kind.validate is not None:
        out += kind.validate(params, g)
    return out


def compute(params: dict, g: Geometry, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """(inverse frequencies, attention scaling) for one rope dict; raises ValueError if kvtool has no math."""
    name = params.get("rope_type", params.get("type", "default"))
    kind = kind_of(name)
    if kind is None or kind.compute is None:
        raise ValueError(f"kvtool cannot compute frequencies for RoPE type {name!r}")
    return kind.compute(params, g, seq_len)


# vLLM skips the factor for these model types ("gemma3" in model_type): their
# max_position_embeddings is already the scaled length (vllm/config/model.py).
VLLM_UNSCALED_MODEL_TYPES = ("gemma3",)


def served_context(params: dict, max_position_embeddings: int | None, model_type: str | None = None) -> int | None:
    """The max_model_len vLLM derives from this rope dict (vllm/config/model.py)."""
    kind = kind_of(params.get("rope_type", params.get("type", "default")) or "default")
    if max_position_embeddings is None:
        return None
    if any(m in (model_type or "") for m in VLLM_UNSCALED_MODEL_TYPES):
        return max_position_embeddings
    if kind is None or kind.context == "as_is":
        return max_position_embeddings
    f = params.get("factor")
    f = float(f) if _num(f) else 1.0
    if kind.context == "original" and _num(params.get("original_max_position_embeddings")):
        return int(params["original_max_position_embeddings"] * f)
    return int(max_position_embeddings * f)


def wavelengths(inv_freq: np.ndarray) -> np.ndarray:
    """Tokens per full rotation of each frequency pair (inf for a non-rotating pair)."""
    with np.errstate(divide="ignore"):
        return np.where(inv_freq > 0, 2 * math.pi / np.where(inv_freq > 0, inv_freq, 1), np.inf)

