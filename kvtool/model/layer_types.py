"""Per-layer attention types, resolved by the resolvers an architecture table lists.

Types: full_attention, sliding_attention, chunked_attention, linear_attention, mamba, none
(a layer that keeps no KV cache). The first resolver that applies wins; each resolver mirrors how
transformers' config class builds `layer_types` for that family when the config does not carry it.
"""

from __future__ import annotations

from typing import Callable

from kvtool.registry import Registry

# Values transformers accepts in `layer_types` (configuration_utils.ALLOWED_LAYER_TYPES, v5) plus the
# legacy spellings it remaps on load.
KNOWN_LAYER_TYPES = (
    "full_attention", "sliding_attention", "chunked_attention", "window_attention", "indexed_attention",
    "compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse", "conv", "moe",
    "hybrid", "hybrid_sliding", "reference_sliding_attention", "linear_attention", "sparse", "dense",
    # legacy names remapped by transformers
    "mamba", "attention", "deepseek_sparse_attention", "qwen_sparse_attention",
)



def layer_types_problems(cfg: dict, key: str):
    """(rule code, config path, what is wrong) for a `layer_types` transformers would refuse: not a list,
    an unknown name, or a length other than num_hidden_layers. lint reports them (KV305, KV304);
    commands that compute per layer refuse the config, since every per-layer figure would be wrong."""
    lt = cfg.get("layer_types")
    if lt is None:
        return
    if not isinstance(lt, list):
        yield "KV305", key, f"is a {type(lt).__name__}; it must be a list of layer-type names"
        return
    # 5.25.0 checks layer_types against ALLOWED_ATTN_LAYER_TYPES: the MLP names (sparse, dense) are refused there
    bad = [(i, v) for i, v in enumerate(lt) if not isinstance(v, str) or v not in KNOWN_LAYER_TYPES
           or v in MLP_LAYER_TYPES]
    if bad:
        yield "KV305", f"{key}[{bad[0][0]}]", f"has unknown values: {_shown(bad)}"
    n = cfg.get("num_hidden_layers")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0 and len(lt) != n:
        yield "KV304", key, f"has {len(lt)} entries but num_hidden_layers is {n}"
    # mlp_layer_types: PreTrainedConfig.validate_layer_type (5.25.0) checks it after layer_types, in the same loop,
    # which returns at the first list that is None: only a config with layer_types has it checked
    mlt = cfg.get("mlp_layer_types")
    if mlt is None:
        return
    mkey = key.rsplit(".", 1)[0] + ".mlp_layer_types" if "." in key else "mlp_layer_types"
    if not isinstance(mlt, list):
        yield "KV305", mkey, f"is a {type(mlt).__name__}; it must be a list of {', '.join(MLP_LAYER_TYPES)}"
        return
    bad = [(i, v) for i, v in enumerate(mlt) if not isinstance(v, str) or v not in MLP_LAYER_TYPES]
    if bad:
        yield "KV305", f"{mkey}[{bad[0][0]}]", f"has values transformers refuses: {_shown(bad)} (it takes " \
                                               f"{', '.join(MLP_LAYER_TYPES)})"
    elif isinstance(n, int) and not isinstance(n, bool) and n >= 0 and len(mlt) != n:
        yield "KV304", mkey, f"has {len(mlt)} entries but num_hidden_layers is {n}"

# nemotron_h: hybrid_override_pattern letters -> transformers' layer type (configuration_nemotron_h.py,
# NemotronHConfig._pattern_to_list, 5.25.0: `pattern_mapping[char]`, a KeyError on any other letter) and the
# layer types its validate_layer_type accepts (`valid_types`, a ValueError on any other).
NEMOTRON_H_LETTERS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
NEMOTRON_H_TYPES = ("full_attention", "linear_attention", "moe", "mlp")
# kvtool's own names for them (KV is cached by "full_attention" only)
_NEMOTRON_H_KVTOOL = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}


