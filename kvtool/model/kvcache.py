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

from kvtool.model import kv_dtypes
from kvtool.model.layer_types import KV_CACHE_TYPES

# Bytes per element of model dtype names (config torch_dtype / dtype, torch spellings) and the dense KV dtypes.
KV_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8_inc": 1,
    "int8": 1,
}
# The values `--kv-cache-dtype` accepts: vLLM's own (kvtool/model/kv_dtypes.json; "auto" = the model's dtype).
KV_CACHE_DTYPES = kv_dtypes.names()


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

    def bytes_per_token(self, elem: "float | CacheFormat") -> float:
        """elem: bytes per element of a plain cache, or the CacheFormat of a --kv-cache-dtype (scales included)."""
        if isinstance(elem, CacheFormat):
            return elem.bytes_per_token(self)
        return self.elements_per_token * elem

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


@dataclass(frozen=True)
class CacheFormat:
    """How vLLM stores each layer's KV cache for one --kv-cache-dtype (a kv_dtypes row, never auto)."""

    dtype: kv_dtypes.KvDtype
    native_bytes: float = 2  # the model dtype's bytes per element: the layers vLLM leaves unquantized
    skip: frozenset = frozenset()  # indices of those layers (TurboQuant / UltraQuant boundary layers)
    rope_dim: int | None = None  # Octave packs rotary dims wider

    @property
    def name(self) -> str:
        return self.dtype.name

    def bytes_per_token(self, layer: LayerKV) -> float:
        if layer.kind == "none" or not layer.elements_per_token:
            return 0
        if layer.index in self.skip:
            return layer.elements_per_token * self.native_bytes
        if layer.kind == "MLA":
            return self.dtype.mla_bytes(layer.head_dim)
        return layer.kv_heads * self.dtype.slot_bytes(layer.head_dim, self.rope_dim)


_MODEL_DTYPES = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
# vllm/utils/torch_utils.py MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP (get_kv_cache_quant_algo_string)
MODELOPT_KV_ALGOS = {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}


SERVED_DTYPES = ("auto", "float16", "bfloat16", "float32")  # vLLM's --dtype values kvtool sizes


def native_kv_dtype(spec, served: str = "auto") -> tuple[str, str | None]:
    """The dtype vLLM serves the model in (--dtype: served), which `--kv-cache-dtype auto` caches in.

    vllm/config/model.py, _resolve_auto_dtype downcasts a float32 checkpoint to 16 bits ("Downcast for
    float32 models") under --dtype auto; any other --dtype is the model's and its cache's dtype."""
    if served != "auto":
        return served, None
    model = spec.dtype
    if not model:
        return "bfloat16", "config names no dtype: auto assumed a 16-bit model"
    if dtype_bytes(model) >= 4:
        return "bfloat16", f"auto: vLLM serves a {model} checkpoint in 16 bits by default, so its KV cache is 16-bit"
    return _MODEL_DTYPES.get(str(model).lower(), str(model)), None


def modelopt_kv_dtype(spec) -> tuple[str, str] | None:
    """What `--kv-cache-dtype auto` becomes for a ModelOpt checkpoint, and why (None: not one that says).

    vllm/utils/torch_utils.py, get_kv_cache_quant_algo_string (0.33.0): quant_method modelopt*, its
    kv_cache_scheme or kv_cache_quant_algo ("FP8" -> fp8_e4m3, "NVFP4" -> nvfp4, a dict of num_bits /
    type); anything else falls back to auto with a warning."""
    qc = spec.full_config.get("quantization_config")
    if not isinstance(qc, dict) or not str(qc.get("quant_method", "")).startswith("modelopt"):
        return None
    inner = qc.get("quantization", qc) if isinstance(qc.get("quantization", qc), dict) else qc
    algo = (inner.get("kv_cache_scheme") or qc.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo")
            or qc.get("kv_cache_quant_algo"))
    if not algo:
        return None
    if isinstance(algo, dict):
        if algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float":
            algo = "fp8"
        elif algo.get("num_bits") == 4 and algo.get("type") == "float":
            algo = "nvfp4"
    name = MODELOPT_KV_ALGOS.get(algo.lower()) if isinstance(algo, str) else None
    if name is None:
        return "auto", (f"auto: vLLM does not know ModelOpt's KV-cache algorithm {algo!r} (it knows "
                        f"{', '.join(MODELOPT_KV_ALGOS)}) and falls back to the model dtype")
    return name, f"auto: the checkpoint's ModelOpt kv_cache_quant_algo {algo!r} makes vLLM store {name}"


