"""The RoPE type table: one entry per rope_type that transformers or vLLM know.

Each entry says which keys the type requires and accepts (shared by `kvtool lint`'s KV2xx rules
and by `kvtool rope`), which function of kvtool/model/rope/freqs.py computes its inverse frequencies and
attention scaling (numpy, loaded only when used; checked against transformers' ROPE_INIT_FUNCTIONS
by the tests), how vLLM derives the served
context from it, and which type-specific values are invalid. Aliases (`su`, `mrope`) map to the
entry the engines use for them.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Callable

from kvtool.registry import Registry
from kvtool.values import is_number as _num

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
    compute: Callable | None = None  # (params, Geometry, seq_len) -> (inv_freq array, attention scaling)
    validate: Callable[[dict, Geometry], list[Problem]] | None = None
    # How vLLM derives max_model_len (vllm 0.33, vllm/config/model.py, _get_and_verify_max_len):
    # "as_is" (max_position_embeddings as written: su, longrope, llama3, yarn, deepseek_yarn,
    # deepseek_llama_scaling) or "multiply" (max_position_embeddings x factor, every other type).
    context: str = "multiply"
    engines: tuple[str, ...] = ("transformers", "vllm")
    scaling: bool = True  # takes a `factor` and extends the context
    applicable: bool = False  # `kvtool rope --type` may write it
    whole_head: bool = False  # frequencies cover all head_dim dims (zeros past the rotary part)

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


def _math(name: str) -> Callable:
    """The numpy implementation in kvtool/model/rope/freqs.py, imported on first use: lint never loads numpy."""
    def call(params: dict, g: Geometry, seq_len: int | None = None):
        from kvtool.model.rope import freqs

        return getattr(freqs, name)(params, g, seq_len)
    call.__name__ = name
    return call


# --- type-specific validation ---------------------------------------------------------------------
def _check_factor(params: dict, g: Geometry) -> list[Problem]:
    f = params.get("factor")
    if f is None:
        return []
    if not _num(f):
        return [Problem("KV215", "factor", f"factor is {f!r}; it must be a number (vLLM multiplies max_model_len by it)")]
    if f < 1:
        return [Problem("KV204", "factor", f"factor is {f!r}; below 1 it shrinks the context instead of extending it")]
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


# Defects every command refuses (kvtool.model.numbers.rope_refusals), not only lint: transformers builds the
# model and then fails inside torch. longrope's factor lists divide the inverse frequencies element-wise
# (transformers modeling_rope_utils._compute_longrope_parameters: `1.0 / (ext_factors * base**inv_freq_shape)`;
# its _validate_longrope_parameters only logs a warning), so a wrong length is a shape error at the first
# forward pass, and vLLM's Phi3LongRoPEScaledRotaryEmbedding asserts the length (rotary_dim // 2).
REFUSED_CODES = ("KV207",)


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
    elif a is not None and params.get("factor") is None:
        out.append(Problem("KV216", "alpha", "dynamic with alpha and no factor is vLLM's NTK-alpha variant "
                           "(DynamicNTKAlphaRotaryEmbedding); transformers requires factor and refuses it"))
    return out


_YARN_OPTIONAL = frozenset({
    "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
    # read by vLLM's YaRN implementation
    "extrapolation_factor", "attn_factor", "apply_yarn_scaling",
}) | MROPE_KEYS

# rope_type -> RopeKind. A new type is one `register(RopeKind(...))` here (plus its math in freqs.py); with
# applicable=True, `kvtool rope --type` writes it from the generic parameters (factor, original, theta).
KINDS: Registry[RopeKind] = Registry("RoPE type", option="type")


def register(kind: RopeKind) -> RopeKind:
    """Make a RoPE type known to lint (KV2xx), `kvtool rope`, kv-budget's served context and the math."""
    return KINDS.add(kind.name, kind)


for _kind in (
    RopeKind("default", "plain RoPE: theta^(-2i/d)", optional=MROPE_KEYS, compute=_math("default"),
             context="as_is", scaling=False),
    RopeKind("linear", "position interpolation: every frequency divided by factor", ("factor",),
             compute=_math("linear"), validate=_check_factor, applicable=True),
    RopeKind("dynamic", "dynamic NTK: the base grows with the sequence length past max_position_embeddings",
             (("factor", "alpha"),), compute=_math("dynamic"), validate=_check_dynamic, applicable=True),
    RopeKind("yarn", "YaRN: high frequencies kept, low frequencies interpolated, attention rescaled",
             ("factor", "original_max_position_embeddings"), _YARN_OPTIONAL, compute=_math("yarn"), validate=_check_yarn,
             context="as_is", applicable=True),
    RopeKind("deepseek_yarn", "DeepSeek's YaRN (vLLM): truncated ramp, mscale / mscale_all_dim ratio",
             ("factor", "original_max_position_embeddings"),
             frozenset({"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attn_factor", "extrapolation_factor"}),
             compute=_math("deepseek_yarn"), validate=_check_yarn, context="as_is", engines=("vllm",)),
    RopeKind("deepseek_llama_scaling", "DeepSeek scaling class under another name (vLLM)",
             ("factor", "original_max_position_embeddings"),
             frozenset({"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attn_factor", "extrapolation_factor"}),
             compute=_math("deepseek_yarn"), validate=_check_yarn, context="as_is", engines=("vllm",)),
    RopeKind("longrope", "LongRoPE (Phi-3): per-dimension short / long rescale lists",
             ("short_factor", "long_factor", "original_max_position_embeddings"),
             frozenset({"factor", "attention_factor", "short_mscale", "long_mscale"}),
             compute=_math("longrope"), validate=_check_longrope, context="as_is", applicable=True),
    RopeKind("llama3", "Llama 3.1: low frequencies / factor, high kept, a smooth band between",
             ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
             compute=_math("llama3"), validate=_check_llama3, context="as_is", applicable=True),
    # vLLM serves it from 0.33 (its rotary_embedding get_rope); transformers 5 (rope_utils)
    RopeKind("proportional", "proportional RoPE (transformers, vLLM): rotary part spread over the full head_dim",
             (), frozenset({"factor"}), compute=_math("proportional"), validate=_check_factor, whole_head=True),
    RopeKind("ntk", "fixed NTK base stretch (vLLM), optionally mixed", ("factor",), frozenset({"mixed_b"}),
             compute=_math("ntk"), validate=_check_factor, engines=("vllm",)),
    RopeKind("axial", "axial 2-D RoPE for vision towers (transformers)", engines=("transformers",),
             context="as_is", scaling=False),
    RopeKind("bailing_mrope", "Bailing multimodal RoPE sections (vLLM)", ("mrope_section",), engines=("vllm",),
             scaling=False),
    RopeKind("openpangu", "openPangu interleaved multimodal RoPE (vLLM)", ("mrope_section",),
             frozenset({"mrope_interleaved"}), engines=("vllm",), scaling=False),
    RopeKind("mllama4", "Llama 4 vision-tower RoPE (vLLM)", engines=("vllm",), context="as_is", scaling=False),
):
    register(_kind)
