"""What an engine fact looks for in a config: one detector per kind of fact (a dispatch table).

A detector gets the normalised ModelSpec and the fact row's `args`, and returns the hits: the config key it is
about and the values the row's `says` template is filled with. It never decides about versions (the row's
release range does) and never imports an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvtool.registry import Registry
from kvtool.values import is_number


@dataclass(frozen=True)
class Hit:
    path: str  # the config key the finding points at
    values: dict = field(default_factory=dict)  # fills the row's `says`


DETECTORS: Registry[Callable] = Registry("engine fact detector")
# Detectors about what a release does with a key: where another fact says that release does not read the key at
# all (its `drops`), they do not hold there (a class that ignores rope_scaling never meets an unknown rope type).
READS = {"rope_type_unknown": "rope_scaling", "yarn_original_ignored": "rope_scaling",
         "yarn_factor_from_context": "rope_scaling", "yarn_context": "rope_scaling",
         "yarn_mscale_ignored": "rope_scaling"}


def _top(spec, key: str):
    """A key of the text config, as written (None when absent)."""
    return spec.config.get(key) if isinstance(spec.config, dict) else None


@DETECTORS.register("model_type_unknown")
def model_type_unknown(spec, args) -> list[Hit]:
    """The release does not know this model_type at all (AutoConfig's ValueError)."""
    outer = spec.full_config.get("model_type") if isinstance(spec.full_config, dict) else None
    named = dict.fromkeys(mt for mt in (outer, spec.model_type) if isinstance(mt, str))  # a list is no name
    return [Hit("model_type", {"model_type": mt}) for mt in named if mt in args["model_types"]][:1]


def _refused(rs, types: tuple[str, ...] | None) -> str:
    """What a legacy rope_scaling validation refuses, in words: the rope_type-only case is the common one."""
    if isinstance(rs, dict) and "rope_type" in rs and "type" not in rs:
        return f"rope_type {rs['rope_type']!r} without 'type'"
    if types is not None and isinstance(rs, dict) and rs.get("type") not in (None, *types):
        return f"rope type {rs.get('type')!r}"
    return "this rope_scaling"


@DETECTORS.register("rope_scaling_two_fields")
def rope_scaling_two_fields(spec, args) -> list[Hit]:
    """The pre-4.43 `_rope_scaling_validation` of llama-family config classes, restated: rope_scaling must be
    exactly {"type": "linear" | "dynamic", "factor": float > 1}."""
    if spec.model_type not in args["model_types"]:
        return []
    rs = _top(spec, "rope_scaling")
    if rs is None:
        return []
    if not isinstance(rs, dict) or len(rs) != 2:
        msg = f"`rope_scaling` must be a dictionary with two fields, `type` and `factor`, got {rs}"
    elif rs.get("type") not in ("linear", "dynamic"):
        msg = f"`rope_scaling`'s type field must be one of ['linear', 'dynamic'], got {rs.get('type')}"
    elif not isinstance(rs.get("factor"), float) or rs["factor"] <= 1.0:
        msg = f"`rope_scaling`'s factor field must be a float > 1, got {rs.get('factor')}"
    else:
        return []
    return [Hit(spec.prefixed("rope_scaling"), {"what": _refused(rs, ("linear", "dynamic")), "message": msg})]


@DETECTORS.register("rope_scaling_three_fields")
def rope_scaling_three_fields(spec, args) -> list[Hit]:
    """Phi-3's pre-4.43 `_rope_scaling_validation`, restated: exactly {"type", "short_factor", "long_factor"}."""
    if spec.model_type not in args["model_types"]:
        return []
    rs = _top(spec, "rope_scaling")
    if rs is None or isinstance(rs, dict) and set(rs) == {"type", "short_factor", "long_factor"}:
        return []
    msg = ("`rope_scaling` must be a dictionary with three fields, `type`, `short_factor` and `long_factor`, "
           f"got {rs}")
    return [Hit(spec.prefixed("rope_scaling"), {"what": _refused(rs, None), "message": msg})]


@DETECTORS.register("rope_type_unknown")
def rope_type_unknown(spec, args) -> list[Hit]:
    """A RoPE type the release's ROPE_INIT_FUNCTIONS does not have yet."""
    for rp in spec.rope.values():
        if rp.rope_type in args["rope_types"]:
            return [Hit(rp.path, {"rope_type": rp.rope_type})]
    return []


@DETECTORS.register("yarn_original_ignored")
def yarn_original_ignored(spec, args) -> list[Hit]:
    """yarn whose original_max_position_embeddings is not max_position_embeddings: releases that take the
    correction range from max_position_embeddings compute other frequencies."""
    for rp in spec.rope.values():
        orig = rp.params.get("original_max_position_embeddings")
        if rp.rope_type == "yarn" and isinstance(orig, int) and spec.max_position and orig != spec.max_position:
            return [Hit(rp.path, {"original": orig, "max_position_embeddings": spec.max_position})]
    return []


@DETECTORS.register("yarn_factor_from_context")
def yarn_factor_from_context(spec, args) -> list[Hit]:
    """yarn whose factor is not max_position_embeddings / original_max_position_embeddings: releases that
    recompute the factor from the two lengths run another one."""
    for rp in spec.rope.values():
        orig, factor = rp.params.get("original_max_position_embeddings"), rp.params.get("factor")
        if rp.rope_type == "yarn" and isinstance(orig, int) and orig > 0 and is_number(factor) and spec.max_position:
            used = spec.max_position / orig
            if abs(used - float(factor)) > 1e-9 * max(1.0, float(factor)):
                return [Hit(rp.path, {"used": f"{used:g}", "factor": f"{float(factor):g}",
                                      "max_position_embeddings": spec.max_position, "original": orig})]
    return []


@DETECTORS.register("rope_scaling_ignored")
def rope_scaling_ignored(spec, args) -> list[Hit]:
    """A scaling rope_scaling on a release whose config class does not read rope_scaling yet."""
    if spec.model_type not in args["model_types"]:
        return []
    rs = _top(spec, "rope_scaling")
    if not isinstance(rs, dict):
        return []
    t = rs.get("rope_type", rs.get("type"))
    if t in (None, "default", "mrope"):
        return []
    factor = rs.get("factor")
    what = f"{t}" + (f", factor {factor:g}" if is_number(factor) else "")
    return [Hit(spec.prefixed("rope_scaling"), {"what": what})]


@DETECTORS.register("rope_parameters_only")
def rope_parameters_only(spec, args) -> list[Hit]:
    """RoPE set only in rope_parameters (the transformers 5 layout): a release that reads the legacy fields runs
    the class default (KV213's case; the comparison is kvtool.model.rope.params')."""
    from kvtool.model.rope.params import v5_only_difference

    diff = v5_only_difference(spec)
    if diff is None:
        return []
    path, new, old = diff
    return [Hit(path, {"new": new, "old": old})]


@DETECTORS.register("dtype_only")
def dtype_only(spec, args) -> list[Hit]:
    """`dtype` written (transformers >= 4.56 spelling) and no `torch_dtype`: older readers see no dtype."""
    outer = spec.full_config if isinstance(spec.full_config, dict) else {}
    for cfg, path in ((outer, "dtype"), (spec.config, spec.prefixed("dtype"))):
        if isinstance(cfg, dict) and cfg.get("dtype") is not None and cfg.get("torch_dtype") is None:
            return [Hit(path, {"dtype": cfg["dtype"]})]
    return []


@DETECTORS.register("explicit_head_dim")
def explicit_head_dim(spec, args) -> list[Hit]:
    """head_dim written and different from hidden_size / num_attention_heads, on a class that derives it."""
    if spec.model_type not in args["model_types"]:
        return []
    hd, hidden, heads = _top(spec, "head_dim"), _top(spec, "hidden_size"), _top(spec, "num_attention_heads")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (hd, hidden, heads)):
        return []
    derived = hidden // heads
    if derived == hd:
        return []
    return [Hit(spec.prefixed("head_dim"), {"head_dim": hd, "derived": derived, "hidden_size": hidden,
                                            "heads": heads})]


