"""The fp8_ds_mla codec (kvtool/eval/codecs/ds_mla.py): DeepSeek V3.2's 656-byte sparse-MLA token.

vLLM 0.33 writes it in CUDA only (concat_and_cache_ds_mla_kernel); no Python or Triton version ships, so the match
is assumed (the row's assumption: per-128 tile scale amax / 448 in float32, saturating round-to-nearest e4m3).
What is checked here against vLLM's source is the layout the codec quantizes: 512 latent values in tiles of 128
with a float32 scale each, 64 rope values in 16 bits, 656 bytes in all.
"""

from __future__ import annotations

import pytest
import torch

from kvtool.eval import codecs
from kvtool.eval.codecs import ds_mla
from kvtool.model import kv_dtypes, kv_emulations
from tests.oracle.test_vllm_facts import _segments


def _rt(x, role):
    r = kv_emulations.get("fp8_ds_mla")
    return codecs.get(r.codec)(x, role=role, params=dict(r.params), row=kv_dtypes.get("fp8_ds_mla"), scale=None)


def _latent(seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 1, 9, 512, generator=g) * torch.tensor([0.01, 1.0, 30.0, 500.0]).repeat_interleave(128)
    x[1, 0, 3, :128] = 0.0  # an all-zero tile
    return x.to(dtype)


def test_latent_tiles_of_128_scaled_by_amax_over_448():
    """Assumed (CUDA-only writer): each tile of 128 latent values is stored as e4m3(x / s), s = amax / 448 in float32,
    and read back as e4m3 * s; the tile's largest value comes back exactly, a zero tile as zeros."""
    x = _latent(0)
    got = _rt(x, "latent")
    assert got.dtype == x.dtype and got.shape == x.shape
    t = x.float().reshape(2, 1, 9, 4, 128)
    s = t.abs().amax(-1, keepdim=True) / 448.0
    q = (t / torch.where(s == 0, torch.ones_like(s), s)).to(torch.float8_e4m3fn).float()
    assert torch.equal(got, (q * s).reshape(x.shape).to(x.dtype))
    top = t.abs().argmax(-1, keepdim=True)
    assert torch.equal(got.float().reshape(t.shape).gather(-1, top), t.gather(-1, top).to(x.dtype).float())
    assert not got[1, 0, 3, :128].any()
    # e4m3 keeps 3 mantissa bits: within half an ulp (1/16 relative) of each normal value, whatever the tile's range
    err = (got.float() - x.float()).abs().reshape(t.shape)
    assert bool((err <= t.abs() / 16 + s * 2.0 ** -9).all())


def test_rope_key_is_stored_unquantized_and_the_batch_rows_are_independent():
    g = torch.Generator().manual_seed(1)
    rope = torch.randn(3, 1, 5, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(_rt(rope, "rope"), rope)
    x = _latent(2)
    assert torch.equal(_rt(x, "latent")[1:], _rt(x[1:], "latent"))
    with pytest.raises(ValueError, match="not 'k'"):
        _rt(x, "k")


def test_the_layout_is_vllms_656_byte_token():
    """vLLM 0.33's own numbers: 656 bytes per token (MLAAttention.get_kv_cache_spec), which is 512 e4m3 values, one
    float32 scale per tile of 128 and 64 rope values of 2 bytes; the scales are vLLM's own (checkpoint's ignored)."""
    spec = _segments("vllm/model_executor/layers/attention/mla_attention.py")["MLAAttention.get_kv_cache_spec"]
    assert 'state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(' in spec
    latent, rope = 512, 64
    assert latent + latent // ds_mla.TILE * 4 + rope * 2 == 656 == kv_dtypes.get("fp8_ds_mla").token_bytes
    assert kv_emulations.get("fp8_ds_mla").scales == "dynamic"
