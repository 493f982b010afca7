"""Bounds for every numeric config value a rule or a computation uses, checked once per spec.

`build_spec` runs `invalid_numbers` before deriving layer types or RoPE, and the spec's accessors
return None for a value listed there, so no rule or formula ever multiplies a NaN, loops 10^9
times or formats a 5000-digit integer. lint reports each entry as KV906 (unless a more specific rule
names the same key); kv-budget, convert, rope and quantize-kv refuse the config (exit 2) through
`require_valid_numbers`.

The bounds are not "plausible" values: they are the widest a real model could use, far beyond
every public config (docs/input-limits.md has the table with the largest value seen for each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtool.errors import InputError

_K = 1 << 10
_M = 1 << 20


@dataclass(frozen=True)
class Bound:
    kind: str  # "int" (not bool, not 2.5) or "number" (finite int or float, not bool)
    low: float
    high: float
    reason: str
    low_open: bool = False  # low itself is not allowed (theta > 0)
    listable: bool = False  # a value or a list of them (eos_token_id, longrope short_factor)


def _count(high: int, reason: str, low: int = 1) -> Bound:
    return Bound("int", low, high, reason)


# Spec quantities (kvtool/spec.py names; the config keys come from the architecture tables).
QUANTITY_BOUNDS: dict[str, Bound] = {
    "num_layers": _count(100_000, "per-layer tables and loops; public models have <= 128"),
    "num_heads": _count(64 * _K, "per-head loops in convert; public models have <= 128"),
    "num_kv_heads": _count(64 * _K, "per-head loops in convert; public models have <= 128"),
    "head_dim": _count(64 * _K, "per-dimension RoPE tables; public models have <= 576"),
    "rotary_dim": _count(64 * _K, "per-dimension RoPE tables"),
    "hidden_size": _count(_M, "weight shapes; public models have <= 25,600"),
    "intermediate_size": _count(16 * _M, "weight shapes; public models have <= 73,728"),
    "moe_intermediate_size": _count(16 * _M, "weight shapes"),
    "vocab_size": _count(64 * _M, "embedding rows; public models have <= 262,144"),
    "max_position": _count(1 << 40, "context length in tokens; public models have <= 10,485,760"),
    "sliding_window": _count(1 << 40, "window in tokens, never above the context"),
    "attention_chunk_size": _count(1 << 40, "chunk in tokens"),
    "max_window_layers": _count(100_000, "a layer index", low=0),
    "kv_lora_rank": _count(64 * _K, "MLA latent width; public models have 512"),
    "q_lora_rank": _count(64 * _K, "MLA query latent width"),
    "qk_rope_head_dim": _count(64 * _K, "MLA RoPE dimension; public models have 64"),
    "qk_nope_head_dim": _count(64 * _K, "MLA non-RoPE dimension"),
    "v_head_dim": _count(64 * _K, "MLA value dimension"),
    "num_experts": _count(_M, "expert tables; 0 in dense configs; public models have <= 512", low=0),
    "experts_per_token": _count(_M, "experts routed per token; 0 in dense configs", low=0),
    "num_shared_experts": _count(_M, "shared experts", low=0),
    "first_k_dense": _count(100_000, "a layer count", low=0),
    "rope_theta": Bound("number", 0, 1e18, "the RoPE base; theta ** (2i/d) must stay finite", low_open=True),
    "sliding_rope_theta": Bound("number", 0, 1e18, "the local RoPE base", low_open=True),
    "partial_rotary_factor": Bound("number", 0, 1, "a fraction of head_dim", low_open=True),
    "bos_token_id": Bound("int", -(1 << 31), 1 << 31, "a token id", listable=True),
    "eos_token_id": Bound("int", -(1 << 31), 1 << 31, "a token id", listable=True),
    "pad_token_id": Bound("int", -(1 << 31), 1 << 31, "a token id", listable=True),
}

# Quantities that hold the RoPE settings: when set (not null) they must be JSON objects.
OBJECT_QUANTITIES = ("rope_scaling", "rope_parameters")

# Keys inside a rope_scaling / rope_parameters dict (whatever the rope_type).
ROPE_PARAM_BOUNDS: dict[str, Bound] = {
    "rope_theta": QUANTITY_BOUNDS["rope_theta"],
    "factor": Bound("number", 0, 1e6, "context scaling; public models use <= 64", low_open=True),
    "original_max_position_embeddings": _count(1 << 40, "context length in tokens"),
    "partial_rotary_factor": QUANTITY_BOUNDS["partial_rotary_factor"],
    "beta_fast": Bound("number", -1e6, 1e6, "yarn rotation bound"),
    "beta_slow": Bound("number", -1e6, 1e6, "yarn rotation bound"),
    "attention_factor": Bound("number", 0, 1e6, "attention scaling"),
    "attn_factor": Bound("number", 0, 1e6, "attention scaling"),
    "mscale": Bound("number", 0, 1e6, "attention scaling"),
    "mscale_all_dim": Bound("number", 0, 1e6, "attention scaling"),
    "short_mscale": Bound("number", 0, 1e6, "attention scaling"),
    "long_mscale": Bound("number", 0, 1e6, "attention scaling"),
    "low_freq_factor": Bound("number", 0, 1e6, "llama3 wavelength bound", low_open=True),
    "high_freq_factor": Bound("number", 0, 1e6, "llama3 wavelength bound", low_open=True),
}
# Values only lint reads (KV504 compares them with the vocabulary): commands do not refuse them.
LINT_ONLY = frozenset({"bos_token_id", "eos_token_id", "pad_token_id"})
ROPE_FACTOR_LISTS = ("short_factor", "long_factor")  # longrope: lists of finite numbers > 0
FACTOR_LIST_BOUND = Bound("number", 0, 1e6, "longrope per-dimension factor", low_open=True, listable=True)


@dataclass(frozen=True)
class BadNumber:
    key: str  # dotted config key (with the wrapper prefix)
    got: str  # the value as shown to the user
    need: str  # what the bound allows, and why

    @property
    def message(self) -> str:
        """For lint findings, which carry the key in the message."""
        return f"{self.key} is {self.got}; it must be {self.need}"


def show(v: Any) -> str:
    """A value as the user wrote it, short, and never str() of a huge int (Python refuses past 4300 digits)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, int):
        digits = len(str(abs(v))) if abs(v) < 10 ** 60 else None
        return str(v) if digits is not None else f"an integer of {v.bit_length()} bits"
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "Infinity" if v > 0 else "-Infinity"
        return repr(v)
    if isinstance(v, str):
        return repr(v if len(v) <= 40 else v[:37] + "...")
    return f"a {_json_kind(v)}"


