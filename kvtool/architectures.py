"""Architecture tables: one JSON file per model_type under schemas/architectures/.

A table says where each normalised quantity lives in config.json (with defaults and conditions),
how attention is laid out, and which tensors hold the attention projections. Everything that
differs between architectures is looked up here, never branched on in code. Tables are
validated strictly: an unknown key is an error, so dead fields cannot creep in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from kvtool.errors import InputError


def schemas_dir() -> Path:
    """schemas/ in a source checkout, kvtool/_schemas in an installed wheel."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "schemas", here / "_schemas"):
        if cand.is_dir():
            return cand
    raise InputError("kvtool's schemas folder is missing from the installation")


# Normalised quantities a table may map. Each maps to a list of *sources*, tried in order:
#   "key.path"                              value of that (dotted) config key when present and not null
#   {"key": "k", "when": {"k2": v}}         same, only if every condition holds (defaults applied)
#   {"const": v, "when": {...}}             a constant
#   {"ref": "num_heads"}                    another normalised quantity
FIELDS = (
    "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
    "max_position", "sliding_window", "intermediate_size", "dtype", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "rotary_dim",
    "sliding_rope_theta",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "num_experts", "experts_per_token", "num_shared_experts", "moe_layer_freq", "first_k_dense",
    "bos_token_id", "eos_token_id", "pad_token_id",
    "alibi", "attention_chunk_size", "max_window_layers", "use_sliding_window",
)

ATTENTION_KINDS = ("gqa", "mla")
POSITIONS = ("rope", "alibi", "learned", "none")
# Layer-type resolvers, tried in the order a table lists them (see kvtool/layer_types.py).
LAYER_RESOLVERS = (
    "layer_types", "sliding_window_pattern", "alternating", "max_window_layers",
    "sliding_if_window", "hybrid_override_pattern", "chunked_no_rope", "all_full",
)
QKV_LAYOUTS = ("concat", "falcon", "bloom", "neox", "bigcode")
NORM_SCOPES = ("head", "all")

_TOP_KEYS = {"model_type", "aliases", "architectures", "description", "defaults", "fields", "kv_head_fields",
             "attention", "weights", "convert", "wrapper_keys"}
_ATTN_KEYS = {"kind", "position", "layer_types", "kv_cache"}
_WEIGHT_KEYS = {"layer", "attention", "q", "k", "v", "o", "qkv", "qkv_layout", "q_norm", "k_norm",
                "k_norm_scope", "embed", "lm_head", "mla", "bias"}
_CONVERT_KEYS = {"supported", "reason", "alternative", "approximate", "only"}


@dataclass(frozen=True)
class Architecture:
    model_type: str
    aliases: tuple[str, ...]
    architectures: tuple[str, ...]
    description: str
    defaults: dict
    fields: dict  # FIELDS name -> list of sources
    kv_head_fields: tuple[str, ...]  # config keys convert rewrites with the new KV-head count
    attention: dict
    weights: dict
    convert: dict
    generic: bool = False
    source_file: str = ""

    # --- weight-name templates -------------------------------------------------------------
    def attn_prefix(self, layer: int) -> str:
        return self.weights["attention"].replace("{layer}", str(layer))

    def tensor_name(self, role: str, layer: int, suffix: str = "weight") -> str | None:
        """Full tensor name for a role (q, k, v, o, qkv, q_norm, k_norm) in a layer, or None."""
        local = self.weights.get(role)
        if not local:
            return None
        return f"{self.attn_prefix(layer)}.{local}.{suffix}"

    @property
    def fused_qkv(self) -> bool:
        return bool(self.weights.get("qkv"))


def _fail(file: str, msg: str) -> None:
    raise InputError(msg, file=file)


