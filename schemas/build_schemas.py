"""Regenerate schemas/<model_type>.json (JSON Schema 2020-12) from the architecture tables.

Run `python schemas/build_schemas.py` with transformers installed. Each schema types:
  - every field of the model's transformers config class, from its annotations (int, float, bool,
    str, Literal, list, dict, unions with None);
  - the keys in COMMON below (legacy / remote-code spellings too), with ranges and enums;
  - rope_scaling (legacy) and rope_parameters (v5, flat or nested per layer type).
Unknown keys stay allowed (real configs carry many). The core dimensions the table reads
(layers, hidden size, heads, vocabulary) are required, in any of the table's spellings.
kvtool itself never imports this file, nor transformers, to lint.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

DRAFT = "https://json-schema.org/draft/2020-12/schema"
POS_INT = {"type": "integer", "minimum": 1}
NONNEG_INT = {"type": "integer", "minimum": 0}
POS_NUM = {"type": "number", "exclusiveMinimum": 0}
PROB = {"type": "number", "minimum": 0, "maximum": 1}
BOOL = {"type": "boolean"}
TOKEN_ID = {"type": ["integer", "null"]}
TOKEN_IDS = {"anyOf": [{"type": ["integer", "null"]}, {"type": "array", "items": {"type": "integer"}}]}
DTYPES = ["float16", "bfloat16", "float32", "float64", "half", "float", "double",
          "float8_e4m3fn", "float8_e5m2", "int8", "uint8", "auto"]


def _activations() -> list[str]:
    from transformers.activations import ACT2CLS

    return sorted(ACT2CLS)


def nullable(s: dict) -> dict:
    if "type" in s and isinstance(s["type"], str) and len(s) >= 1:
        return {**s, "type": [s["type"], "null"]}
    return {"anyOf": [s, {"type": "null"}]}


ROPE_DICT = {
    "type": "object",
    "properties": {
        "type": {"type": "string"}, "rope_type": {"type": "string"},
        "rope_theta": POS_NUM, "factor": POS_NUM,
        "original_max_position_embeddings": POS_INT,
        "low_freq_factor": POS_NUM, "high_freq_factor": POS_NUM,
        "beta_fast": {"type": "number"}, "beta_slow": {"type": "number"},
        "attention_factor": POS_NUM, "mscale": {"type": "number"}, "mscale_all_dim": {"type": "number"},
        "short_factor": {"type": "array", "items": {"type": "number"}},
        "long_factor": {"type": "array", "items": {"type": "number"}},
        "short_mscale": {"type": "number"}, "long_mscale": {"type": "number"},
        "partial_rotary_factor": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "truncate": BOOL, "mrope_section": {"type": "array", "items": NONNEG_INT},
        "mrope_interleaved": BOOL,
    },
    # a flat RoPE dict names its type (legacy `type`, v4.4x+ `rope_type`) or, in v5, its theta
    "if": {"minProperties": 1},
    "then": {"anyOf": [{"required": ["rope_type"]}, {"required": ["type"]}, {"required": ["rope_theta"]}]},
}
LAYER_TYPES = ["full_attention", "sliding_attention", "chunked_attention", "linear_attention"]

COMMON: dict[str, dict] = {
    "model_type": {"type": "string"},
    # vLLM and SGLang pick the model class from architectures[0]: an empty list cannot be served
    "architectures": {"type": ["array", "null"], "items": {"type": "string"}, "minItems": 1},
    "transformers_version": {"type": ["string", "null"]},
    # dimensions
    **{k: POS_INT for k in (
        "num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim", "vocab_size",
        "max_position_embeddings", "n_layer", "n_embd", "n_embed", "n_head", "n_positions", "n_layers", "d_model",
        "n_heads", "max_seq_len", "seq_length", "ffn_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
        "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "experts_per_token",
        "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "attention_chunk_size",
        "decoder_sparse_step", "index_head_dim", "index_n_heads", "index_topk", "attention_head_dim")},
    "intermediate_size": nullable(POS_INT),
    "n_inner": nullable(POS_INT),
    "num_key_value_heads": nullable(POS_INT),
    "num_kv_heads": nullable(POS_INT),
    "n_head_kv": nullable(POS_INT),
    "q_lora_rank": nullable(POS_INT),
    "rotary_dim": nullable(POS_INT),
    "n_shared_experts": nullable(NONNEG_INT),
    "first_k_dense_replace": NONNEG_INT,
    "max_window_layers": NONNEG_INT,
    "num_nextn_predict_layers": NONNEG_INT,
    "sliding_window": {"type": ["integer", "null"]},
    "layer_types": {"type": ["array", "null"], "items": {"type": "string"}},
    # numbers
    "rope_theta": POS_NUM,
    "rotary_emb_base": POS_NUM,
    "partial_rotary_factor": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "rotary_pct": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "rms_norm_eps": POS_NUM, "layer_norm_eps": POS_NUM, "layer_norm_epsilon": POS_NUM,
    "initializer_range": {"type": "number", "minimum": 0},
    **{k: nullable(PROB) for k in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")},
    # flags
    **{k: BOOL for k in ("tie_word_embeddings", "use_cache", "attention_bias", "mlp_bias", "use_sliding_window",
                         "multi_query", "new_decoder_architecture", "alibi", "parallel_attn", "qk_layernorm",
                         "use_qk_norm")},
    # enums
    "dtype": {"type": ["string", "null"], "enum": DTYPES + [None]},
    "torch_dtype": {"type": ["string", "null"], "enum": DTYPES + [None]},
    # token ids
    "bos_token_id": TOKEN_IDS, "eos_token_id": TOKEN_IDS, "pad_token_id": TOKEN_IDS,
    # RoPE, both generations
    "rope_scaling": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/rope_dict"}]},
    "rope_parameters": {"anyOf": [
        {"type": "null"},
        {"type": "object", "propertyNames": {"enum": LAYER_TYPES},
         "additionalProperties": {"$ref": "#/$defs/rope_dict"}, "minProperties": 1},
        {"$ref": "#/$defs/rope_dict"},
    ]},
}
ACT_KEYS = ("hidden_act", "activation_function", "mlp_hidden_act", "hidden_activation")
# Base-class fields of every transformers config: typed by COMMON where it matters, left loose otherwise.
SKIP_FIELDS = {"id2label", "label2id", "problem_type", "rope_parameters", "rope_scaling", "dtype",
               "architectures", "transformers_version"}


def py_to_schema(tp) -> dict | None:
    """JSON Schema for a Python annotation, or None when it has no JSON meaning."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return {"type": "null"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin in (list, tuple) or tp in (list, tuple):
        args = typing.get_args(tp)
        items = py_to_schema(args[0]) if args and args[0] is not Ellipsis else None
        return {"type": "array", **({"items": items} if items else {})}
    if origin is dict or tp is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        parts = [py_to_schema(a) for a in typing.get_args(tp)]
        if any(p is None for p in parts):
            return None  # a non-JSON member (torch.dtype, a config class): leave the key untyped
        simple = [p["type"] for p in parts if set(p) == {"type"} and isinstance(p["type"], str)]
        if len(simple) == len(parts):
            return {"type": sorted(set(simple))}
        return {"anyOf": parts}
    return None