def _shown(bad: list) -> str:
    return ", ".join(f"[{i}] {v!r}" for i, v in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")


def _nemotron_layer_types(cfg: dict, key: str):
    """nemotron_h's layers_block_type / layer_types: transformers 5.25.0 configuration_nemotron_h.py,
    NemotronHConfig.validate_layer_type (a list of strings from `valid_types`; its length, not
    num_hidden_layers, is the layer count: no length check)."""
    from_key = "layers_block_type" if "layers_block_type" in cfg else "layer_types"
    lt = cfg.get(from_key)
    if lt is None:
        return
    path = key.rsplit(".", 1)[0] + "." + from_key if "." in key else from_key
    if not isinstance(lt, list):
        yield "KV305", path, f"is a {type(lt).__name__}; transformers needs a list of strings (NemotronHConfig." \
                             "validate_layer_type)"
        return
    legacy = {"mamba": "linear_attention", "attention": "full_attention"}  # remap_legacy_layer_types
    bad = [(i, v) for i, v in enumerate(lt) if not isinstance(v, str) or legacy.get(v, v) not in NEMOTRON_H_TYPES]
    if bad:
        yield "KV305", f"{path}[{bad[0][0]}]", (f"has values transformers refuses: {_shown(bad)}; nemotron_h takes "
                                                f"{', '.join(NEMOTRON_H_TYPES)} (NemotronHConfig.validate_layer_type)")
    elif not lt:
        yield "KV304", path, "is empty: a model with no layers"


def hybrid_pattern_problems(cfg: dict, key: str):
    """nemotron_h's hybrid_override_pattern, read only where layers_block_type / layer_types is absent (as
    transformers 5.25.0 NemotronHConfig.__post_init__ does): a string of the letters M E * -, one per layer.
    Anything else fails in `_pattern_to_list` (KeyError on a letter, TypeError on a number)."""
    if cfg.get("layers_block_type") is not None or cfg.get("layer_types") is not None or \
            "hybrid_override_pattern" not in cfg:
        return
    pat = cfg["hybrid_override_pattern"]
    path = key.rsplit(".", 1)[0] + ".hybrid_override_pattern" if "." in key else "hybrid_override_pattern"
    if isinstance(pat, list) and all(isinstance(c, str) for c in pat):
        pat = "".join(c if len(c) == 1 else "\x00" for c in pat)  # transformers iterates a list as it does a string
    if not isinstance(pat, str):
        yield "KV305", path, (f"is {_clip(pat)}, not a string; transformers needs a string of the letters "
                              f"{' '.join(NEMOTRON_H_LETTERS)}, one per layer (NemotronHConfig._pattern_to_list)")
        return
    bad = [(i, c) for i, c in enumerate(pat) if c not in NEMOTRON_H_LETTERS]
    if bad:
        yield "KV305", path, (f"has letters transformers refuses: {_shown(bad)}; each layer is one of "
                              f"{', '.join(f'{k} ({v})' for k, v in NEMOTRON_H_LETTERS.items())} "
                              "(NemotronHConfig._pattern_to_list)")
    elif not pat:
        yield "KV304", path, "is empty: a model with no layers"


def _clip(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def sliding_pattern_problems(cfg: dict, key: str):
    """sliding_window_pattern where transformers builds layer_types from it (no layer_types given, a window
    set): `(i + 1) % pattern` (gemma3 / cohere2 / exaone4 configuration files, 5.25.0) fails on 0 and on
    anything but an integer; embedding_gemma2 refuses below 1 in so many words ("must be a positive integer")."""
    if cfg.get("layer_types") is not None or cfg.get("sliding_window") is None:
        return
    for name in ("sliding_window_pattern", "sliding_window_pattern_size"):
        if name not in cfg or cfg[name] is None:
            continue
        v = cfg[name]
        path = key.rsplit(".", 1)[0] + "." + name if "." in key else name
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            if isinstance(v, str) and v and set(v) <= {"L", "G"}:
                continue  # exaone4's "LLLG" spelling (its docstring; kvtool reads it as that)
            yield "KV305", path, (f"is {_clip(v)}; it must be a positive integer (every N-th layer global): "
                                  "transformers computes (i + 1) % sliding_window_pattern")
        return


def pattern_message(path: str, what: str) -> str:
    """The line a pattern problem is reported with: the field (without its index), then what is wrong."""
    return f"{path.split('[', 1)[0]} {what}"


def pattern_problems(spec):
    """(rule code, config path, what is wrong) for every layer-pattern field of spec's config that kvtool reads
    (the resolvers its architecture table lists) and transformers would refuse. lint reports them (KV304 /
    KV305); every command that computes per layer refuses the config (kvtool.model.numbers)."""
    cfg = spec.config
    key = spec.prefixed("layer_types")
    resolvers = spec.arch.attention.get("layer_types", []) if spec.arch is not None else []
    if "hybrid_override_pattern" in resolvers:  # nemotron_h: its own layer-type names and pattern letters
        yield from _nemotron_layer_types(cfg, key)
        yield from hybrid_pattern_problems(cfg, key)
    else:
        yield from layer_types_problems(cfg, key)
    if "sliding_window_pattern" in resolvers:
        yield from sliding_pattern_problems(cfg, key)


# configuration_utils.ALLOWED_MLP_LAYER_TYPES (transformers 5.25.0)
MLP_LAYER_TYPES = ("sparse", "dense")

KV_CACHE_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
KNOWN_TYPES = KV_CACHE_TYPES + ("linear_attention", "mamba", "none", "mlp", "moe")
# Names real configs carry (older transformers, remote code, DSA indexers) -> the type kvtool reasons with.
# An indexed (DeepSeek sparse attention) layer still caches every token's MLA latent: full attention for KV.
ALIASES = {
    "attention": "full_attention",
    "indexed_attention": "full_attention",
    "deepseek_sparse_attention": "full_attention",
    "hybrid": "full_attention",
    "hybrid_sliding": "sliding_attention",
}
ACCEPTED_TYPES = KNOWN_TYPES + tuple(ALIASES)


def _cfg(spec, key):
    """A config key, else the table's default for it (transformers' class default)."""
    if key in spec.config:
        return spec.config[key]
    return spec.arch.defaults.get(key)


def _int(v):
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _layer_types(spec, n):
    lt = spec.get("layer_types") if "layer_types" in spec.arch.fields else spec.config.get("layer_types")
    if isinstance(lt, list) and lt and all(isinstance(x, str) for x in lt):
        return [ALIASES.get(x, x) for x in lt]
    return None


def _sliding_window_pattern(spec, n):
    if spec.sliding_window is None:
        return None
    pat = spec.config.get("sliding_window_pattern", spec.config.get("sliding_window_pattern_size"))
    if pat is None:
        pat = spec.arch.defaults.get("sliding_window_pattern")
    if _int(pat) is not None and pat > 0:
        # gemma3 / cohere2 / exaone4 / olmo3: every pat-th layer is global
        return ["sliding_attention" if (i + 1) % pat else "full_attention" for i in range(n)]
    if isinstance(pat, str) and pat and set(pat) <= {"L", "G"}:
        # exaone4: "LLLG" repeated; L = local (sliding), G = global
        return ["sliding_attention" if pat[i % len(pat)] == "L" else "full_attention" for i in range(n)]
    return None


def _alternating(spec, n):
    if spec.sliding_window is None:
        return None
    # gemma2 / gpt-oss: even layers slide, odd layers are global
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def _max_window_layers(spec, n):
    if not spec.get("use_sliding_window", False) or spec.sliding_window is None:
        return None
    mwl = _int(spec.number("max_window_layers"))
    if mwl is None:
        return None
    # qwen2 / qwen3: layers from max_window_layers on use the window
    return ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]


def _max_window_layers_alternating(spec, n):
    if not spec.get("use_sliding_window", False) or not spec.sliding_window:
        return None
    mwl = _int(spec.number("max_window_layers"))
    if mwl is None:
        return None
    # qwen2_moe: even layers below max_window_layers use the window
    return ["sliding_attention" if (i + 1) % 2 and i < mwl else "full_attention" for i in range(n)]


def _sliding_if_window(spec, n):
    if spec.sliding_window is None:
        return None
    return ["sliding_attention"] * n


def _hybrid_override_pattern(spec, n):
    pat = spec.config.get("hybrid_override_pattern")
    if isinstance(pat, list) and all(isinstance(c, str) for c in pat):
        pat = "".join(pat)  # ["M", "*"]: transformers iterates it as it iterates "M*"
    if not isinstance(pat, str) or not pat:
        return None
    # nemotron_h: M = mamba, * = attention, - = MLP, E = MoE (any other letter: pattern_problems refuses it)
    return [_NEMOTRON_H_KVTOOL.get(c, "none") for c in pat]


def _no_rope_flags(spec, n):
    nrl = spec.config.get("no_rope_layers")
    if isinstance(nrl, list) and len(nrl) == n:
        return [bool(flag) for flag in nrl]
    step = _int(_cfg(spec, "no_rope_layer_interval")) or 4
    return [(i + 1) % step != 0 for i in range(n)]


def _chunked_no_rope(spec, n):
    chunk = spec.number("attention_chunk_size")
    if not isinstance(chunk, int):
        return None
    # llama4: layers with RoPE (flag 1) use chunked local attention; NoPE layers are global
    return ["chunked_attention" if rope else "full_attention" for rope in _no_rope_flags(spec, n)]


def _no_rope_sliding(spec, n):
    if not spec.get("use_sliding_window", False) or spec.sliding_window is None:
        return None
    # smollm3: only NoPE layers (flag 0) use the sliding window
    return ["full_attention" if rope else "sliding_attention" for rope in _no_rope_flags(spec, n)]


def _full_attention_interval(spec, n):
    step = _int(_cfg(spec, "full_attention_interval"))
    if not step or step <= 0:
        return None
    # qwen3_next / qwen3_5: every step-th layer is full attention, the rest Gated DeltaNet
    return ["full_attention" if (i + 1) % step == 0 else "linear_attention" for i in range(n)]


def _all_full(spec, n):
    return ["full_attention"] * n


# attention.layer_types in a table names these, tried in the table's order ("all_full" last).
RESOLVERS: Registry[Callable] = Registry("layer-type resolver")
for _name, _fn in (
    ("layer_types", _layer_types),
    ("sliding_window_pattern", _sliding_window_pattern),
    ("alternating", _alternating),
    ("max_window_layers", _max_window_layers),
    ("max_window_layers_alternating", _max_window_layers_alternating),
    ("sliding_if_window", _sliding_if_window),
    ("hybrid_override_pattern", _hybrid_override_pattern),
    ("chunked_no_rope", _chunked_no_rope),
    ("no_rope_sliding", _no_rope_sliding),
    ("full_attention_interval", _full_attention_interval),
    ("all_full", _all_full),
):
    RESOLVERS.add(_name, _fn)
del _name, _fn


def resolve_layer_types(spec) -> list[str]:
    n = spec.num_layers
    if not n or n <= 0 or n > 100_000:
        return []
    for name in [*spec.arch.attention.get("layer_types", []), "all_full"]:
        out = RESOLVERS[name](spec, n)
        if out is not None:
            return out
    return []