def serving_kv_dtype(spec, kv_cache_dtype: str = "auto") -> tuple[str, "float | CacheFormat", str | None]:
    """(dtype name, bytes per element or its CacheFormat, why) of the KV cache vLLM allocates: the one figure
    lint and kv-budget both print. A plain cache gives a float; a layout with scales, packing or unquantized
    boundary layers its CacheFormat (LayerKV.bytes_per_token takes either).

    auto follows vLLM 0.33: a ModelOpt checkpoint's KV-cache algorithm (modelopt_kv_dtype); a declared
    kv_cache_scheme (llm-compressor / quantize-kv) stores fp8; otherwise the model's 16-bit dtype.
    """
    fmt, why = cache_format(spec, kv_cache_dtype, refuse=False)
    plain = fmt.dtype.layout == "dense" and not fmt.skip
    return fmt.name, (fmt.dtype.element_bits / 8 if plain else fmt), why


def dtype_refusal(spec, row: kv_dtypes.KvDtype, native: str | None = None) -> str | None:
    """Why vLLM would refuse this KV-cache dtype for this model, or None: no in-tree attention backend for its
    attention kind, a float16 / bfloat16 cache that is not the model's dtype, a head size its packing cannot take."""
    native = native or native_kv_dtype(spec)[0]
    kind = kv_dtypes.attention_kind(spec)
    if kind not in row.attention:
        serves = " or ".join(kv_dtypes.KIND_WORDS[k] for k in row.attention) or "no attention kind"
        return (f"vLLM {kv_dtypes.release()} has no attention backend that stores {row.name} for "
                f"{kv_dtypes.KIND_WORDS[kind]}; {row.name} serves {serves}")
    if row.must_match_model and row.name != native:
        return (f"vLLM refuses kv_cache_dtype {row.name} for a model served in {native} "
                f"(VllmConfig._reject_mismatched_float_kv_cache); use auto or {native}")
    if kind == "standard" and spec.head_dim:
        return row.slot_problem(spec.head_dim, spec.rotary_dim)
    return None


def cache_format(spec, kv_cache_dtype: str = "auto", *, refuse: bool = True,
                 served: str = "auto") -> tuple[CacheFormat, str | None]:
    """vLLM's KV-cache layout for `--kv-cache-dtype` on this model, and a note on how auto resolved.

    refuse: a UsageError (field kv_cache_dtype) for a dtype vLLM would refuse on this model: no in-tree
    attention backend for its attention kind, a float16 / bfloat16 cache that is not the model's dtype, a
    head size the packing cannot take. refuse=False (lint's summary) sizes it anyway."""
    from kvtool.errors import UsageError

    native, why = native_kv_dtype(spec, served)
    name = kv_cache_dtype
    if name == "auto":
        modelopt = modelopt_kv_dtype(spec)
        qc = spec.full_config.get("quantization_config")
        if modelopt is not None:
            name, why = modelopt
        elif isinstance(qc, dict) and qc.get("kv_cache_scheme"):
            name, why = "fp8", ("auto: the checkpoint declares a kv_cache_scheme (llm-compressor), so vLLM stores "
                                "the KV cache in fp8")
        if name == "auto":
            name = native
    else:
        why = None
    row = kv_dtypes.get(name)
    if row is None:  # a model dtype outside vLLM's KV names (float8 weights...): a plain cache of its size
        row = replace(kv_dtypes.get("bfloat16"), name=name, storage=name, must_match_model=False,
                      element_bits=int(dtype_bytes(name) * 8))
    kind = kv_dtypes.attention_kind(spec)
    problem = dtype_refusal(spec, row, native)
    if problem and refuse:
        raise UsageError(problem, option="kv_cache_dtype")
    if problem:  # lint's summary: vLLM would not start (KV805 says why); size the model dtype's cache instead
        row, why = kv_dtypes.get(native) or row, f"{name} is not served here ({problem}): sized as {native}"
    if kind == "mla_sparse" and name in ("auto", "fp8", "fp8_e4m3") and row.name != "fp8_ds_mla":
        # mla_attention.py _canonicalize_sparse_mla_kv_cache_dtype: the backend, not the flag, decides
        why = ((why + "; ") if why else "") + (
            "FLASHMLA_SPARSE stores any quantized cache, and FLASHINFER_MLA_SPARSE_SM120 auto / fp8 too, as "
            f"fp8_ds_mla ({kv_dtypes.get('fp8_ds_mla').token_bytes} B per token per layer)")
    return CacheFormat(row, dtype_bytes(native), boundary_skip(row, spec.layer_types), spec.rotary_dim), why


def boundary_skip(row: kv_dtypes.KvDtype, layer_types) -> frozenset:
    """The layers vLLM keeps in the model dtype for this dtype: the first and last boundary_layers (at most half
    the layers each), none in a model with Mamba / linear-attention layers (TurboQuantConfig.get_boundary_skip_layers)."""
    if not row.boundary_layers or any(t in ("mamba", "linear_attention") for t in layer_types):
        return frozenset()
    n = min(row.boundary_layers, len(layer_types) // 2)
    return frozenset(range(n)) | frozenset(range(len(layer_types) - n, len(layer_types)))
