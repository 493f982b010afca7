"""Read RoPE settings from either config generation into one shape.

Legacy (transformers 4.x): `rope_theta` + `rope_scaling` ({"type" | "rope_type": ..., ...}).
v5: `rope_parameters`, flat ({"rope_type", "rope_theta", ...}) or nested per layer type
({"full_attention": {...}, "sliding_attention": {...}}).
"""

from __future__ import annotations

from kvtool.layer_types import KNOWN_TYPES
from kvtool.spec import RopeParams

TYPE_KEYS = ("rope_type", "type")


def rope_type_of(d: dict) -> str:
    t = d.get("rope_type", d.get("type"))
    return t if isinstance(t, str) and t else "default"


def _params(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("rope_type", "type", "rope_theta")}


def is_nested(rp: dict) -> bool:
    return bool(rp) and all(k in KNOWN_TYPES and isinstance(v, dict) for k, v in rp.items())


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
