"""KV-cache arithmetic per layer, from a ModelSpec (no torch).

GQA-family layers cache 2 (K and V) x kv_heads x head_dim elements per token; MLA layers cache one
latent of kv_lora_rank + qk_rope_head_dim elements per token (not per head, no factor 2);
sliding-window and chunked layers hold at most the window; linear-attention / Mamba layers keep no
per-token cache. `paged_tokens` reproduces how vLLM's paged allocator sizes each layer
(vllm/v1/kv_cache_interface.py: FullAttentionSpec / SlidingWindowSpec / ChunkedLocalAttentionSpec
.max_memory_usage_bytes), and `kv_heads_per_gpu` / `tp_refusal` its tensor-parallel head split
(QKVParallelLinear, ModelConfig.verify_with_parallel_config).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtool.model.layer_types import KV_CACHE_TYPES

# Bytes per element for KV-cache dtype names (vLLM's --kv-cache-dtype values and torch names).
KV_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8_inc": 1,
    "int8": 1,
}
# The values `--kv-cache-dtype` accepts ("auto" = the model's dtype, as in vLLM).
KV_CACHE_DTYPES = ("auto", "fp16", "bf16", "fp32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


def dtype_bytes(name: str | None, default: float = 2) -> float:
    if not name:
        return default
    return KV_DTYPE_BYTES.get(str(name).lower(), default)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerKV:
    index: int
    layer_type: str  # full_attention | sliding_attention | chunked_attention | linear_attention | mamba | ...
    kind: str  # MHA | MQA | GQA | MLA | none
    kv_heads: int
    head_dim: int
    window: int | None  # tokens kept at most (sliding / chunked layers)
    elements_per_token: int  # cached elements per token in this layer (K and V together)
    num_heads: int = 0  # query heads, for the group size

    @property
    def group_size(self) -> int | None:
        """Query heads per KV head (GQA-family layers only)."""
        if self.kind in ("MLA", "none") or not self.kv_heads or not self.num_heads:
            return None
        return self.num_heads // self.kv_heads if self.num_heads % self.kv_heads == 0 else None

    def bytes_per_token(self, elem_bytes: float) -> float:
        return self.elements_per_token * elem_bytes

    def tokens_cached(self, seq_len: int) -> int:
        return seq_len if self.window is None else min(seq_len, self.window)

    def paged_tokens(self, seq_len: int, block_size: int, batched_tokens: int, *, hybrid: bool = True) -> int:
        """Token slots vLLM reserves for this layer for one sequence of seq_len tokens.

        Full layers: whole blocks for every token. Sliding layers: the last window-1 tokens plus
        batched_tokens (the tokens in flight, chunked prefill: kvtool.budget.paging), plus one block because
        the window need not start on a block boundary. Chunked-local layers: the chunk plus batched_tokens.
        hybrid=False is vLLM with its hybrid KV-cache manager disabled: every layer is sized as full.
        """
        if self.kind == "none" or seq_len <= 0:
            return 0
        bs = max(1, block_size)
        if self.window is None or not hybrid:
            return cdiv(seq_len, bs) * bs
        if self.layer_type == "chunked_attention":
            return cdiv(min(self.window + batched_tokens, seq_len), bs) * bs
        return (cdiv(min(self.window - 1 + batched_tokens, seq_len), bs) + 1) * bs

    def on_gpu(self, tensor_parallel_size: int) -> "LayerKV":
        """This layer's share on one of T tensor-parallel GPUs."""
        if tensor_parallel_size <= 1 or self.kind in ("MLA", "none"):
            return self  # vLLM keeps the whole MLA latent on every GPU
        kvh = kv_heads_per_gpu(self.kv_heads, tensor_parallel_size)
        per_head = self.elements_per_token // self.kv_heads if self.kv_heads else 0
        return replace(self, kv_heads=kvh, elements_per_token=per_head * kvh)


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
    h = spec.num_heads or 0
    kvh = kv_heads if kv_heads is not None else spec.num_kv_heads
    hd = spec.head_dim
    for i, lt in enumerate(spec.layer_types):
        if lt not in KV_CACHE_TYPES:
            out.append(LayerKV(i, lt, "none", 0, 0, None, 0, h))
            continue
        window = None
        if lt == "sliding_attention":
            window = spec.sliding_window
        elif lt == "chunked_attention":
            window = spec.number("attention_chunk_size")
        if spec.is_mla:
            latent = _dim(spec.number("kv_lora_rank")) + _dim(spec.number("qk_rope_head_dim"))
            out.append(LayerKV(i, lt, "MLA", 1, latent, window, latent, h))
            continue
        if not kvh or not hd:
            out.append(LayerKV(i, lt, attention_kind(h, kvh), kvh or 0, hd or 0, window, 0, h))
            continue
        out.append(LayerKV(i, lt, attention_kind(h, kvh), kvh, hd, window, 2 * kvh * hd, h))
    return out


