"""KV-cache arithmetic per layer, from a ModelSpec (no torch).

GQA-family layers cache 2 (K and V) x kv_heads x head_dim elements per token; MLA layers cache one
latent of kv_lora_rank + qk_rope_head_dim elements per token; sliding-window and chunked layers
hold at most the window; linear-attention / Mamba layers keep no per-token cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.layer_types import KV_CACHE_TYPES

# Bytes per element for KV-cache dtype names (vLLM's --kv-cache-dtype values and torch names).
KV_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8_inc": 1,
    "int8": 1,
}


def dtype_bytes(name: str | None, default: float = 2) -> float:
    if not name:
        return default
    return KV_DTYPE_BYTES.get(str(name).lower(), default)


@dataclass(frozen=True)
class LayerKV:
    index: int
    layer_type: str  # full_attention | sliding_attention | chunked_attention | linear_attention | mamba | ...
    kind: str  # MHA | MQA | GQA | MLA | none
    kv_heads: int
    head_dim: int
    window: int | None  # tokens kept at most (sliding / chunked layers)
    elements_per_token: int  # cached elements per token in this layer (K and V together)

    def bytes_per_token(self, elem_bytes: float) -> float:
        return self.elements_per_token * elem_bytes

    def tokens_cached(self, seq_len: int) -> int:
        return seq_len if self.window is None else min(seq_len, self.window)


def attention_kind(num_heads: int | None, kv_heads: int | None) -> str:
    if not num_heads or not kv_heads:
        return "GQA"
    if kv_heads == num_heads:
        return "MHA"
    if kv_heads == 1:
        return "MQA"
    return "GQA"


def layers(spec, *, kv_heads: int | None = None) -> list[LayerKV]:
    """Per-layer KV layout; `kv_heads` overrides the config (what-if / convert plans)."""
    out: list[LayerKV] = []
    h = spec.num_heads
    kvh = kv_heads if kv_heads is not None else spec.num_kv_heads
    hd = spec.head_dim
    for i, lt in enumerate(spec.layer_types):
        if lt not in KV_CACHE_TYPES:
            out.append(LayerKV(i, lt, "none", 0, 0, None, 0))
            continue
        window = None
        if lt == "sliding_attention":
            window = spec.sliding_window
        elif lt == "chunked_attention":
            window = spec.get("attention_chunk_size")
        if spec.is_mla:
            latent = int(spec.get("kv_lora_rank", 0)) + int(spec.get("qk_rope_head_dim", 0) or 0)
            out.append(LayerKV(i, lt, "MLA", 1, latent, window, latent))
            continue
        if not kvh or not hd:
            out.append(LayerKV(i, lt, attention_kind(h, kvh), kvh or 0, hd or 0, window, 0))
            continue
        out.append(LayerKV(i, lt, attention_kind(h, kvh), kvh, hd, window, 2 * kvh * hd))
    return out


def bytes_per_token(spec, elem_bytes: float, *, kv_heads: int | None = None) -> float:
    """KV bytes one token costs across all layers (window limits ignored: the per-token rate)."""
    return sum(layer.bytes_per_token(elem_bytes) for layer in layers(spec, kv_heads=kv_heads))


def bytes_per_sequence(spec, seq_len: int, elem_bytes: float, *, block_size: int = 1,
                       kv_heads: int | None = None) -> float:
    """KV bytes for one sequence of seq_len tokens, each layer rounded up to whole blocks."""
    total = 0.0
    for layer in layers(spec, kv_heads=kv_heads):
        tokens = layer.tokens_cached(seq_len)
        if block_size > 1:
            tokens = -(-tokens // block_size) * block_size
        total += tokens * layer.bytes_per_token(elem_bytes)
    return total


def model_dtype_bytes(spec) -> float:
    return dtype_bytes(spec.dtype, default=2)
