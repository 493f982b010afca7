"""Per-layer attention types, resolved by the resolvers an architecture table lists.

Types: full_attention, sliding_attention, chunked_attention, linear_attention, mamba, none
(a layer that keeps no KV cache). The first resolver that applies wins.
"""

from __future__ import annotations

from typing import Callable

KV_CACHE_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
KNOWN_TYPES = KV_CACHE_TYPES + ("linear_attention", "mamba", "none", "mlp", "moe")


def _layer_types(spec, n):
    lt = spec.config.get("layer_types")
    if isinstance(lt, list) and lt and all(isinstance(x, str) for x in lt):
        return list(lt)
    return None


def _sliding_window_pattern(spec, n):
    pat = spec.config.get("sliding_window_pattern", spec.config.get("sliding_window_pattern_size"))
    if isinstance(pat, int) and not isinstance(pat, bool) and pat > 0:
        # gemma3: every pat-th layer is global
        return ["sliding_attention" if (i + 1) % pat else "full_attention" for i in range(n)]
    if isinstance(pat, str) and pat and set(pat) <= {"L", "G"}:
        # exaone4: "LLLG" repeated; L = local (sliding), G = global
        return ["sliding_attention" if pat[i % len(pat)] == "L" else "full_attention" for i in range(n)]
    return None


def _alternating(spec, n):
    if spec.sliding_window is None:
        return None
    # gemma2: even layers slide, odd layers are global
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def _max_window_layers(spec, n):
    if not spec.get("use_sliding_window", False) or spec.sliding_window is None:
        return None
    mwl = spec.get("max_window_layers")
    if not isinstance(mwl, int):
        return None
    # qwen2 family: layers from max_window_layers on use the window
    return ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]


def _sliding_if_window(spec, n):
    if spec.sliding_window is None:
        return None
    return ["sliding_attention"] * n


def _hybrid_override_pattern(spec, n):
    pat = spec.config.get("hybrid_override_pattern")
    if not isinstance(pat, str) or not pat:
        return None
    # nemotron_h: M = mamba, * = attention, - = MLP, E = MoE
    table = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}
    return [table.get(c, "none") for c in pat]


def _chunked_no_rope(spec, n):
    chunk = spec.get("attention_chunk_size")
    if not isinstance(chunk, int):
        return None
    nrl = spec.config.get("no_rope_layers")
    if isinstance(nrl, list) and len(nrl) == n:
        # llama4: layers with RoPE (flag 1) use chunked local attention; NoPE layers are global
        return ["chunked_attention" if flag else "full_attention" for flag in nrl]
    step = spec.config.get("no_rope_layer_interval", 4)
    return ["full_attention" if (i + 1) % step == 0 else "chunked_attention" for i in range(n)]


def _all_full(spec, n):
    return ["full_attention"] * n


RESOLVERS: dict[str, Callable] = {
    "layer_types": _layer_types,
    "sliding_window_pattern": _sliding_window_pattern,
    "alternating": _alternating,
    "max_window_layers": _max_window_layers,
    "sliding_if_window": _sliding_if_window,
    "hybrid_override_pattern": _hybrid_override_pattern,
    "chunked_no_rope": _chunked_no_rope,
    "all_full": _all_full,
}


def resolve_layer_types(spec) -> list[str]:
    n = spec.num_layers
    if not n or n <= 0 or n > 100_000:
        return []
    for name in [*spec.arch.attention.get("layer_types", []), "all_full"]:
        out = RESOLVERS[name](spec, n)
        if out is not None:
            return out
    return []
