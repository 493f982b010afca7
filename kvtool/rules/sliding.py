"""Sliding windows and per-layer attention types (KV3xx)."""

from __future__ import annotations

from kvtool.rules.registry import checker, define
from kvtool.model.layer_types import pattern_message, pattern_problems
from kvtool.values import is_int as _is_int

define("KV301", "sliding-window-invalid", "error",
       "sliding_window is neither a positive integer nor null",
       """
       What it does: checks that sliding_window (and the per-layer window fields the architecture
       table maps) is a positive integer or null.
       Why it matters: attention masks and the KV cache are sized from the window; 0, a negative
       number, a float or a string either crashes the model class or silently disables the window.
       A null window is an error too when layer_types names sliding_attention layers (transformers'
       Gemma-3 fails at the first forward building the sliding mask).
       Example: {"sliding_window": 0}  or  {"sliding_window": "4096"}
       Fix: set the window in tokens (e.g. 4096), or null for full attention.
       """, hint="set sliding_window to a positive token count or null", topic="sliding")

define("KV302", "sliding-window-flags", "warning",
       "use_sliding_window / max_window_layers do not describe any sliding layer",
       """
       What it does: for configs with the Qwen2-style switches, checks that use_sliding_window true
       comes with a window size and a max_window_layers below num_hidden_layers, and that
       max_window_layers is a non-negative integer.
       Why it matters: with use_sliding_window true, layers from max_window_layers on use the
       window; a max_window_layers >= num_hidden_layers or a null window means the switch does
       nothing, which is rarely what the author meant, and engines disagree on how to read it.
       Example: {"use_sliding_window": true, "sliding_window": null}
       Fix: set sliding_window and max_window_layers consistently, or use_sliding_window false.
       """, hint="make use_sliding_window, sliding_window and max_window_layers agree", topic="sliding")

define("KV303", "sliding-window-exceeds-context", "info",
       "The sliding window is at least max_position_embeddings, so it never limits attention",
       """
       What it does: notes a sliding window that is not shorter than the model's context length on a
       model whose layers are resolved as sliding.
       Why it matters: such a window is a no-op; KV-cache estimates that assume a window save nothing.
       Example: {"sliding_window": 262144, "max_position_embeddings": 131072}  (Phi-3.5)
       Fix: nothing to fix if intended; otherwise set the real window.
       """, hint="", topic="sliding")

define("KV304", "layer-types-length", "error",
       "layer_types does not have one entry per hidden layer (or a layer pattern is empty)",
       """
       What it does: checks that the layer_types list has exactly num_hidden_layers entries, and that a
       layer pattern that sets the layer count itself (nemotron_h's hybrid_override_pattern /
       layers_block_type) is not empty.
       Why it matters: transformers raises at config load when the lengths differ, and engines
       that index layer_types[i] read past the end or misassign windows.
       Example: {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"]}
       Fix: write one entry per layer.
       """, hint="give layer_types exactly one entry per hidden layer", topic="sliding")

define("KV305", "layer-types-unknown", "error",
       "layer_types, or another layer-pattern field, holds a value transformers refuses",
       """
       What it does: checks every layer-pattern field kvtool reads as transformers' config class
       validates it (kvtool.model.layer_types.pattern_problems): every layer_types entry against the
       values transformers accepts (full_attention, sliding_attention, chunked_attention,
       linear_attention, ...; PreTrainedConfig.validate_layer_type), nemotron_h's
       hybrid_override_pattern (a string of M E * -: NemotronHConfig._pattern_to_list) and
       layers_block_type (NemotronHConfig.validate_layer_type), and sliding_window_pattern (a
       positive integer: transformers computes (i + 1) % pattern). Every command that computes per
       layer refuses the same config, with the same line.
       Why it matters: transformers rejects unknown values at load; a typo such as "sliding" would
       otherwise decide how much KV cache a layer keeps.
       Example: {"layer_types": ["full_attention", "sliding"]}; {"hybrid_override_pattern": "M*Q"}
       Fix: use one of the known values (see `kvtool rule KV305`).
       """, hint="use full_attention, sliding_attention, chunked_attention or linear_attention", topic="sliding")


@checker("sliding")
def check_window_value(ctx) -> None:
    spec = ctx.spec
    r = spec.values.get("sliding_window")
    if "sliding_window" in ctx.config and ctx.config["sliding_window"] is None and \
            "sliding_attention" in spec.layer_types:
        # transformers' gemma3 builds its sliding mask from the window: a TypeError at the first forward
        key = spec.prefixed("sliding_window")
        ctx.report("KV301", f"{key} is null but the layer types include sliding_attention layers: they need a "
                            "window", path=key)
        return
    if r is None or r.key is None or (_is_int(r.value) and r.value > 0):
        return  # absent, null, a table default, or fine
    key = spec.key("sliding_window")
    ctx.report("KV301", f"{key} is {r.value!r}; it must be a positive integer (tokens) or null", path=key)


@checker("sliding")
def check_window_flags(ctx) -> None:
    spec, cfg = ctx.spec, ctx.config
    if "use_sliding_window" not in cfg and "max_window_layers" not in cfg:
        return
    use = cfg.get("use_sliding_window")
    mwl = cfg.get("max_window_layers")
    n = spec.num_layers
    p_use, p_mwl = spec.prefixed("use_sliding_window"), spec.prefixed("max_window_layers")
    if mwl is not None and (not _is_int(mwl) or mwl < 0):
        ctx.report("KV302", f"{p_mwl} is {mwl!r}; it must be a non-negative integer (layer index)", path=p_mwl)
        return
    if use is not True:
        return
    window = cfg.get("sliding_window")
    if window is None:
        ctx.report("KV302", f"{p_use} is true but {spec.prefixed('sliding_window')} is null: no layer can slide",
                   path=p_use)
    elif _is_int(mwl) and n and mwl >= n:
        ctx.report("KV302", f"{p_use} is true but {p_mwl} = {mwl} >= num_hidden_layers = {n}: "
                            "no layer uses the window", path=p_mwl)


@checker("sliding")
def check_window_vs_context(ctx) -> None:
    spec = ctx.spec
    w, mp = spec.sliding_window, spec.max_position
    if not (_is_int(w) and w > 0 and _is_int(mp) and mp > 0):
        return
    if "sliding_attention" not in spec.layer_types or w < mp:
        return
    key = spec.key("sliding_window") or "sliding_window"
    ctx.report("KV303", f"{key} = {w} >= {spec.key('max_position') or 'max_position_embeddings'} = {mp}: "
                        "the window never limits attention", path=key)


@checker("sliding")
def check_layer_types(ctx) -> None:
    for code, path, what in pattern_problems(ctx.spec):
        ctx.report(code, pattern_message(path, what), path=path)
