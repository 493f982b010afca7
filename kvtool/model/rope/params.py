"""Read RoPE settings from either config generation into one shape.

Legacy (transformers 4.x): `rope_theta` + `rope_scaling` ({"type" | "rope_type": ..., ...}).
v5: `rope_parameters`, flat ({"rope_type", "rope_theta", ...}) or nested per layer type
({"full_attention": {...}, "sliding_attention": {...}}).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.model.layer_types import KNOWN_TYPES

TYPE_KEYS = ("rope_type", "type")


@dataclass
class RopeParams:
    """RoPE settings for one layer type, whichever config generation they came from."""

    rope_type: str
    theta: float | None
    params: dict  # everything else (factor, original_max_position_embeddings, ...)
    source: str  # "rope_scaling" | "rope_parameters" | "default"
    path: str  # dotted config path of the dict, for findings


def rope_type_of(d: dict) -> str:
    t = d.get("rope_type", d.get("type"))
    return t if isinstance(t, str) and t else "default"


def _params(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("rope_type", "type", "rope_theta")}


def is_nested(rp: dict) -> bool:
    return isinstance(rp, dict) and bool(rp) and all(k in KNOWN_TYPES and isinstance(v, dict) for k, v in rp.items())


def resolve_rope(spec) -> dict[str, RopeParams]:
    if spec.position != "rope":
        return {}
    theta = spec.get("rope_theta")
    rp = spec.get("rope_parameters")
    out: dict[str, RopeParams] = {}
    base = spec.key("rope_parameters") or "rope_parameters"
    if isinstance(rp, dict) and rp:
        if is_nested(rp):
            for lt, d in rp.items():
                out[lt] = RopeParams(rope_type_of(d), d.get("rope_theta", theta), _params(d), "rope_parameters", f"{base}.{lt}")
        else:
            out["default"] = RopeParams(rope_type_of(rp), rp.get("rope_theta", theta), _params(rp), "rope_parameters", base)
        return out
    rs = spec.get("rope_scaling")
    key = spec.key("rope_scaling") or "rope_scaling"
    if isinstance(rs, dict) and rs:
        out["default"] = RopeParams(rope_type_of(rs), theta, _params(rs), "rope_scaling", key)
    else:
        out["default"] = RopeParams("default", theta, {}, "default", key)
    local = spec.get("sliding_rope_theta")
    if local is not None and "sliding_attention" in spec.layer_types:
        # gemma3 legacy: sliding layers use plain RoPE with rope_local_base_freq
        out["sliding_attention"] = RopeParams("default", local, {}, "rope_scaling", spec.key("sliding_rope_theta") or "rope_local_base_freq")
    return out


def rope_for_layer(spec, layer_type: str) -> RopeParams | None:
    return spec.rope.get(layer_type) or spec.rope.get("default") or spec.rope.get("full_attention")


# --- views used by the RoPE rules and `kvtool rope` ------------------------------------------------
DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


def unprefixed(spec, name: str, fallback: str) -> str:
    """The config key (inside the text config) a quantity was read from, or the table's first key."""
    r = spec.values.get(name)
    if r is not None and r.key:
        return r.key
    k = spec.key(name)
    if k and spec.wrapper_key and k.startswith(spec.wrapper_key + "."):
        k = k[len(spec.wrapper_key) + 1:]
    return k or fallback


def raw_dict(spec, rp: RopeParams, layer_type: str) -> dict:
    """The config dict a RopeParams came from, as written ({} for plain RoPE without a dict)."""
    if rp.source == "rope_parameters":
        rp_all = spec.get("rope_parameters")
        if isinstance(rp_all, dict) and is_nested(rp_all):
            d = rp_all.get(layer_type)
            return d if isinstance(d, dict) else {}
        return rp_all if isinstance(rp_all, dict) else {}
    if rp.source == "rope_scaling" and layer_type in ("default", "full_attention"):
        d = spec.get("rope_scaling")
        return d if isinstance(d, dict) else {}
    return {}


# Types for which transformers fills original_max_position_embeddings from the top level (Phi-3
# keeps it there, and that value wins) or, failing that, from max_position_embeddings.
ORIGINAL_FROM_TOP = ("llama3", "yarn", "longrope", "su")


def rope_dict(rp: RopeParams, spec=None) -> dict:
    """The flat dict the math and the checks read: params plus rope_type and rope_theta."""
    d = dict(rp.params)
    d["rope_type"] = rp.rope_type
    d["rope_theta"] = rp.theta if rp.theta is not None else DEFAULT_THETA
    if spec is not None and rp.rope_type in ORIGINAL_FROM_TOP:
        top = spec.config.get("original_max_position_embeddings")
        if isinstance(top, int) and not isinstance(top, bool):
            d["original_max_position_embeddings"] = top
    return d


def theta_of(spec, rp: RopeParams) -> float:
    t = rp.theta
    if t is None:
        t = spec.arch.defaults.get("rope_theta", DEFAULT_THETA)
    return float(t)