@DETECTORS.register("layer_types_ignored")
def layer_types_ignored(spec, args) -> list[Hit]:
    """layer_types with a non-full layer, on a release whose config class does not read layer_types yet."""
    if spec.model_type not in args["model_types"]:
        return []
    lt = _top(spec, "layer_types")
    if not isinstance(lt, list) or all(t == "full_attention" for t in lt):
        return []
    kinds = sorted({str(t) for t in lt if t != "full_attention"})
    return [Hit(spec.prefixed("layer_types"), {"kinds": ", ".join(kinds)})]


@DETECTORS.register("partial_rotary_ignored")
def partial_rotary_ignored(spec, args) -> list[Hit]:
    """partial_rotary_factor < 1 on a class whose rotary embedding uses the whole head."""
    if spec.model_type not in args["model_types"]:
        return []
    prf = _top(spec, "partial_rotary_factor")
    if not is_number(prf) or not 0 < prf < 1:
        return []
    return [Hit(spec.prefixed("partial_rotary_factor"), {"factor": f"{prf:g}"})]


@DETECTORS.register("yarn_context")
def yarn_context(spec, args) -> list[Hit]:
    """yarn whose original_max_position_embeddings x factor is not max_position_embeddings: vLLM releases that
    derive max_model_len from the former serve another length (kvtool.model.rope.types.served_context)."""
    from kvtool.model.rope.params import rope_dict
    from kvtool.model.rope.types import served_context

    mpe = spec.max_position
    for rp in spec.rope.values():
        if rp.rope_type != "yarn":
            continue
        params = rope_dict(rp, spec)
        old = served_context(params, mpe, spec.model_type, yarn_from_original=True)
        new = served_context(params, mpe, spec.model_type)
        if old is not None and new is not None and old != new:
            return [Hit(rp.path, {"served": old, "max_position_embeddings": mpe})]
    return []


