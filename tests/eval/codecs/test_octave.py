"""The Octave codec (kvtool/eval/codecs/octave.py) against vLLM 0.33.0's PyTorch reference
(vllm/v1/attention/ops/rocm_octave.py `reference_quantize` / `reference_dequantize`, run here as it is). Each
test's docstring says whether the match is exact or assumed."""

from __future__ import annotations

import pytest
import torch

import vllm_reference
from kvtool.errors import InputError
from kvtool.eval.codecs import octave as oc
from kvtool.model import kv_dtypes, kv_emulations

NAMES = ("octave_k3v4", "octave_k3v3", "octave_k3v3_compact")


def _ref():
    return vllm_reference.load("v1/attention/ops/rocm_octave.py")


def test_constants_are_vllms():
    """Exact: block, bits, codebooks, seed and V bits / compact (kv_dtypes.json) are rocm_octave.py's."""
    ref = _ref()
    assert (oc.HADAMARD_BLOCK, oc.ROPE_BITS, oc.NOPE_BITS) == (ref.HADAMARD_BLOCK, ref.ROPE_BITS, ref.NOPE_BITS)
    assert (oc.LUT, oc.LUT_MULT, oc.LUT_ONE, oc.SIGN_SEED) == (ref.LUT, ref.LUT_MULT, ref.LUT_ONE, ref._SIGN_SEED)
    for name in NAMES:
        fmt = ref.OctaveFormat.from_cache_dtype(name, 256, 64)
        row = kv_dtypes.get(name)
        assert (row.value_bits, row.compact) == (fmt.v_bits, fmt.compact)
    for n in (64, 128, 256):
        assert torch.equal(oc.signs(n, "cpu"), ref.signs(n, "cpu"))


CASES = [(d, r) for d, r in ((64, 64), (128, 128), (128, 64), (256, 64), (256, 256))]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("d,rope", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_roundtrip_is_vllms_reference(name, d, rope, dtype):
    """Exact: K and V equal reference_dequantize(reference_quantize(K, V)) (un-rotated, float32, then x's
    dtype), bit for bit, for block and compact K, full and partial rotary dims (params rope_dim), head_dim
    64 to 256 (vLLM's kernels serve 256 with 64 rotary dims; the reference takes the rest). Assumed: the HIP
    kernels (csrc/attention/octave_attn.cu, no Python) compute what the reference does (the row says so)."""
    ref = _ref()
    g = torch.Generator().manual_seed(d + rope)
    k = (torch.randn(1, 2, 7, d, generator=g) * 3 + torch.randn(1, 2, 1, d, generator=g)).to(dtype)
    v = torch.randn(1, 2, 7, d, generator=g).to(dtype)
    v[..., 3, :] = 0.0  # an all-zero vector: scale 0
    fmt = ref.OctaveFormat.from_cache_dtype(name, d, rope)
    # the reference takes (T, H, D): the batch of one, tokens first
    rk, rv = ref.reference_dequantize(ref.reference_quantize(k[0].transpose(0, 1), v[0].transpose(0, 1), fmt), fmt)
    params = {**kv_emulations.get(name).params, "rope_dim": rope}
    row = kv_dtypes.get(name)
    assert torch.equal(oc.roundtrip(k, role="k", params=params, row=row), rk.transpose(0, 1)[None].to(dtype))
    assert torch.equal(oc.roundtrip(v, role="v", params=params, row=row), rv.transpose(0, 1)[None].to(dtype))


def test_rope_dim_defaults_to_the_whole_head_and_rows_stand_alone():
    """Exact: with the table's rope_dim (null: the hook had no rotary dims to give) or none, the codec codes every
    K dim at 4 bits (full rotary: rope_dim_from_hf_config's factor 1.0); a batch row's result does not depend on
    the others."""
    ref = _ref()
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 2, 5, 128, generator=g)
    row = kv_dtypes.get("octave_k3v4")
    assert ref.rope_dim_from_hf_config(object(), 128) == 128
    assert kv_emulations.get("octave_k3v4").params == {"rope_dim": None}
    full = oc.roundtrip(k, role="k", params=dict(kv_emulations.get("octave_k3v4").params), row=row)
    assert torch.equal(full, oc.roundtrip(k, role="k", params={}, row=row))
    assert torch.equal(full, oc.roundtrip(k, role="k", params={"rope_dim": 128}, row=row))
    assert not torch.equal(full, oc.roundtrip(k, role="k", params={"rope_dim": 64}, row=row))
    for i in range(3):
        assert torch.equal(full[i:i + 1], oc.roundtrip(k[i:i + 1], role="k", params={}, row=row))