del _kind

# Legacy names: what transformers / vLLM turn them into.
ALIASES = {"su": "longrope", "mrope": "default"}
# Aliases only vLLM rewrites (vllm/transformers_utils/config.py, patch_legacy_rope_type): transformers'
# ROPE_INIT_FUNCTIONS has no "su", and only config classes whose table lists it in
# attention.rope_rewrites (Phi3Config) rename it.
VLLM_ONLY_ALIASES = frozenset({"su"})
# `type` / `rope_type` pairs that differ in spelling but mean the same (vLLM accepts them together).
COMPATIBLE_PAIRS = {("su", "longrope"), ("longrope", "su"), ("mrope", "default"), ("default", "mrope")}


def canonical(name: str) -> str:
    return ALIASES.get(name, name)


def kind_of(name: str) -> RopeKind | None:
    return KINDS.get(canonical(name), None)


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


def compute(params: dict, g: Geometry, seq_len: int | None = None) -> tuple:
    """(inverse frequencies, attention scaling) for one rope dict; raises ValueError if kvtool has no math."""
    name = params.get("rope_type", params.get("type", "default"))
    kind = kind_of(name)
    if kind is None or kind.compute is None:
        raise ValueError(f"kvtool cannot compute frequencies for RoPE type {name!r}")
    return kind.compute(params, g, seq_len)


# vLLM skips the factor for these model types ("gemma3" in model_type): their
# max_position_embeddings is already the scaled length (vllm/config/model.py).
VLLM_UNSCALED_MODEL_TYPES = ("gemma3",)


def served_context(params: dict, max_position_embeddings: int | None, model_type: str | None = None, *,
                   yarn_from_original: bool = False) -> int | None:
    """The max_model_len vLLM derives from this rope dict, or None when vLLM refuses the dict.

    vllm 0.33, vllm/config/model.py, _get_and_verify_max_len: types whose max_position_embeddings
    is already the extended length (kind.context "as_is") keep it; every other type multiplies it by
    `factor` (1.0 when absent or null). vllm/model_executor/layers/rotary_embedding/__init__.py,
    get_rope, raises for an unknown type ("Unknown RoPE scaling type") and indexes each type's
    required keys (rope_parameters["factor"]): a KeyError at load, so nothing is served.
    `yarn_from_original`: the older arithmetic (the engine fact "vllm-yarn-max-len-from-original",
    schemas/engines/facts.json): only su / longrope / llama3 keep max_position_embeddings, yarn serves
    original_max_position_embeddings x factor, every other type max_position_embeddings x factor.
    """
    if max_position_embeddings is None:
        return None
    kind = kind_of(params.get("rope_type", params.get("type", "default")) or "default")
    if kind is None or "vllm" not in kind.engines or kind.missing(params):
        return None
    f = params.get("factor")
    f = float(f) if _num(f) else 1.0
    if any(m in (model_type or "") for m in VLLM_UNSCALED_MODEL_TYPES):
        return max_position_embeddings
    if yarn_from_original:
        if kind.name in ("longrope", "llama3"):
            return max_position_embeddings
        orig = params.get("original_max_position_embeddings")
        if kind.name == "yarn" and isinstance(orig, int) and not isinstance(orig, bool) and orig > 0:
            return _scaled(orig, f)
        return _scaled(max_position_embeddings, f)
    if kind.context == "as_is":
        return max_position_embeddings
    return _scaled(max_position_embeddings, f)


def _scaled(length: int, factor: float) -> int | None:
    """int(length * factor) as vLLM computes it, None where vLLM cannot: a product past float's range is
    inf, and int(inf) raises OverflowError in _get_and_verify_max_len (vllm 0.33 vllm/config/model.py), so
    vLLM serves nothing (yarn factor 1e308)."""
    value = length * factor
    return int(value) if math.isfinite(value) else None


def vllm_refusal(params: dict) -> str | None:
    """Why vLLM's get_rope refuses this rope dict (None when it accepts it)."""
    name = params.get("rope_type", params.get("type", "default")) or "default"
    kind = kind_of(name) if isinstance(name, str) else None
    if kind is None or "vllm" not in kind.engines:
        return f"Unknown RoPE scaling type {name!r}"
    missing = kind.missing(params)
    if missing:
        return f"rope type {kind.name!r} requires {', '.join(repr(m) for m in missing)} (KeyError in get_rope)"
    return None