def _json_kind(v: Any) -> str:
    return {dict: "JSON object", list: "JSON array"}.get(type(v), type(v).__name__)


def _expected(b: Bound) -> str:
    what = "an integer" if b.kind == "int" else "a finite number"
    low = f"> {_num(b.low)}" if b.low_open else f">= {_num(b.low)}"
    return f"{what} {low} and <= {_num(b.high)}"


def _num(x: float) -> str:
    if isinstance(x, float) and x >= 1e6:
        return f"{x:g}"
    if isinstance(x, int) and x >= 1 << 20 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def problem(v: Any, b: Bound) -> tuple[str, str] | None:
    """(the value shown, what is allowed and why) when v breaks the bound, else None."""
    if b.listable and isinstance(v, list):
        for i, item in enumerate(v):
            bad = problem(item, Bound(b.kind, b.low, b.high, b.reason, b.low_open))
            if bad:
                return f"{bad[0]} at item {i}", bad[1]
        return None
    ok_type = (isinstance(v, int) if b.kind == "int" else isinstance(v, (int, float))) and not isinstance(v, bool)
    if (not ok_type or (isinstance(v, float) and not math.isfinite(v))
            or v < b.low or (b.low_open and v == b.low) or v > b.high):
        return show(v), f"{_expected(b)} ({b.reason})"
    return None


def invalid_quantities(spec) -> dict[str, BadNumber]:
    """Spec quantity name -> problem, for the values the config actually sets (null and missing are skipped)."""
    out: dict[str, BadNumber] = {}
    for name, b in QUANTITY_BOUNDS.items():
        r = spec.values.get(name)
        if r is None or r.value is None or r.key is None:  # absent, or a table constant / default
            continue
        bad = problem(r.value, b)
        if bad:
            out[name] = BadNumber(spec.prefixed(r.key), *bad)
    for name in OBJECT_QUANTITIES:
        r = spec.values.get(name)
        if r is not None and r.key is not None and r.value is not None and not isinstance(r.value, dict):
            out[name] = BadNumber(spec.prefixed(r.key), show(r.value), "a JSON object (the RoPE settings) or null")
    return out


def invalid_rope(spec) -> dict[str, BadNumber]:
    """'rope:<layer type>:<key>' -> problem, for numeric keys of every resolved RoPE dict."""
    out: dict[str, BadNumber] = {}
    for lt, rp in spec.rope.items():
        for k, v in rp.params.items():
            if v is None:
                continue
            if k in ROPE_PARAM_BOUNDS:
                bad = problem(v, ROPE_PARAM_BOUNDS[k])
            elif k in ROPE_FACTOR_LISTS and isinstance(v, list):
                bad = problem(v, FACTOR_LIST_BOUND)
            else:
                continue
            if bad:
                out[f"rope:{lt}:{k}"] = BadNumber(f"{rp.path}.{k}", *bad)
        if rp.source == "rope_parameters" and rp.theta is not None and "rope_theta" not in spec.invalid:
            bad = problem(rp.theta, ROPE_PARAM_BOUNDS["rope_theta"])
            if bad:
                out[f"rope:{lt}:rope_theta"] = BadNumber(f"{rp.path}.rope_theta", *bad)
    return out


def require_valid_numbers(spec, file: str) -> None:
    """Refuse (InputError, exit 2) a config with any value outside its bound: commands compute with them."""
    for name, bad in spec.invalid.items():
        if name in LINT_ONLY:
            continue
        raise InputError(f"got {bad.got}; it must be {bad.need}", file=file, field=bad.key)
