"""ModelSpec: the normalised view of a config (heads, head_dim, layer types, RoPE, MLA, MoE).

Built from the raw config through the architecture table; every command reads models through it.
Problems found while resolving (missing fields, wrong types) are kept in `issues` for lint to
report, so building a spec never raises on a bad config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtool.model.architectures import Architecture, lookup
from kvtool.model.rope.params import RopeParams, resolve_rope

WRAPPER_KEYS = ("text_config", "language_config", "llm_config", "thinker_config")
_MISSING = object()


def get_path(config: dict, dotted: str, default: Any = _MISSING) -> Any:
    cur: Any = config
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return default
        cur = cur[part]
    return cur


@dataclass(frozen=True)
class Resolved:
    value: Any
    key: str | None  # the dotted config key it came from (None for constants / defaults)


@dataclass
class ModelSpec:
    arch: Architecture
    config: dict  # the text-model config (inner dict for multimodal wrappers)
    full_config: dict
    wrapper_key: str | None
    model_type: str | None
    values: dict[str, Resolved] = field(default_factory=dict)
    layer_types: list[str] = field(default_factory=list)
    rope: dict[str, RopeParams] = field(default_factory=dict)  # layer type ("default" for all) -> params
    issues: list[tuple[str, str]] = field(default_factory=list)  # (dotted key, message)
    # Numeric values outside kvtool.model.numbers' bounds (quantity name or "rope:<type>:<key>" -> problem);
    # the accessors below return None for them, so nothing computes with a NaN or 10^9 layers.
    invalid: dict = field(default_factory=dict)

    # Convenience accessors ------------------------------------------------------------------
    def get(self, name: str, default: Any = None) -> Any:
        r = self.values.get(name)
        return default if r is None or r.value is None else r.value

    def number(self, name: str) -> Any:
        """A numeric value inside its bound, else None (kvtool.model.numbers reports why)."""
        return None if name in self.invalid else self.get(name)

    def key(self, name: str) -> str | None:
        """The config key a quantity was read from (prefixed with the wrapper key)."""
        r = self.values.get(name)
        if r is None or r.key is None:
            k = _first_key(self.arch.fields.get(name, []))
        else:
            k = r.key
        if k and self.wrapper_key:
            return f"{self.wrapper_key}.{k}"
        return k

    def prefixed(self, key: str) -> str:
        return f"{self.wrapper_key}.{key}" if self.wrapper_key else key

    @property
    def num_layers(self) -> int | None:
        return _pos(self.number("num_layers"))

    @property
    def num_heads(self) -> int | None:
        return _pos(self.number("num_heads"))

    @property
    def num_kv_heads(self) -> int | None:
        return _pos(self.number("num_kv_heads"))

    @property
    def hidden_size(self) -> int | None:
        return _pos(self.number("hidden_size"))

    @property
    def head_dim_explicit(self) -> bool:
        return self.get("head_dim") is not None

    @property
    def head_dim(self) -> int | None:
        hd = _pos(self.number("head_dim"))
        if hd:
            return hd
        h, n = self.hidden_size, self.num_heads
        if h and n and h % n == 0:
            return h // n
        return None

    @property
    def rotary_dim(self) -> int | None:
        rd = _int(self.number("rotary_dim"))
        if rd:
            return rd
        hd = self.head_dim
        if self.is_mla:
            return _int(self.number("qk_rope_head_dim"))
        if hd is None:
            return None
        prf = self.number("partial_rotary_factor")
        prf = 1.0 if prf is None else prf
        try:
            return int(hd * float(prf))
        except (TypeError, ValueError, OverflowError):  # junk or non-finite factors are findings elsewhere
            return hd

    @property
    def is_mla(self) -> bool:
        return self.arch.attention["kind"] == "mla" and self.get("kv_lora_rank") is not None

    @property
    def position(self) -> str:
        if self.get("alibi"):
            return "alibi"
        return self.arch.attention["position"]

    @property
    def max_position(self) -> int | None:
        return _pos(self.number("max_position"))

    @property
    def sliding_window(self) -> int | None:
        return _pos(self.number("sliding_window"))

    @property
    def dtype(self) -> str | None:
        d = self.get("dtype")
        return d if isinstance(d, str) else None


def _pos(v: Any) -> int | None:
    """A positive int, else None: sizes that are zero, negative or mistyped are findings, not arithmetic."""
    i = _int(v)
    return i if i is not None and i > 0 else None


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int):
        return None
    return v


def _first_key(sources: list) -> str | None:
    for s in sources:
        if isinstance(s, str):
            return s
        if isinstance(s, dict) and "key" in s:
            return s["key"]
    return None


def unwrap(config: dict) -> tuple[dict, str | None]:
    """Multimodal wrappers are linted as their text model."""
    for key in WRAPPER_KEYS:
        inner = config.get(key)
        if isinstance(inner, dict) and ("model_type" in inner or "num_hidden_layers" in inner):
            return inner, key
    return config, None


def build_spec(full_config: dict) -> ModelSpec:
    config, wrapper = unwrap(full_config)
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    if wrapper and model_type is None:
        from kvtool.model.architectures import wrapper as wrapper_table

        outer = full_config.get("model_type") if isinstance(full_config.get("model_type"), str) else None
        wt = wrapper_table(outer)
        model_type = wt.text_model_type if wt is not None else outer
    arch = lookup(model_type)
    spec = ModelSpec(arch=arch, config=config, full_config=full_config, wrapper_key=wrapper, model_type=model_type)
    for name in arch.fields:
        spec.values[name] = _resolve(spec, name, set())
    from kvtool.model.layer_types import resolve_layer_types
    from kvtool.model.numbers import invalid_quantities, invalid_rope

    spec.invalid = invalid_quantities(spec)  # before anything derives from the values
    spec.layer_types = resolve_layer_types(spec)
    spec.rope = resolve_rope(spec)
    spec.invalid.update(invalid_rope(spec))
    return spec


def _cond_holds(spec: ModelSpec, when: dict) -> bool:
    for k, want in when.items():
        have = get_path(spec.config, k, spec.arch.defaults.get(k))
        if have != want:
            return False
    return True


def _resolve(spec: ModelSpec, name: str, seen: set) -> Resolved:
    """First source with a value wins. A missing key's class default applies only once every alias key
    after it is also missing (gpt_neox: partial_rotary_factor, else rotary_pct, else 0.25), and before
    any const / ref fallback; an explicit null overrides the default (mistral v0.3 "sliding_window": null)."""
    if name in seen:
        return Resolved(None, None)
    seen = seen | {name}
    pending: Resolved | None = None
    for src in spec.arch.fields.get(name, []):
        if isinstance(src, str):
            src = {"key": src}
        if "when" in src and not _cond_holds(spec, src["when"]):
            continue
        if "key" in src:
            v = get_path(spec.config, src["key"])
            if v is not _MISSING and v is not None:
                return Resolved(v, src["key"])
            if pending is None and v is _MISSING and spec.arch.defaults.get(src["key"]) is not None:
                pending = Resolved(spec.arch.defaults[src["key"]], None)
            continue
        if pending is not None:
            return pending
        if "const" in src:
            return Resolved(src["const"], None)
        if "ref" in src:
            r = _resolve(spec, src["ref"], seen)
            if r.value is not None:
                return r
    return pending if pending is not None else Resolved(None, None)