@DETECTORS.register("kv_scales_declared")
def kv_scales_declared(spec, args) -> list[Hit]:
    """The checkpoint declares static KV-cache scales (quantization_config.kv_cache_scheme, not dynamic: llm-compressor
    / quantize-kv write k_scale / v_scale tensors beside it) and is one of `args["model_types"]`."""
    outer = spec.full_config.get("model_type") if isinstance(spec.full_config, dict) else None
    # a hostile config's model_type may be any JSON value: only strings name a model type
    if not ({m for m in (outer, spec.model_type) if isinstance(m, str)} & set(args["model_types"])):
        return []
    qc = spec.full_config.get("quantization_config") if isinstance(spec.full_config, dict) else None
    scheme = qc.get("kv_cache_scheme") if isinstance(qc, dict) else None
    if not isinstance(scheme, dict) or scheme.get("dynamic") not in (False, None):
        return []
    return [Hit("quantization_config.kv_cache_scheme", {"model_type": spec.model_type or outer})]


def _rope_dicts(spec):
    """(path, rope dict as written, rope type) of each RoPE parameter set the config writes ({} for plain RoPE)."""
    from kvtool.model.rope.params import raw_dict

    out = []
    for key, rp in spec.rope.items():
        raw = raw_dict(spec, rp, key)
        out.append((rp.path, raw if isinstance(raw, dict) else {}, rp.rope_type or "default"))
    return out


@DETECTORS.register("partial_rotary_forward")
def partial_rotary_forward(spec, args) -> list[Hit]:
    """partial_rotary_factor < 1 read by the release's shared RoPE init (frequencies for head_dim x factor dims)
    on a class whose attention rotates the whole head: the first forward fails on the shape. args: model_types;
    where: "top" (only the top-level key: 4.x reads the config attribute) or "any" (also inside the rope dict: 5.x
    moves it there); rope_types: "any", "scaled" (not default: 5.x's default init ignores the factor) or
    "default"; whole_head: scaled types whose init returns frequencies for the whole head whatever the factor
    (transformers 5's "proportional": modeling_rope_utils._compute_proportional_rope_parameters)."""
    if spec.model_type not in args["model_types"] or spec.position != "rope":
        return []
    hd = spec.head_dim
    for path, raw, rope_type in _rope_dicts(spec) or [("rope_scaling", {}, "default")]:
        scaled = rope_type not in ("default", "mrope", *args.get("whole_head", ()))
        if args["rope_types"] == "scaled" and not scaled or args["rope_types"] == "default" and scaled:
            continue
        prf, where = _top(spec, "partial_rotary_factor"), spec.prefixed("partial_rotary_factor")
        if args["where"] == "any" and raw.get("partial_rotary_factor") is not None:
            prf, where = raw["partial_rotary_factor"], f"{path}.partial_rotary_factor"
        if not is_number(prf) or not 0 < prf < 1:
            continue
        dims = f"{int(hd * prf)} of {hd}" if hd else f"{prf:g} of the head"
        return [Hit(where, {"factor": f"{prf:g}", "dims": dims, "rope_type": rope_type})]
    return []