def geometry_for(spec, rp: RopeParams):
    """Geometry (rotary dim, theta, lengths) of one layer type, or None when the dims are unknown."""
    from kvtool.model.rope.types import Geometry

    hd, dim = spec.head_dim, spec.rotary_dim
    qk_rope = spec.get("qk_rope_head_dim")
    if isinstance(qk_rope, int) and not isinstance(qk_rope, bool) and qk_rope > 0:
        hd = dim = qk_rope  # MLA: RoPE runs on the decoupled qk_rope_head_dim part only
    prf = rp.params.get("partial_rotary_factor")
    if prf is None and not isinstance(qk_rope, int):
        # transformers 5 copies a top-level partial_rotary_factor into rope_parameters
        # (standardize_rope_params) and its init functions apply it, whether or not the model's
        # table maps the key (llama does not: KV218 / KV219 report what each engine then does)
        prf = spec.config.get("partial_rotary_factor")
    if hd and isinstance(prf, (int, float)) and not isinstance(prf, bool) and 0 < prf <= 1:
        dim = int(hd * prf)
    if not dim or dim < 2:
        return None
    try:
        theta = theta_of(spec, rp)
    except (TypeError, ValueError):
        return None
    return Geometry(dim=dim, theta=theta, max_position_embeddings=spec.max_position, head_dim=hd)


def _norm(d: dict, theta) -> dict:
    out = {k: v for k, v in d.items() if k not in ("type", "rope_type", "rope_theta", "partial_rotary_factor")}
    from kvtool.model.rope.types import canonical

    t = d.get("rope_type", d.get("type", "default"))
    out["rope_type"] = canonical(t) if isinstance(t, str) else t
    out["rope_theta"] = float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else theta
    return out


def legacy_view(spec) -> dict[str, dict]:
    """What transformers 4.x reads: top-level theta + rope_scaling (and gemma3's local theta)."""
    theta = spec.get("rope_theta", spec.arch.defaults.get("rope_theta", DEFAULT_THETA))
    rs = spec.get("rope_scaling")
    out = {"full_attention": _norm(rs if isinstance(rs, dict) else {}, theta)}
    local = spec.get("sliding_rope_theta")
    if local is not None:
        out["sliding_attention"] = _norm({}, local)
    return out


def v5_view(spec) -> dict[str, dict] | None:
    """What transformers 5.x reads from rope_parameters (None when the config has none)."""
    rp = spec.get("rope_parameters")
    if not isinstance(rp, dict) or not rp:
        return None
    top = spec.get("rope_theta", spec.arch.defaults.get("rope_theta", DEFAULT_THETA))
    if is_nested(rp):
        return {lt: _norm(d, d.get("rope_theta", top)) for lt, d in rp.items()}
    return {"full_attention": _norm(rp, rp.get("rope_theta", top))}


def same_rope(a: dict, b: dict) -> bool:
    """Two normalised RoPE dicts (legacy_view / v5_view entries) describe the same RoPE."""
    import math

    from kvtool.values import is_number

    if set(a) != set(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if is_number(x) and is_number(y):
            if not math.isclose(float(x), float(y), rel_tol=1e-9):
                return False
        elif x != y:
            return False
    return True


def describe_rope(d: dict) -> str:
    """'llama3 RoPE (theta 500000, factor 8.0, ...)' for a normalised RoPE dict."""
    from kvtool.values import is_number

    extra = ", ".join(f"{k} {d[k]}" for k in sorted(d) if k not in ("rope_type", "rope_theta")
                      and not isinstance(d[k], list))
    theta = d.get("rope_theta")
    theta_s = f"{theta:g}" if is_number(theta) else repr(theta)
    return f"{d.get('rope_type')} RoPE (theta {theta_s}{', ' + extra if extra else ''})"


def has_legacy_rope(spec) -> bool:
    """The config writes the legacy layout itself (a non-empty rope_scaling or a rope_theta key)."""
    rs = spec.get("rope_scaling")
    return isinstance(rs, dict) and bool(rs) or \
        spec.values.get("rope_theta") is not None and spec.values["rope_theta"].key is not None


def layout_differences(spec) -> list[tuple[str, dict, dict]]:
    """(config path, what rope_parameters says, what the legacy fields give) for each layer type where the two
    layouts disagree; [] when the config has no rope_parameters."""
    v5 = v5_view(spec)
    if v5 is None:
        return []
    legacy = legacy_view(spec)
    rp_key = spec.key("rope_parameters") or "rope_parameters"
    out = []
    for lt, new in v5.items():
        old = legacy.get(lt) if lt in legacy else (legacy["full_attention"] if len(v5) == 1 else None)
        if old is None or same_rope(old, new):
            continue
        out.append((f"{rp_key}.{lt}" if len(v5) > 1 or lt != "full_attention" else rp_key, new, old))
    return out


def v5_only_difference(spec) -> tuple[str, str, str] | None:
    """RoPE written only in rope_parameters that a reader of the legacy fields (transformers 4.x) runs
    differently: (path, what rope_parameters says, what the legacy reader runs), else None."""
    if has_legacy_rope(spec):
        return None
    diffs = layout_differences(spec)
    if not diffs:
        return None
    path, new, old = diffs[0]
    return path, describe_rope(new), describe_rope(old)