def _validate(data: dict, file: str) -> Architecture:
    if not isinstance(data, dict):
        _fail(file, "architecture table is not an object")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        _fail(file, f"unknown keys {sorted(unknown)}")
    for req in ("model_type", "fields", "attention", "weights", "convert"):
        if req not in data:
            _fail(file, f"missing required key {req!r}")
    fields = data["fields"]
    bad = set(fields) - set(FIELDS)
    if bad:
        _fail(file, f"fields: unknown quantities {sorted(bad)}")
    for name, sources in fields.items():
        if not isinstance(sources, list):
            _fail(file, f"fields.{name}: must be a list of sources")
        for src in sources:
            if isinstance(src, str):
                continue
            if not isinstance(src, dict) or not (set(src) <= {"key", "const", "ref", "when"}) or len(set(src) & {"key", "const", "ref"}) != 1:
                _fail(file, f"fields.{name}: bad source {src!r}")
            if "ref" in src and src["ref"] not in FIELDS:
                _fail(file, f"fields.{name}: unknown ref {src['ref']!r}")
    attn = data["attention"]
    if set(attn) - _ATTN_KEYS:
        _fail(file, f"attention: unknown keys {sorted(set(attn) - _ATTN_KEYS)}")
    if attn.get("kind") not in ATTENTION_KINDS:
        _fail(file, f"attention.kind must be one of {ATTENTION_KINDS}")
    if attn.get("position") not in POSITIONS:
        _fail(file, f"attention.position must be one of {POSITIONS}")
    for r in attn.get("layer_types", []):
        if r not in LAYER_RESOLVERS:
            _fail(file, f"attention.layer_types: unknown resolver {r!r}")
    w = data["weights"]
    if set(w) - _WEIGHT_KEYS:
        _fail(file, f"weights: unknown keys {sorted(set(w) - _WEIGHT_KEYS)}")
    if w.get("qkv_layout") not in (None, *QKV_LAYOUTS):
        _fail(file, f"weights.qkv_layout must be one of {QKV_LAYOUTS}")
    if w.get("k_norm_scope") not in (None, *NORM_SCOPES):
        _fail(file, f"weights.k_norm_scope must be one of {NORM_SCOPES}")
    if "attention" not in w:
        _fail(file, "weights.attention (module path template) is required")
    conv = data["convert"]
    if set(conv) - _CONVERT_KEYS:
        _fail(file, f"convert: unknown keys {sorted(set(conv) - _CONVERT_KEYS)}")
    return Architecture(
        model_type=data["model_type"],
        aliases=tuple(data.get("aliases", ())),
        architectures=tuple(data.get("architectures", ())),
        description=data.get("description", ""),
        defaults=dict(data.get("defaults", {})),
        fields=fields,
        kv_head_fields=tuple(data.get("kv_head_fields", ())),
        attention={"layer_types": ["all_full"], "kv_cache": True, **attn},
        weights=w,
        convert=conv,
        generic=data["model_type"] == "generic",
        source_file=file,
    )


@lru_cache(maxsize=None)
def all_architectures() -> dict[str, Architecture]:
    """model_type (and alias) -> table, loaded once."""
    out: dict[str, Architecture] = {}
    for path in sorted((schemas_dir() / "architectures").glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise InputError(f"invalid JSON at line {exc.lineno}: {exc.msg}", file=str(path)) from None
        arch = _validate(data, path.name)
        if path.stem != arch.model_type:
            _fail(path.name, f"file name must equal model_type {arch.model_type!r}")
        for key in (arch.model_type, *arch.aliases):
            if key in out:
                _fail(path.name, f"model_type {key!r} is defined twice")
            out[key] = arch
    if "generic" not in out:
        raise InputError("schemas/architectures/generic.json is missing")
    return out


def lookup(model_type: str | None) -> Architecture:
    """The table for a model_type, or the generic table (callers report the fallback)."""
    tables = all_architectures()
    if model_type and model_type in tables:
        return tables[model_type]
    return tables["generic"]


def is_known(model_type: str | None) -> bool:
    return bool(model_type) and model_type in all_architectures() and model_type != "generic"