def class_properties(model_type: str) -> dict:
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return {}
    if model_type not in CONFIG_MAPPING:
        return {}
    out = {}
    for f in dataclasses.fields(CONFIG_MAPPING[model_type]):
        if f.name.startswith("_") or f.name in SKIP_FIELDS:
            continue
        s = py_to_schema(f.type)
        if s is not None:
            if f.name in ("num_key_value_heads",) or (f.default is None):
                s = _allow_null(s)
            out[f.name] = s
    return out


def _allow_null(s: dict) -> dict:
    if "type" in s:
        t = s["type"] if isinstance(s["type"], list) else [s["type"]]
        return {**s, "type": sorted(set(t) | {"null"})}
    if "anyOf" in s and {"type": "null"} not in s["anyOf"]:
        return {"anyOf": [*s["anyOf"], {"type": "null"}]}
    return s


def merge(loose: dict, strict: dict) -> dict:
    """COMMON's constraint where both type a key, unless the class allows null and COMMON does not."""
    out = dict(loose)
    for k, s in strict.items():
        if k in out and _allows_null(out[k]) and not _allows_null(s):
            s = _allow_null(s)
        out[k] = s
    return out


def _allows_null(s: dict) -> bool:
    t = s.get("type")
    if t == "null" or (isinstance(t, list) and "null" in t):
        return True
    return any(_allows_null(x) for x in s.get("anyOf", []))


def required_groups(arch) -> list[list[str]]:
    groups = []
    if arch.generic:
        return groups
    for q in ("num_layers", "hidden_size", "num_heads", "vocab_size"):
        keys = [s for s in arch.fields.get(q, []) if isinstance(s, str) and "." not in s]
        if keys:
            groups.append(keys)
    return groups


def build(arch) -> dict:
    acts = _activations()
    props = merge(class_properties(arch.model_type), COMMON)
    for k in ACT_KEYS:
        # remote-code models (the generic fallback) may register activations transformers does not know
        props[k] = {"type": "string"} if arch.generic else {"type": "string", "enum": acts}
    names = [arch.model_type, *arch.aliases]
    if not arch.generic:
        props["model_type"] = {"enum": names} if len(names) > 1 else {"const": names[0]}
    schema = {
        "$schema": DRAFT,
        "$id": f"https://kvtool.invalid/schemas/{arch.model_type}.json",
        "title": f"config.json of a {arch.model_type} model" if not arch.generic else "config.json of any model (fallback)",
        "description": arch.description,
        "type": "object",
        "properties": dict(sorted(props.items())),
        "additionalProperties": True,
        "$defs": {"rope_dict": ROPE_DICT},
    }
    groups = required_groups(arch)
    if groups:
        schema["allOf"] = [{"anyOf": [{"required": [k]} for k in g]} if len(g) > 1 else {"required": g} for g in groups]
    return schema


def main() -> None:
    from kvtool.model.architectures import all_architectures

    seen = set()
    for arch in all_architectures().values():
        if arch.model_type in seen:
            continue
        seen.add(arch.model_type)
        path = HERE / f"{arch.model_type}.json"
        path.write_text(json.dumps(build(arch), indent=1) + "\n")
    print(f"wrote {len(seen)} schemas to {HERE}")


if __name__ == "__main__":
    main()