def _dim(v) -> int:
    """A positive int config size, else 0: junk (NaN, 1e308, strings) is lint's to report, not arithmetic's."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def bytes_per_token(spec, elem_bytes: float, *, kv_heads: int | None = None) -> float:
    """KV bytes one token costs across all layers (window limits ignored: the per-token rate)."""
    return sum(layer.bytes_per_token(elem_bytes) for layer in layers(spec, kv_heads=kv_heads))


def bytes_per_sequence(spec, seq_len: int, elem_bytes: float, *, block_size: int = 1,
                       kv_heads: int | None = None) -> float:
    """KV bytes one sequence of seq_len tokens holds (windows applied), each layer rounded up to whole blocks."""
    total = 0.0
    for layer in layers(spec, kv_heads=kv_heads):
        tokens = layer.tokens_cached(seq_len)
        if block_size > 1:
            tokens = cdiv(tokens, block_size) * block_size
        total += tokens * layer.bytes_per_token(elem_bytes)
    return total


def kv_heads_per_gpu(kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each GPU stores: an even share, or one replicated head when there are fewer heads than GPUs."""
    if tensor_parallel_size <= 1 or kv_heads <= 0:
        return kv_heads
    if tensor_parallel_size >= kv_heads:
        return 1
    return cdiv(kv_heads, tensor_parallel_size)


def kv_replication(kv_heads: int, tensor_parallel_size: int) -> int:
    """How many GPUs hold a copy of each KV head (1 = no replication)."""
    if tensor_parallel_size <= kv_heads or kv_heads <= 0:
        return 1
    return tensor_parallel_size // kv_heads


def tp_refusal(num_heads: int | None, kv_heads: int | None, tensor_parallel_size: int, *, mla: bool = False) -> str | None:
    """Why vLLM would refuse this tensor-parallel size, or None.

    vLLM requires num_attention_heads % T == 0; its QKV projection then splits KV heads evenly
    when T < kv_heads (kv_heads % T == 0) or replicates them when T >= kv_heads (T % kv_heads == 0).
    MLA has a single latent per token, replicated on every GPU, so only the query-head rule applies.
    """
    t = tensor_parallel_size
    if t <= 1:
        return None
    if num_heads and num_heads % t:
        return f"num_attention_heads ({num_heads}) is not divisible by the tensor-parallel size ({t})"
    if mla or not kv_heads:
        return None
    if t < kv_heads and kv_heads % t:
        return f"num_key_value_heads ({kv_heads}) is not divisible by the tensor-parallel size ({t})"
    if t > kv_heads and t % kv_heads:
        return (f"the tensor-parallel size ({t}) is not a multiple of num_key_value_heads ({kv_heads}), "
                "so KV heads cannot be replicated evenly")
    return None


def model_dtype_bytes(spec) -> float:
    return dtype_bytes(spec.dtype, default=2)


def serving_kv_dtype(spec, kv_cache_dtype: str = "auto") -> tuple[str, float, str | None]:
    """(dtype name, bytes per element, why) of the KV cache vLLM allocates: the one figure lint and
    kv-budget both print.

    auto follows vLLM 0.33: a declared kv_cache_scheme (llm-compressor / quantize-kv) stores fp8;
    otherwise the cache takes the model's compute dtype, and vllm/config/model.py,
    _resolve_auto_dtype downcasts a float32 checkpoint to 16 bits ("Downcast for float32 models").
    """
    if kv_cache_dtype != "auto":
        return kv_cache_dtype, dtype_bytes(kv_cache_dtype), None
    qc = spec.full_config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("kv_cache_scheme"):
        return "fp8", 1, "auto: the checkpoint declares a kv_cache_scheme (llm-compressor), so vLLM stores the KV cache in fp8"
    model = spec.dtype
    if not model:
        return "bfloat16", 2, "config names no dtype: auto assumed a 16-bit model"
    if dtype_bytes(model) >= 4:
        return "bfloat16", 2, f"auto: vLLM serves a {model} checkpoint in 16 bits by default, so its KV cache is 16-bit"
    return model, dtype_bytes(model), None