def test_a_head_vllm_cannot_pack_is_one_line():
    """Exact (vLLM's own refusal, not a numeric match): vLLM's OctaveFormat refuses head_dim / rotary dims that are no multiple of 64 and a compact K of a
    head_dim that is no power of two; the codec says so in one line."""
    ref = _ref()
    for name, d, rope in (("octave_k3v4", 96, 96), ("octave_k3v4", 128, 32), ("octave_k3v3_compact", 192, 64)):
        with pytest.raises(ValueError):
            ref.OctaveFormat.from_cache_dtype(name, d, rope)
        with pytest.raises(InputError, match=name):
            oc.roundtrip(torch.randn(1, 1, 2, d), role="k", params={"rope_dim": rope}, row=kv_dtypes.get(name))


def test_the_hook_fills_the_models_rotary_dims():
    """Exact (against the codec): the rows leave rope_dim null; eval's hook fills it from the model (kv_emulation.model_params: the spec's
    rotary dims, what kv-budget sizes Octave's slot with), so a partially rotary head codes only its rotary
    blocks at 4 bits. Every null param of the table is one the hook knows how to fill."""
    from types import SimpleNamespace

    from kvtool.eval import kv_emulation

    for name, e in kv_emulations.table().items():
        assert {k for k, v in e.params.items() if v is None} <= set(kv_emulation.MODEL_PARAMS), name
    spec = SimpleNamespace(rotary_dim=64)
    hook = kv_emulation.build("octave_k3v4", None, 4, kv_emulation.model_params(spec))
    assert hook.params == {"rope_dim": 64}
    k = torch.randn(1, 2, 5, 128, generator=torch.Generator().manual_seed(2))
    row = kv_dtypes.get("octave_k3v4")
    got, _ = hook(1, k, k)
    assert torch.equal(got, oc.roundtrip(k, role="k", params={"rope_dim": 64}, row=row))
    assert not torch.equal(got, oc.roundtrip(k, role="k", params={}, row=row))
    assert kv_emulation.build("octave_k3v4", None, 4).params == {"rope_dim": None}  # unknown: the whole head


def test_long_prefills_attend_over_raw_kv_short_ones_read_the_cache():
    """Exact (read from vLLM's source): the rows' first_prefill "raw", for prompts longer than _DECODE_MAX_QUERY_LEN (128): forward sends a batch
    whose longest query is at most 128 tokens to the decode kernel over the packed cache, longer ones to
    _prefill, which reads the chunk's own K/V unquantized (the rows' assumption says so)."""
    src = "v1/attention/backends/rocm_octave_attn.py"
    assert vllm_reference.excerpt(src, "_DECODE_MAX_QUERY_LEN").strip() == "_DECODE_MAX_QUERY_LEN = 128"
    forward = vllm_reference.excerpt(src, "RocmOctaveAttentionImpl.forward")
    assert "if attn_metadata.max_query_len <= _DECODE_MAX_QUERY_LEN:" in forward and "self._prefill(" in forward
    assert "the chunks' own K/V unquantized" in vllm_reference.excerpt(src, "RocmOctaveAttentionImpl._prefill")
    for name in NAMES:
        e = kv_emulations.get(name)
        assert e.first_prefill == "raw" and "at most 128 tokens" in e.assumption
