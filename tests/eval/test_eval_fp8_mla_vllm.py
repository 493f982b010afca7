"""kvtool/eval/fp8_mla.py's account of vLLM 0.33's FP8 MLA cache against vLLM's own source (verbatim excerpts in
tests/data/vllm/0.33.0/, copied by tests/data/vllm/extract.py): what is cached, after which step, with which scale,
how TRITON_MLA reads it back, which backends round the query, and which scale names the DeepSeek loader takes."""

from __future__ import annotations

import re

import pytest

from kvtool.eval import fp8_mla
from tests.oracle.test_vllm_facts import _function, _quiet_logger, _segments

MLA_ATTN = "vllm/model_executor/layers/attention/mla_attention.py"
TRITON = "vllm/v1/attention/backends/mla/triton_mla.py"


def _flat(code: str) -> str:
    return re.sub(r"\s+", " ", code)


def test_every_citation_is_an_excerpt():
    for c in fp8_mla.CITED:
        if c.function != "maybe_remap_kv_scale_name":
            assert c.function in _segments(c.file), c
    assert "maybe_remap_kv_scale_name" in _segments("vllm/model_executor/model_loader/weight_utils.py")


def test_the_cached_latent_is_normed_with_its_weight_and_the_rope_key_rotated_before_caching():
    fwd = _flat(_segments("vllm/model_executor/layers/mla.py")["MultiHeadLatentAttentionWrapper.forward"])
    norm = fwd.index("kv_c_normed = self.kv_a_layernorm(kv_c)")
    rot = fwd.index("q[..., self.qk_nope_head_dim :], k_pe = self.rotary_emb( positions, q[..., "
                    "self.qk_nope_head_dim :], k_pe )")
    call = fwd.index("attn_out = self.mla_attn( q, kv_c_normed, k_pe,")
    assert norm < call and rot < call


def test_one_scale_the_layer_k_scale_for_latent_and_rope_key():
    fwd = _flat(_segments(MLA_ATTN)["MLAAttention.forward"])
    assert ("self.update_kv_cache( kv_c_normed, k_pe, self_kv_cache, layer_slot_mapping, attn_metadata, "
            "self.kv_cache_dtype, self._k_scale, )") in fwd
    upd = _flat(_segments(MLA_ATTN)["MLAAttention.update_kv_cache"])
    assert "self.impl.do_kv_cache_update( # type: ignore[attr-defined] kv_c_normed, k_pe, kv_cache, slot_mapping, " \
           "kv_cache_dtype, k_scale," in upd
    write = _flat(_segments("vllm/v1/attention/backend.py")["MLAAttentionImpl.do_kv_cache_update"])
    assert ("ops.concat_and_cache_mla( kv_c_normed, k_pe.squeeze(1), kv_cache, slot_mapping.flatten(), "
            "kv_cache_dtype=kv_cache_dtype, scale=k_scale,") in write


def test_triton_mla_dequantizes_with_k_scale_and_keeps_the_query():
    init = _flat(_segments(TRITON)["TritonMLAImpl.__init__"])
    assert "if is_quantized_kv_cache(self.kv_cache_dtype): self.supports_quant_query_input = False" in init
    mqa = _flat(_segments(TRITON)["TritonMLAImpl.forward_mqa"])
    assert "k_scale=layer._k_scale, v_scale=layer._k_scale," in mqa
    kern = _flat(_segments("vllm/v1/attention/ops/triton_decode_attention.py")["_fwd_grouped_kernel_stage1"])
    assert "k = (k.to(tl.float32) * ks).to(q.dtype)" in kern
    assert "kpe = (kpe.to(tl.float32) * ks).to(qpe.dtype)" in kern


def test_other_dense_mla_backends_round_the_query_which_eval_refuses():
    assert "self.supports_quant_query_input = True" in _flat(_segments(MLA_ATTN)["MLACommonImpl.__init__"])
    flashmla = _flat(_segments("vllm/v1/attention/backends/mla/flashmla.py")["FlashMLAImpl.forward_mqa"])
    assert "descale_q=layer._q_scale.reshape(1)," in flashmla
    assert "flashmla" in str(fp8_mla.refuse_fp8_attention("triton")).lower()


def test_prefill_of_new_tokens_uses_the_unquantized_latent():
    # what the module docstring says of prompts: their own tokens are not read back from the cache
    mha = _flat(_segments(MLA_ATTN)["MLACommonBaseImpl.forward_mha"])
    assert "kv_nope = self.kv_b_proj(kv_c_normed)[0]" in mha
    assert "self._compute_prefill_context( q, kv_c_and_k_pe_cache, attn_metadata, k_scale )" in mha


@pytest.mark.parametrize("suffix,loaded", [("mla_attn.mla_attn.k_scale", True), ("k_proj.k_scale", True),
                                           ("k_scale", False), ("attn.k_scale", False), ("kv_scale", False)])
def test_the_deepseek_loader_takes_exactly_the_names_eval_reads(suffix, loaded):
    remap = _function("vllm/model_executor/model_loader/weight_utils.py", "maybe_remap_kv_scale_name",
                      logger=_quiet_logger())
    # the layer's parameter: DeepseekV2MLAAttention.mla_attn (the wrapper) .mla_attn (MLAAttention) .k_scale
    assert "self.mla_attn = MultiHeadLatentAttentionWrapper(" in _segments(
        "vllm/model_executor/models/deepseek_v2.py")["DeepseekV2MLAAttention.__init__"]
    assert "self.mla_attn = MLAAttention(" in _segments("vllm/model_executor/layers/mla.py")[
        "MultiHeadLatentAttentionWrapper.__init__"]
    prefix = "model.layers.3.self_attn"
    target = f"{prefix}.mla_attn.mla_attn.k_scale"
    params = {f"{prefix}.mla_attn.mla_attn.kv_b_proj.weight": None, target: None,
              f"{prefix}.mla_attn.mla_attn.v_scale": None}
    assert (remap(f"{prefix}.{suffix}", params) == target) is loaded
    assert (suffix in fp8_mla.K_SCALE_NAMES) is loaded
