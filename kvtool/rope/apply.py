"""Plan a RoPE change: the new config for `kvtool rope --type ...`, with every choice explained.

max_position_embeddings follows how each engine reads it (vllm/config/model.py derives
max_model_len from rope settings; transformers takes max_position_embeddings as the context):
- yarn: original x factor, original recorded. vLLM 0.33 serves max_position_embeddings as written
  for yarn (as transformers does), so it must be the length the frequencies were stretched for.
- llama3, longrope: original x factor, original recorded. vLLM serves max_position_embeddings
  as written for these types, so it must already be the extended length.
- linear, dynamic: the original length. vLLM multiplies max_position_embeddings by factor itself,
  and transformers' dynamic NTK starts stretching only past max_position_embeddings.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from kvtool.errors import InputError, UsageError
from kvtool.model.engine_tables import newest_read
from kvtool.model.numbers import FACTOR_LIST_BOUND, ROPE_PARAM_BOUNDS, problem
from kvtool.model.rope import types as rt
from kvtool.model.rope.params import (
    ORIGINAL_FROM_TOP, geometry_for, is_nested, raw_dict, rope_dict, theta_of, unprefixed,
)
from kvtool.model.spec import ModelSpec, build_spec, unwrap
from kvtool.options.fields import flag_of
from kvtool.options.rope import RopeOptions

# MLA attention: vLLM and SGLang rewrite any rope_scaling on DeepSeek-style MLA layers to
# deepseek_yarn (and fold mscale into the softmax scale), so only yarn means what it says there.
MLA_TYPES = ("yarn",)
# Keys that describe the model's rotary layout, not the scaling: kept across a type change.
STRUCTURAL_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
# Keys recomputed by every plan (never carried over from the old dict).
RECOMPUTED_KEYS = ("type", "rope_type", "rope_theta", "factor", "original_max_position_embeddings",
                   "attention_factor")
# Llama 3.1's published band when the user gives none.
LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
# Options that only some types read: option key -> types.
TYPE_OPTIONS = {
    "beta_fast": ("yarn",), "beta_slow": ("yarn",), "attention_factor": ("yarn", "longrope"),
    "low_freq_factor": ("llama3",), "high_freq_factor": ("llama3",),
    "short_factor": ("longrope",), "long_factor": ("longrope",),
}
# Why max_position_embeddings gets its new value: by the type's `context` (RopeKind), worded per type where
# there is more to say.
MAX_POSITION_RULE = {
    "yarn": f"original x factor (vLLM {newest_read('vllm')} serves max_position_embeddings as written for yarn)",
    "dynamic": "kept at the original length (vLLM multiplies it by factor; dynamic NTK starts past it)",
}


def max_position_rule(kind: rt.RopeKind) -> str:
    if kind.name in MAX_POSITION_RULE:
        return MAX_POSITION_RULE[kind.name]
    if kind.context == "as_is":
        return f"original x factor (vLLM serves max_position_embeddings as written for {kind.name})"
    return "kept at the original length (vLLM multiplies it by factor itself)"


@dataclass
class _Request:
    """The options with the type-specific values gathered (factor lists read)."""

    o: RopeOptions
    options: dict

    def __getattr__(self, name):
        return getattr(self.o, name)


@dataclass
class Plan:
    config: dict  # the new full config.json
    layer_type: str
    old: dict  # flat rope dict before (rope_type, rope_theta, ...)
    new: dict  # flat rope dict after
    old_max: int | None
    new_max: int
    original: int
    factor: float
    notes: list[str] = field(default_factory=list)
    spec: ModelSpec | None = None  # spec of the new config
    findings: list = field(default_factory=list)  # what `kvtool lint` reports for the new config


def target_params(spec: ModelSpec, layer_type: str):
    """(key in spec.rope, RopeParams) for a layer type; legacy single-RoPE configs use 'default'."""
    if layer_type in spec.rope:
        return layer_type, spec.rope[layer_type]
    if layer_type == "full_attention" and "default" in spec.rope:
        return "default", spec.rope["default"]
    return None, None


def is_mla(spec: ModelSpec) -> bool:
    return spec.is_mla or spec.get("kv_lora_rank") is not None


def type_values(opts: RopeOptions) -> dict:
    """The type-specific values asked for (beta_fast, ..., short_factor / long_factor lists read from their files)."""
    lists = {"short_factor": opts.short_factor_file, "long_factor": opts.long_factor_file}
    values = {k: getattr(opts, k) for k in TYPE_OPTIONS if k not in lists}
    values.update({k: _factor_list(path, f"{k}_file") for k, path in lists.items()})
    return values


def _factor_list(path: str | None, name: str) -> list[float] | None:
    """A JSON list of positive numbers, or a JSON object holding one under short_factor / long_factor."""
    from pathlib import Path

    from kvtool.io.jsonfile import parse_json, read_text

    if path is None:
        return None
    data = parse_json(read_text(Path(path), what="factor list"), path, what="factor list")
    if isinstance(data, dict):
        data = data.get(name.removesuffix("_file"))
    if not (isinstance(data, list) and data and not problem(data, FACTOR_LIST_BOUND)):
        raise InputError(f"{flag_of(RopeOptions, name)} expects a JSON list of finite numbers > 0 and <= 1e6", file=path)
    return [float(x) for x in data]


def plan_rope(spec: ModelSpec, opts: RopeOptions, *, source: str = "config.json") -> Plan:
    """Build the new config. Raises UsageError (exit 2) for every refusal."""
    req = _Request(opts, type_values(opts))
    name = spec.model_type or "this model"
    if spec.position != "rope":
        kind_words = "ALiBi attention biases" if spec.position == "alibi" else f"{spec.position} position embeddings"
        raise UsageError(f"{name} uses {kind_words}, not RoPE; RoPE scaling does not apply to it", file=source)
    kind = rt.kind_of(req.type)
    if kind is None or not kind.applicable:
        raise UsageError(f"cannot apply RoPE type {req.type!r}; choose one of {', '.join(rt.applicable_types())}",
                         option="type")
    if is_mla(spec) and kind.name not in MLA_TYPES:
        raise UsageError(f"{name} uses multi-head latent attention (MLA); vLLM and SGLang run every rope_scaling on MLA "
                         f"layers as deepseek_yarn, so only --type {' / '.join(MLA_TYPES)} is supported "
                         f"(asked: {kind.name})", file=source)
    for opt, types in TYPE_OPTIONS.items():
        if req.options.get(opt) is not None and kind.name not in types:
            raise UsageError(f"--{opt.replace('_', '-')} applies to --type {' / '.join(types)} only", option="type")

    rope_key, rp = target_params(spec, req.layer_type)
    nested = len(spec.rope) > 1 or is_nested(spec.get("rope_parameters") or {}) or \
        bool(spec.arch.attention.get("rope_per_layer_type"))
    have = sorted(set(spec.layer_types) | {"full_attention"})
    if req.layer_type not in have:
        raise UsageError(f"{name} has no {req.layer_type!r} layers (layer types: {', '.join(have)})",
                         option="layer_type")
    if not nested and req.layer_type != "full_attention":
        raise UsageError(f"{name} uses one RoPE for all layers; --layer-type applies to per-layer-type configs "
                         "(gemma3 style) only", option="layer_type")
    if rp is None:
        raise UsageError(f"{name} has no RoPE settings for {req.layer_type!r} layers", option="layer_type")
    if nested and req.layer_type != "full_attention" and req.layout != "v5":
        raise UsageError(f"the legacy layout can scale only full-attention layers; use --layout v5 to scale "
                         f"{req.layer_type} layers", option="layout")

    old_raw = raw_dict(spec, rp, rope_key)
    old = {**old_raw, **rope_dict(rp, spec)}
    old.pop("type", None)
    original = _original(spec, req, old, source)
    factor = _factor(req, original)
    theta = float(req.theta) if req.theta is not None else theta_of(spec, rp)
    if req.theta is not None:
        _check_bound(theta, "rope_theta", "theta")
    if not theta > 0:
        raise UsageError(f"RoPE base must be positive, got {theta}", option="theta")

    new = _new_params(kind.name, old, req, factor, original)
    g = geometry_for(spec, rp)
    if kind.name == "longrope" and g is not None:
        for key in ("short_factor", "long_factor"):
            if len(new[key]) != g.dim // 2:
                raise UsageError(f"{key} has {len(new[key])} entries; this model's rotary_dim {g.dim} needs {g.dim // 2}",
                                 option=f"{key}_file")
    new_max = int(original * factor) if kind.context in ("original", "as_is") else original

    full = copy.deepcopy(spec.full_config)
    inner, _ = unwrap(full)
    notes = _write(spec, inner, req, kind.name, new, theta, rope_key, old_raw, nested)
    mpe_key = unprefixed(spec, "max_position", "max_position_embeddings")
    inner[mpe_key] = new_max
    notes.append(f"{mpe_key}: {spec.max_position} -> {new_max}: {max_position_rule(kind)}")
    if isinstance(spec.max_position, int) and new_max < spec.max_position:
        notes.append(f"note: the context shrinks ({spec.max_position} -> {new_max}); factors are relative to the "
                     f"original length {original}")
    new_flat = {"rope_type": kind.name, "rope_theta": theta, **{k: v for k, v in new.items() if k != "rope_type"}}
    return Plan(config=full, layer_type=req.layer_type, old=old, new=new_flat, old_max=spec.max_position,
                new_max=new_max, original=original, factor=factor, notes=notes, spec=build_spec(full))


def _original(spec: ModelSpec, req: _Request, old: dict, source: str) -> int:
    if req.original_max_position_embeddings is not None:
        o, where = req.original_max_position_embeddings, None
    elif old.get("original_max_position_embeddings") is not None and old["rope_type"] in ORIGINAL_FROM_TOP:
        o, where = old["original_max_position_embeddings"], "original_max_position_embeddings"
    else:
        # linear / dynamic / plain RoPE keep the pre-scaling length in max_position_embeddings
        o, where = spec.max_position, spec.key("max_position") or "max_position_embeddings"
    if isinstance(o, bool) or not isinstance(o, int) or o <= 0:
        raise InputError(f"the original context length must be a positive integer, got {o!r} "
                         "(pass --original-max-position-embeddings)", file=source, field=where,
                         option=None if where else "original_max_position_embeddings")
    return o


def _factor(req: _Request, original: int) -> float:
    if req.factor is not None and req.target_context is not None:
        raise UsageError("give --factor or --target-context, not both", option="factor")
    if req.factor is None and req.target_context is None:
        raise UsageError("give --factor F or --target-context N", option="factor")
    _check_option_numbers(req)
    f = float(req.factor) if req.factor is not None else req.target_context / original
    if not f >= 1:
        what = f"--factor {req.factor}" if req.factor is not None else \
            f"--target-context {req.target_context} / original {original} = {f:g}"
        raise UsageError(f"{what} is below 1: it would shrink the context, not extend it", option="factor")
    return f  # a float: transformers 4.x validators warn on an int factor


def _check_option_numbers(req: _Request) -> None:
    """Each numeric option against the bound its config key has (kvtool.model.numbers)."""
    given = {"factor": req.factor, "original_max_position_embeddings": req.original_max_position_embeddings, **req.options}
    for key, value in given.items():
        if value is not None and key in ROPE_PARAM_BOUNDS:
            _check_bound(value, key, key)
    if req.target_context is not None:
        _check_bound(req.target_context, "original_max_position_embeddings", "target_context")


def _check_bound(value, key: str, name: str) -> None:
    bad = problem(value, ROPE_PARAM_BOUNDS[key])
    if bad:
        raise UsageError(f"got {bad[0]}; it must be {bad[1]}", option=name)


def _new_params(name: str, old: dict, req: _Request, factor: float, original: int) -> dict:
    new: dict = {"rope_type": name}
    for k in STRUCTURAL_KEYS:
        if k in old and k != "partial_rotary_factor":
            new[k] = old[k]
    if rt.canonical(str(old.get("rope_type"))) == name:
        # same type again (re-scaling): keep the model's tuned knobs (beta_*, mscale*, truncate, ...)
        for k, v in old.items():
            if k not in RECOMPUTED_KEYS and k not in new and k != "partial_rotary_factor":
                new[k] = v
    new["factor"] = factor
    opts = {k: v for k, v in req.options.items() if v is not None}
    if "original_max_position_embeddings" in rt.KINDS[name].required:
        new["original_max_position_embeddings"] = original
    if name == "llama3":
        for k, dflt in LLAMA3_DEFAULTS.items():
            new[k] = opts.get(k, new.get(k, dflt))
    if name == "longrope":
        for k in ("short_factor", "long_factor"):
            lst = opts.get(k, new.get(k))
            if lst is None:
                raise UsageError(f"longrope needs per-dimension factors: pass --{k.replace('_', '-')}-file",
                                 option=f"{k}_file")
            new[k] = list(lst)
    for k in ("beta_fast", "beta_slow", "attention_factor"):
        if k in opts:
            new[k] = opts[k]
    allowed = rt.KINDS[name].allowed_keys()
    return {k: v for k, v in new.items() if k in allowed}


def _write(spec, inner: dict, req: _Request, name: str, new: dict, theta: float, rope_key: str,
           old_raw: dict, nested: bool) -> list[str]:
    notes: list[str] = []
    theta_key = unprefixed(spec, "rope_theta", "rope_theta")
    rs_key = unprefixed(spec, "rope_scaling", "rope_scaling")
    local_key = unprefixed(spec, "sliding_rope_theta", "rope_local_base_freq") if spec.get("sliding_rope_theta") is not None else None
    legacy_rs = spec.get("rope_scaling") if isinstance(spec.get("rope_scaling"), dict) else {}
    had_type = "type" in legacy_rs or "type" in old_raw
    if req.layout in ("both", "legacy"):
        scaling = dict(new)
        if had_type:
            # old remote code (DeepSeek, MiniCPM) reads `type`; it must name the same type as rope_type
            scaling = {"type": name, **scaling}
        inner[theta_key] = theta
        inner[rs_key] = scaling
        prf = (spec.get("rope_parameters") or {}).get("partial_rotary_factor") if not nested else None
        if prf is not None and "partial_rotary_factor" not in inner:
            inner["partial_rotary_factor"] = prf  # 4.x reads it at the top level only
        notes.append(f"legacy layout: {theta_key} + {rs_key} (rope_type{', type' if had_type else ''}) for "
                     "transformers 4.x and vLLM")
    if req.layout in ("both", "v5"):
        inner["rope_parameters"] = _v5_params(spec, req, new, theta, rope_key, nested)
        notes.append("v5 layout: rope_parameters" + (" (nested per layer type)" if nested else "") +
                     " for transformers >= 5")
    if req.layout == "legacy" and "rope_parameters" in inner:
        del inner["rope_parameters"]
        notes.append("removed rope_parameters (it would contradict the legacy fields)")
    if req.layout == "v5":
        for k in (rs_key, theta_key, local_key):
            if k and k in inner:
                del inner[k]
                notes.append(f"removed {k} (moved into rope_parameters)")
    return notes


def _v5_params(spec, req: _Request, new: dict, theta: float, rope_key: str, nested: bool) -> dict:
    def flat(d: dict, t) -> dict:
        out = {"rope_type": d.get("rope_type", "default"), "rope_theta": t}
        out.update({k: v for k, v in d.items() if k not in ("rope_type", "type", "rope_theta")})
        return out

    old_v5 = spec.get("rope_parameters") if isinstance(spec.get("rope_parameters"), dict) else {}
    if not nested:
        d = flat(new, theta)
        prf = old_v5.get("partial_rotary_factor")
        if prf is not None:
            d["partial_rotary_factor"] = prf  # v5 keeps it inside rope_parameters
        return d
    out: dict = {}
    for key, rp in spec.rope.items():
        lt = "full_attention" if key == "default" else key
        if key == rope_key:
            d = flat(new, theta)
        else:
            existing = old_v5.get(lt) if isinstance(old_v5.get(lt), dict) else None
            d = dict(existing) if existing else flat({"rope_type": rp.rope_type, **rp.params}, theta_of(spec, rp))
        out[lt] = d
    for lt in sorted(set(spec.layer_types) & {"sliding_attention", "chunked_attention"} - set(out)):
        # layer types that ran plain RoPE on the one legacy theta (Olmo3's sliding layers): say so per type
        out[lt] = flat({"rope_type": "default"}, theta_of(spec, spec.rope[rope_key]))
    return out


def lint_findings(config: dict, display: str) -> list:
    """The findings `kvtool lint` reports for a config (run in-process, config checks only)."""
    import json
    from pathlib import Path

    from kvtool.model.checkpoint import Checkpoint
    from kvtool.io.jsonfile import JsonDocument
    from kvtool.rules import load_all
    from kvtool.rules.context import LintContext
    from kvtool.rules.registry import CHECKERS, LintOptions

    load_all()
    doc = JsonDocument(path=Path(display), data=config, text=json.dumps(config, indent=2))
    ctx = LintContext(Checkpoint(source=display, root=None, config_doc=doc), build_spec(config), LintOptions())
    for topic, fn in CHECKERS.values():
        try:
            fn(ctx)
        except Exception as exc:  # noqa: BLE001 - reported like lint does
            ctx.report("KV000", f"internal error in the {topic} checks: {type(exc).__name__}: {exc}")
    return ctx.findings
