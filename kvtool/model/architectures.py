"""Architecture tables: one JSON file per model_type under schemas/architectures/.

A table says where each normalised quantity lives in config.json (with defaults and conditions),
how attention is laid out, and which tensors hold the attention projections. Everything that
differs between architectures is looked up here, never branched on in code. Tables are
validated strictly: an unknown key is an error, so dead fields cannot creep in.

Weight names are the ones hub checkpoints store (which transformers sometimes renames at load:
exaone, nemotron_h, gpt_neox's embed_out). `defaults` are transformers' config-class defaults, applied
when a key is absent (an explicit null wins). `legacy_keys` lists keys a table reads that
transformers' class does not define (remote-code or pre-v5 spellings); tests/model/test_architectures.py
checks every other key against transformers. Multimodal wrappers (text_config & co.) are described
in schemas/wrappers.json: the inner table to use and the weight-name prefixes the wrapper adds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from kvtool.errors import InputError
from kvtool.model.layer_types import RESOLVERS
from kvtool.registry import Registry


def schemas_dir() -> Path:
    """schemas/ in a source checkout, kvtool/_schemas in an installed wheel."""
    package = Path(__file__).resolve().parent.parent  # kvtool/
    for cand in (package.parent / "schemas", package / "_schemas"):
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
    "num_experts", "experts_per_token", "num_shared_experts", "moe_layer_freq", "first_k_dense", "moe_intermediate_size",
    "bos_token_id", "eos_token_id", "pad_token_id",
    "alibi", "attention_chunk_size", "max_window_layers", "use_sliding_window", "layer_types",
)

ATTENTION_KINDS = ("gqa", "mla")
POSITIONS = ("rope", "alibi", "learned", "none")
# Fused QKV row layouts (kvtool/convert/fused.py splits them): concat = [q | k | v] (phi3, mpt, dbrx);
# falcon = per KV group [q x H/KV, k, v] (falcon, InternLM2 wqkv); bloom / neox = per head [q, k, v];
# bigcode = concat with one KV head, per head otherwise.
QKV_LAYOUTS = ("concat", "falcon", "bloom", "neox", "bigcode")
# Which dims of a head RoPE rotates together: rotate_half pairs (i, i + r/2) (llama and most models);
# interleaved pairs (2i, 2i + 1) (cohere, gptj, llama4's complex form). attention.rope_layout, default rotate_half.
ROPE_LAYOUTS = ("rotate_half", "interleaved")
WEIGHT_ROLES = ("q", "k", "v", "o", "qkv")
MLA_ROLES = ("q_a", "q_b", "q", "kv_a", "kv_b", "indexer")
NORM_SCOPES = ("head", "all")

_TOP_KEYS = {"model_type", "aliases", "architectures", "description", "defaults", "fields", "kv_head_fields",
             "attention", "weights", "convert", "wrapper_keys", "legacy_keys"}
# rope_types: the rope types the config class accepts when it accepts fewer than all (transformers'
# Phi3Config.validate_rope raises for any type but default / longrope); absent: every type.
# hidden_divisible_by_heads: the config class refuses hidden_size % num_attention_heads != 0 even with
# head_dim set (transformers' validate_architecture of LlamaConfig, Gemma3TextConfig, ...).
# rope_rewrites: legacy type names the config class renames before validating (Phi3Config: su, yarn -> longrope).
# rope_per_layer_type: the config class keeps rope_parameters nested per layer type (Olmo3Config,
# Gemma3TextConfig); a flat one beside rope_scaling fails there (KeyError 'full_attention').
_ATTN_KEYS = {"kind", "position", "layer_types", "kv_cache", "rope_layout", "rope_types", "rope_rewrites",
              "hidden_divisible_by_heads", "rope_per_layer_type"}
# bias: roles whose projection always carries a bias; transposed: GPT-2 Conv1D weights stored [in, out];
# base_prefix: leading prefix that checkpoints saved from the base model class (not *ForCausalLM) lack.
# q_gated: q_proj also emits a per-head output gate, so it has 2 x heads x head_dim rows (Qwen3-Next / 3.5).
# qk_norm_when: {config key: value} under which the attention normalises q/k per head (optional norms,
# e.g. cohere's use_qk_norm); absent: whenever q_norm / k_norm are listed.
_WEIGHT_KEYS = {"layer", "attention", "q", "k", "v", "o", "qkv", "qkv_layout", "q_norm", "k_norm",
                "k_norm_scope", "embed", "lm_head", "mla", "bias", "transposed", "base_prefix", "q_gated",
                "qk_norm_when"}
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
    # config keys the table reads that transformers' config class does not define (remote-code or pre-v5 names)
    legacy_keys: tuple[str, ...] = ()

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
            if "when" in src and not (isinstance(src["when"], dict) and src["when"]):
                _fail(file, f"fields.{name}: 'when' must be a non-empty object")
            if "key" in src and not (isinstance(src["key"], str) and src["key"]):
                _fail(file, f"fields.{name}: 'key' must be a non-empty string")
    for list_key in ("aliases", "architectures", "kv_head_fields", "legacy_keys"):
        vals = data.get(list_key, [])
        if not isinstance(vals, list) or not all(isinstance(v, str) and v for v in vals):
            _fail(file, f"{list_key} must be a list of non-empty strings")
    if not isinstance(data.get("defaults", {}), dict):
        _fail(file, "defaults must be an object")
    attn = data["attention"]
    if set(attn) - _ATTN_KEYS:
        _fail(file, f"attention: unknown keys {sorted(set(attn) - _ATTN_KEYS)}")
    if attn.get("kind") not in ATTENTION_KINDS:
        _fail(file, f"attention.kind must be one of {ATTENTION_KINDS}")
    if attn.get("position") not in POSITIONS:
        _fail(file, f"attention.position must be one of {POSITIONS}")
    if attn.get("rope_layout") not in (None, *ROPE_LAYOUTS):
        _fail(file, f"attention.rope_layout must be one of {ROPE_LAYOUTS}")
    for flag in ("hidden_divisible_by_heads", "rope_per_layer_type"):
        if not isinstance(attn.get(flag, False), bool):
            _fail(file, f"attention.{flag} must be true or false")
    rts = attn.get("rope_types")
    if rts is not None and not (isinstance(rts, list) and rts and all(isinstance(t, str) and t for t in rts)):
        _fail(file, "attention.rope_types must be a non-empty list of rope type names")
    rw = attn.get("rope_rewrites", {})
    if not (isinstance(rw, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in rw.items())):
        _fail(file, "attention.rope_rewrites must map rope type names to rope type names")
    for r in attn.get("layer_types", []):
        if r not in RESOLVERS:
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
    for tmpl in ("layer", "attention"):
        if tmpl in w and "{layer}" not in str(w[tmpl]):
            _fail(file, f"weights.{tmpl} must contain {{layer}}")
    bias = w.get("bias", [])
    if not isinstance(bias, list) or set(bias) - set(WEIGHT_ROLES):
        _fail(file, f"weights.bias must be a list of roles from {WEIGHT_ROLES}")
    if w.get("qkv") and any(w.get(r) for r in ("q", "k", "v")):
        _fail(file, "weights: a fused qkv excludes separate q / k / v")
    if w.get("qkv") and not w.get("qkv_layout"):
        _fail(file, "weights.qkv needs a qkv_layout")
    when = w.get("qk_norm_when")
    if when is not None and not (isinstance(when, dict) and when and all(isinstance(k, str) and k for k in when)):
        _fail(file, "weights.qk_norm_when must be a non-empty object {config key: value}")
    for flag in ("transposed", "q_gated"):
        if flag in w and not isinstance(w[flag], bool):
            _fail(file, f"weights.{flag} must be true or false")
    mla = w.get("mla", {})
    if not isinstance(mla, dict) or set(mla) - set(MLA_ROLES):
        _fail(file, f"weights.mla keys must be from {MLA_ROLES}")
    if (attn.get("kind") == "mla") != bool(mla):
        _fail(file, "weights.mla is required for, and only for, attention.kind mla")
    conv = data["convert"]
    if set(conv) - _CONVERT_KEYS:
        _fail(file, f"convert: unknown keys {sorted(set(conv) - _CONVERT_KEYS)}")
    if not isinstance(conv.get("supported"), bool):
        _fail(file, "convert.supported must be true or false")
    if conv["supported"] is False and not conv.get("reason"):
        _fail(file, "convert.reason is required when convert.supported is false")
    return Architecture(
        model_type=data["model_type"],
        aliases=tuple(data.get("aliases", ())),
        architectures=tuple(data.get("architectures", ())),
        description=data.get("description", ""),
        defaults=dict(data.get("defaults", {})),
        fields=fields,
        kv_head_fields=tuple(data.get("kv_head_fields", ())),
        attention={"layer_types": ["all_full"], "kv_cache": True, "rope_layout": "rotate_half", **attn},
        weights=w,
        convert=conv,
        generic=data["model_type"] == "generic",
        source_file=file,
        legacy_keys=tuple(data.get("legacy_keys", ())),
    )


@lru_cache(maxsize=None)
def all_architectures() -> Registry[Architecture]:
    """model_type (and alias) -> table: every schemas/architectures/*.json, loaded once."""
    out: Registry[Architecture] = Registry("architecture")
    for path in sorted((schemas_dir() / "architectures").glob("*.json")):
        _add(out, path)
    if "generic" not in out:
        raise InputError("schemas/architectures/generic.json is missing")
    for arch in {id(a): a for a in out.values()}.values():
        _check_alternative(arch, out)
    return out


def add_table(path: str | Path) -> Architecture:
    """Make one more table known (a table kept outside schemas/architectures/: a plug-in, a test)."""
    tables = all_architectures()
    arch = _add(tables, Path(path))
    _check_alternative(arch, tables)
    return arch


def _add(tables: Registry[Architecture], path: Path) -> Architecture:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"invalid JSON at line {exc.lineno}: {exc.msg}", file=str(path)) from None
    arch = _validate(data, path.name)
    if path.stem != arch.model_type:
        _fail(path.name, f"file name must equal model_type {arch.model_type!r}")
    for key in (arch.model_type, *arch.aliases):
        if key in tables:
            _fail(path.name, f"model_type {key!r} is defined twice")
        tables.add(key, arch)
    return arch


def _check_alternative(arch: Architecture, tables) -> None:
    alt = arch.convert.get("alternative")
    if alt is not None and alt not in tables:
        _fail(arch.source_file, f"convert.alternative {alt!r} is not a known model_type")


def lookup(model_type: str | None) -> Architecture:
    """The table for a model_type, or the generic table (callers report the fallback)."""
    tables = all_architectures()
    if model_type and model_type in tables:
        return tables[model_type]
    return tables["generic"]


def is_known(model_type: str | None) -> bool:
    return bool(model_type) and model_type in all_architectures() and model_type != "generic"


# --- multimodal wrappers and stored weight names ----------------------------------------------

@dataclass(frozen=True)
class Wrapper:
    model_type: str
    config_key: str
    text_model_type: str
    weight_layouts: tuple[dict, ...]  # each: {old prefix: new prefix} applied to the text table's names


_WRAPPER_KEYS = {"config_key", "text_model_type", "weight_layouts"}


@lru_cache(maxsize=None)
def all_wrappers() -> dict[str, Wrapper]:
    """schemas/wrappers.json, validated strictly."""
    path = schemas_dir() / "wrappers.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read the wrapper table: {exc}", file=str(path)) from None
    if not isinstance(data, dict) or set(data) - {"description", "wrappers"} or not isinstance(data.get("wrappers"), dict):
        _fail(path.name, "expected {description, wrappers: {model_type: {...}}}")
    out: dict[str, Wrapper] = {}
    for mt, w in data["wrappers"].items():
        if not isinstance(w, dict) or set(w) != _WRAPPER_KEYS:
            _fail(path.name, f"wrappers.{mt}: keys must be exactly {sorted(_WRAPPER_KEYS)}")
        layouts = w["weight_layouts"]
        if not isinstance(layouts, list) or not all(
                isinstance(r, dict) and r and all(isinstance(k, str) and isinstance(v, str) for k, v in r.items())
                for r in layouts):
            _fail(path.name, f"wrappers.{mt}.weight_layouts: must be a list of {{prefix: prefix}} objects")
        out[mt] = Wrapper(mt, w["config_key"], w["text_model_type"], tuple(layouts))
    return out


def wrapper(model_type: str | None) -> Wrapper | None:
    return all_wrappers().get(model_type) if model_type else None


_NAME_KEYS = ("layer", "attention", "embed", "lm_head")


def renamed(arch: Architecture, renames: dict[str, str]) -> Architecture:
    """The table with every weight-name template's leading prefix renamed (first match wins)."""
    def ren(name: str) -> str:
        for old, new in renames.items():
            if name.startswith(old):
                return new + name[len(old):]
        return name

    w = dict(arch.weights)
    for key in _NAME_KEYS:
        if isinstance(w.get(key), str):
            w[key] = ren(w[key])
    return replace(arch, weights=w)


def fit_weight_names(arch: Architecture, tensor_names, wrapper_type: str | None = None) -> Architecture:
    """The table's weight names as this checkpoint stores them.

    Tries the table as written, then each layout of the multimodal wrapper, then the names without
    `weights.base_prefix` (checkpoints saved from the base model class, e.g. BLOOM's `h.0...`), and
    keeps the first under which layer 0's attention or the embedding exists. Unchanged if none fits.
    """
    names = set(tensor_names)
    if not names:
        return arch
    candidates: list[dict[str, str]] = [{}]
    wr = wrapper(wrapper_type)
    if wr is not None:
        candidates += list(wr.weight_layouts)
    if arch.weights.get("base_prefix"):
        candidates.append({arch.weights["base_prefix"]: ""})
    for ren in candidates:
        cand = renamed(arch, ren) if ren else arch
        if _fits(cand, names):
            return cand
    return arch


def _fits(arch: Architecture, names: set[str]) -> bool:
    prefix = arch.attn_prefix(0) + "."
    if any(n.startswith(prefix) for n in names):
        return True
    return bool(arch.weights.get("embed")) and arch.weights["embed"] in names