@DETECTORS.register("rope_required_keys")
def rope_required_keys(spec, args) -> list[Hit]:
    """A release's rope validation (transformers 5: _check_received_keys) after its own filling-in
    (standardize_rope_params): rope_theta from the top level, original_max_position_embeddings from the top level
    (else max_position_embeddings) only for the types written as one of args["fill_original"]; a written alias
    (args["aliases"], the config class's own mapping) is renamed after that. A hit names the required keys
    (args["required"][type]) still missing."""
    if spec.model_type not in args.get("model_types", [spec.model_type]):
        return []
    for path, raw, _ in _rope_dicts(spec):
        if not raw:
            continue
        written = raw.get("rope_type", raw.get("type", "default"))
        if not isinstance(written, str):
            continue
        have = set(raw) | {"rope_type"}
        if _top(spec, "rope_theta") is not None:
            have.add("rope_theta")
        if written in args["fill_original"]:
            have.add("original_max_position_embeddings")
        canonical = args["aliases"].get(written, written)
        missing = sorted(set(args["required"].get(canonical, ())) - have)
        if missing:
            return [Hit(path, {"rope_type": canonical, "written": written, "missing": ", ".join(missing)})]
    return []


@DETECTORS.register("yarn_mscale_ignored")
def yarn_mscale_ignored(spec, args) -> list[Hit]:
    """yarn with mscale / mscale_all_dim and no attention_factor, on a release whose yarn init scales attention by
    0.1 ln(factor) + 1 without reading them: a hit where that differs from what the dict says."""
    import math

    from kvtool.model.rope.params import rope_dict

    for rp in spec.rope.values():
        if rp.rope_type != "yarn":
            continue
        from kvtool.model.rope.freqs import yarn_attention_factor  # numpy: only for a yarn config

        p = rope_dict(rp, spec)
        raw = p.get("factor")
        if p.get("attention_factor") is not None or not ({"mscale", "mscale_all_dim"} & set(p)) \
                or not isinstance(raw, (int, float)) or not is_number(raw) or raw <= 0:
            continue
        factor = float(raw)
        try:
            written = yarn_attention_factor(p, factor)
        except (TypeError, ValueError):
            continue
        plain = 0.1 * math.log(factor) + 1.0
        if not math.isclose(plain, written, rel_tol=1e-9):
            return [Hit(rp.path, {"plain": f"{plain:.6g}", "written": f"{written:.6g}"})]
    return []


@DETECTORS.register("rotary_dim_ignored")
def rotary_dim_ignored(spec, args) -> list[Hit]:
    """rotary_dim below head_dim on a release whose class of args["model_types"] does not read it yet."""
    if spec.model_type not in args["model_types"]:
        return []
    rd, hd = _top(spec, "rotary_dim"), spec.head_dim
    if not isinstance(rd, int) or isinstance(rd, bool) or not hd or not 0 < rd < hd:
        return []
    return [Hit(spec.prefixed("rotary_dim"), {"rotary_dim": rd, "head_dim": hd})]


@DETECTORS.register("key_absent")
def key_absent(spec, args) -> list[Hit]:
    """A config of args["model_types"] without one of args["keys"], which the release's model reads off its config
    class while the class declares no default for it."""
    if spec.model_type not in args["model_types"] or not isinstance(spec.config, dict):
        return []
    missing = [k for k in args["keys"] if k not in spec.config]
    return [Hit(spec.prefixed(missing[0]), {"key": missing[0]})] if missing else []
